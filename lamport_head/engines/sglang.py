"""SGLang adapter: route ``LogitsProcessor._logits_gatherer`` (the TP all-gather of the
vocab-parallel lm_head's ``[M, V/TP]`` shard, SGLang 0.5.23) through a HeadGather for
the rows the HEAD_GATHER table enables; docs/sglang.md lists the SGLang names.

``install_sglang_logits_gather`` is the explicit call; ``register`` is SGLang's
general plugin (entry point ``sglang.srt.plugins`` -> ``lamport_head``): it hooks
``ModelRunner.load_model`` (AFTER) through SGLang's ``HookRegistry``, so every TP
rank installs once its model is loaded, before SGLang captures its CUDA graphs, for
the rows its decode steps gather (``rows_from_sglang``: 1 .. max running requests x
logits rows per request, capped), and ``ModelRunner.update_model_fields`` (AFTER): a
new model object after a weight update is routed through the gather built at load
(``install.reroute``: no collective), or says in one line why it stays stock.
SGLang loads plugins before it configures logging, so ``register``'s line waits for
the first hook call (a record emitted earlier would be dropped).

Speculative decoding (EAGLE, EAGLE3, MTP, standalone drafts): SGLang's draft worker
builds its own ``ModelRunner`` (``is_draft_worker=True``) after the target's, inside the
draft's TP context (``get_tp_group()`` is then the draft's group), and its
``load_model`` fires the same hook: every rank of the draft TP group installs on the
draft model (``install_sglang_draft_gather``). Its processor is served by the target's
gather when it shares the target's TP group and its head has the target's shard width
(an EAGLE head of the target's vocabulary: no second mailbox, no collective,
``install.reroute``), else by its own install (an EAGLE3 head of ~32000, or its own
group; collective, agreed, fail-stop as the target's: a rank that cannot build makes
every rank keep SGLang's gather for the drafter, and the target's gather is not
touched). Its rows are a draft step's: 1 .. max running requests x
``speculative_eagle_topk`` (``draft_rows_from_sglang``). Rank 0 of the draft group
then logs one summary naming every routed path ("target logits gather, drafter
logits gather"). SGLang later hands the draft model the target's lm_head weight
(``set_embed_and_head`` for EAGLE, after load): a gather sees only ``[M, width]``
shards, so a width it was not built for goes to SGLang's gatherer, bitwise. A DSpark
draft (its base logits gathered by ``compute_base_logits``, outside any LogitsProcessor)
is ``sglang_dspark``'s: it installs once SGLang attaches the head.

The checks, the table's entries, the ranks' agreement and the build are the engine-neutral
install core's (``install.install`` on a ``GatherSite`` naming ``_logits_gatherer``):
the same fail-stop order, the same log lines as vLLM's. What is SGLang's own:
finding the processor and its lm_head, and leaving stock every configuration whose
logits do not take the plain TP all-gather along the last dim (DP attention,
``--enable-dp-lm-head``, the TP lm_head all-to-all, an FP32 lm_head output whose dtype
depends on the device), with one log line. An FP32 lm_head (``--enable-fp32-lm-head``,
or a model config's ``enable_lm_head_fp32``: ``use_fp32_lm_head``) gathers FP32 logits:
routed through a gather built for float32 (its table section measured for float32).
Everything not served (rows, dtype, shape, ...) calls SGLang's own gatherer, so its
result is SGLang's, bitwise. SGLang is imported only here, lazily.
"""

import functools
import importlib
import logging
from typing import NamedTuple

import torch

from .. import dtypes, install
from ..collective import all_min
from ..outcome import Outcome, Ranks, Reason
from ..table import MULTIMEM_STOCK, NCCL_STOCK
from . import measure_first_use

logger = logging.getLogger("lamport_head")

# SGLang's names we rely on, all here, checked against the sglang 0.5.23 wheel's source
# (docs/sglang.md): the hooked methods, and what the runtime context publishes.
GATHERER = "_logits_gatherer"  # LogitsProcessor's instance attribute: x [M, V/TP] -> [M, V]
# its class where SGLang builds the multimem one-shot gather (triton_symm_mem_ag), and
# the instance attribute that is None once SGLang disabled it (NCCL for good)
MULTIMEM_GATHERER = "MultimemAllGatherer"
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
LOAD_MODEL = f"{RUNNER}.load_model"  # (self) -> None; sets self.model
# (self, new_model, *, model_path, load_format, load_config) -> None: self.model = new_model
UPDATE_MODEL = f"{RUNNER}.update_model_fields"
CONTEXT = "sglang.srt.runtime_context"  # get_schedule(), get_parallel(), max_speculative_...
REQUESTS = "max_running_requests"  # get_schedule(): None until the KV pool resolves it
PER_REQUEST = "decode_num_tokens_per_req"  # ModelRunner: logits rows per decode batch slot
DRAFT_TOKENS = "max_speculative_num_draft_tokens"  # runtime_context: the largest draft count
DRAFT_WORKER = "is_draft_worker"  # ModelRunner: True for the draft worker's runner
SPEC = "get_spec"  # runtime_context: the speculative settings' bag
TOPK = "speculative_eagle_topk"  # get_spec(): draft rows per request a draft step (None: 1)
# LogitsProcessor attributes (0.5.23) that must exist for us to read its gather path.
_REQUIRED = (GATHERER, "do_tensor_parallel_all_gather", "use_attn_tp_group",
             "do_tensor_parallel_all_gather_dp_attn")
# Set when true: the logits of that configuration do not take the plain TP gather.
_VARIANTS = (
    ("use_attn_tp_group", "--enable-dp-lm-head gathers over the attention TP group"),
    ("do_tensor_parallel_all_gather_dp_attn", "DP attention gathers the logits across "
                                              "DP ranks"),
    ("use_tp_lm_head_all_to_all", "the TP lm_head all-to-all replaces the gather"),
    # FP32 only where SGLang's GEMM can write FP32 from BF16 (CUDA): the dtype is the device's
    ("use_fp32_lm_head_output", "FP32 lm_head output (enable_lm_head_output_fp32): its logits' "
                                "dtype depends on the device"),
)
FP32_HEAD = "use_fp32_lm_head"  # LogitsProcessor: the lm_head projects into FP32 logits
SOFTCAP = "final_logit_softcapping"  # with FP32 logits on CUDA, SGLang's fused gather+softcap


def find_logits_processor(model):
    """(owner, LogitsProcessor) of the outermost module that has both a
    ``logits_processor`` with a ``_logits_gatherer`` and an ``lm_head`` (a causal LM,
    or a multimodal model's ``language_model``); (None, None) if there is none."""
    modules = (m for _, m in model.named_modules()) if isinstance(model, torch.nn.Module) \
        else iter((model,))
    for owner in modules:
        lp = getattr(owner, "logits_processor", None)
        if lp is not None and hasattr(lp, GATHERER) and hasattr(owner, "lm_head"):
            return owner, lp
    return None, None


def _why_stock(lp, owner=None):
    """Why this LogitsProcessor's logits do not take the plain TP gather; None if they do.
    A fact of the model and its config, the same on every rank."""
    missing = [a for a in _REQUIRED if not hasattr(lp, a)]
    if missing:
        return f"this SGLang's LogitsProcessor lacks {', '.join(missing)} (not 0.5.23's)"
    if not lp.do_tensor_parallel_all_gather:
        return "SGLang does not gather the logits here (TP 1 or skip_all_gather)"
    for attr, why in _VARIANTS:
        if getattr(lp, attr, False):
            return why
    if _fp32_logits(lp, owner) and getattr(lp, SOFTCAP, None):
        return ("FP32 logits with final logit softcapping: SGLang's fused gather and softcap "
                "replaces the gather on CUDA")
    return None


def _sglang_tp():
    """SGLang's TP group: (agreement group: its CPU group where it has one, size, rank
    in group, device group)."""
    from sglang.srt.distributed.parallel_state import get_tp_group  # lazy: SGLang

    tp_group = get_tp_group()
    cpu = getattr(tp_group, "cpu_group", None)
    return (cpu if cpu is not None else tp_group.device_group, tp_group.world_size,
            tp_group.rank_in_group, tp_group.device_group)


def rows_from_sglang(runner):
    """The row counts an SGLang server's steps gather: 1 .. max running requests x logits
    rows per request (the runner's ``decode_num_tokens_per_req`` at the largest draft
    count: 1 without speculative decoding, the verified draft tokens with it), capped
    (``install.decode_rows``). Max running requests unset (SGLang sizes it from the KV
    pool after the model loads, thousands by default): up to the cap. None when this
    SGLang does not answer (not 0.5.23's names): the table's rows."""
    try:
        context = importlib.import_module(CONTEXT)
        requests = getattr(context.get_schedule(), REQUESTS)
        per_request = getattr(runner, PER_REQUEST)(
            num_draft_tokens=getattr(context, DRAFT_TOKENS)())
    except Exception as exc:  # the same SGLang and arguments on every rank: agreed anyway
        logger.debug("lamport-head: SGLang's rows unknown (%s: %s)", type(exc).__name__, exc)
        return None
    if requests is not None and (not isinstance(requests, int) or requests < 1):
        return None
    return install.decode_rows(requests, max(1, int(per_request)))


def draft_rows_from_sglang(runner):
    """The row counts a draft step's logits gather takes (SGLang's EAGLE worker: each
    draft decode step ``requests x speculative_eagle_topk`` rows, the draft extend
    one row a request): 1 .. max running requests x topk (1 when unset), capped
    (``install.decode_rows``). None when this SGLang does not answer: the table's rows."""
    try:
        context = importlib.import_module(CONTEXT)
        requests = getattr(context.get_schedule(), REQUESTS)
        topk = getattr(getattr(context, SPEC)(), TOPK)
    except Exception as exc:  # the same SGLang and arguments on every rank: agreed anyway
        logger.debug("lamport-head: SGLang's draft rows unknown (%s: %s)", type(exc).__name__,
                     exc)
        return None
    if requests is not None and (not isinstance(requests, int) or requests < 1):
        return None
    return install.decode_rows(requests, topk if isinstance(topk, int) and topk > 1 else 1)


def stock_kind(gatherer) -> str:
    """What SGLang's gatherer is, in the table's words (``table.STOCKS``): a
    ``MultimemAllGatherer`` SGLang left enabled (its ``_state`` is not None) is the
    multimem one-shot gather wherever it builds its buffer at its first call, and that
    callable is what first-use tuning times (it may still fall back to NCCL there:
    the section then holds figures against that fallback, still SGLang's own path);
    one SGLang disabled, or any other gatherer, gathers by NCCL."""
    if type(gatherer).__name__ == MULTIMEM_GATHERER and getattr(gatherer, "_state", None) is not None:
        return MULTIMEM_STOCK
    return NCCL_STOCK


def _fp32_logits(lp, owner):
    """Whether the logits reach the gatherer in FP32: an FP32 projection asked for
    (``use_fp32_lm_head``, any truthy value, as SGLang reads it) or an FP32 head."""
    head = getattr(getattr(owner, "lm_head", None), "base_layer", getattr(owner, "lm_head", None))
    weight = getattr(head, "weight", None)
    return bool(getattr(lp, FP32_HEAD, False)) or (
        torch.is_tensor(weight) and weight.dtype == torch.float32)


def _site(owner, lp):
    """The install core's view of this LogitsProcessor and its owner's lm_head. Its
    logits are FP32 where the processor projects into FP32 (``use_fp32_lm_head``) and
    the head is not LoRA-wrapped (SGLang calls a LoRA head's own forward, in its
    weight's dtype); else the weight's dtype. SGLang wraps the head for LoRA after
    ``load_model`` (``maybe_init_lora_manager``), after this hook: an FP32 projection
    with an lm_head LoRA builds a float32 gather that every call passes by, on every
    rank alike (the logits arrive in the weight's dtype): stock, but reported served."""
    wrapper = owner.lm_head
    head = getattr(wrapper, "base_layer", wrapper)  # a LoRA wrapper keeps the layer here
    lora = hasattr(wrapper, "set_lora") and hasattr(wrapper, "apply_lora")
    fp32 = bool(getattr(lp, FP32_HEAD, False)) and not lora
    return install.GatherSite(processor=lp, attr=GATHERER, weight=getattr(head, "weight", None),
                              head_tp=getattr(head, "tp_size", 1),
                              where=f"{type(owner).__name__}.logits_processor",
                              stock=stock_kind(getattr(lp, GATHERER, None)),
                              dtype=torch.float32 if fp32 else None)


def install_sglang_logits_gather(model_or_runner, group=None, tp=None, rank=None, device=None,
                                 dcp=1, rows=None):
    """Route the SGLang model's ``logits_processor._logits_gatherer`` (an instance
    attribute: other processors keep theirs) through a HeadGather for the table's
    enabled rows. ``model_or_runner``: the model (an ``nn.Module``) or SGLang's
    ``ModelRunner`` (its ``.model``). ``group``/``tp``/``rank`` default to SGLang's
    TP group (``get_tp_group()``: ``device_group``, ``world_size``, ``rank_in_group``),
    ``device`` to the lm_head weight's. Collective over the TP group when a table
    entry applies; call it on every TP rank after the model loads and before CUDA
    graph capture. ``rows``: the row counts its steps gather (``rows_from_sglang``);
    None: the table's rows. Returns an ``outcome.Outcome``: ``.rows`` served, or why
    SGLang's own gather stays (``.reason``, ``.message``)."""
    model = model_or_runner
    if not isinstance(model, torch.nn.Module) and hasattr(model, "model"):
        model = model.model  # a ModelRunner
    owner, lp = find_logits_processor(model)
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR,
                             f"no SGLang LogitsProcessor with {GATHERER} found")
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return Outcome.serving(installed.rows, dtype=install.gather_dtype(installed))
    why = _why_stock(lp, owner)
    if why is not None:
        return install.kept(Reason.SITE, why, "SGLang logits gather")
    site = _site(owner, lp)
    device_group = None
    if group is None or tp is None or rank is None:
        sg_group, sg_tp, sg_rank, sg_device_group = _sglang_tp()
        if group is None:
            group, device_group = sg_group, sg_device_group
        tp = sg_tp if tp is None else tp
        rank = sg_rank if rank is None else rank
    if device is None:
        device = site.weight.device if torch.is_tensor(site.weight) else "cpu"
    served = install.install(site, Ranks(group, tp, rank, device, dcp, device_group), rows,
                             measure=measure_first_use)
    if served.served:  # the core routed GATHERER: gather(logits, stock=SGLang's) for these rows
        if model is not model_or_runner and callable(getattr(model_or_runner, "forward", None)):
            poll_before_forward(model_or_runner, lp.head_gather)
        else:
            logger.info("lamport-head: installed on a model, not a ModelRunner's: whoever "
                        "replays its CUDA graphs calls head_gather.poll() before each replay")
    return served


POLLED = "lamport_head_gathers"  # ModelRunner attribute: the gathers its forward polls


def poll_before_forward(runner, gather):
    """Make ``runner.forward`` (SGLang's one entry for every batch, eager or a decode
    graph replay) call ``gather.poll()`` first.

    A replayed graph runs our kernel but not ``HeadGather.__call__``: without this, a
    peer's timeout would leave every later decode step delivering NaN logits with no
    rank raising. With it, every rank raises at the step after the failed one was seen,
    as in eager mode. Wraps the instance's ``forward`` once; later gathers join the list."""
    gathers = runner.__dict__.setdefault(POLLED, [])
    if any(g is gather for g in gathers):
        return
    gathers.append(gather)
    if len(gathers) > 1:
        return
    forward = runner.forward

    @functools.wraps(forward)
    def polled(*args, **kwargs):
        for g in gathers:
            g.poll()
        return forward(*args, **kwargs)

    runner.forward = polled


def _dcp_size():
    try:  # lazy: SGLang; older releases lack it
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:  # no published parallel state: no DCP
        return 1


def _after_load_model(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.load_model``: install on the target model; returns
    None (the hook keeps load_model's result). Every outcome of install, stock
    included, is agreed by the TP ranks, so nothing is caught here: an exception means
    this rank could not finish while its peers may wait in a collective, and it must
    stop the worker (fail-stop), not send this rank alone into SGLang's collectives."""
    _say_registered()
    dcp = _dcp_size()
    if getattr(runner, DRAFT_WORKER, False):
        from . import sglang_dspark  # lazy: it names this module's Target and helpers

        if sglang_dspark.is_dspark(getattr(runner, "model", None)):
            # its base logits are gathered outside any LogitsProcessor, once SGLang
            # attaches the head: sglang_dspark installs (and says the summary) then
            sglang_dspark.on_attach(runner, dcp)
            return None
        drafter = install_sglang_draft_gather(runner, dcp=dcp, rows=draft_rows_from_sglang(runner))
        if drafter.rank == 0:
            logger.info("lamport-head summary: %s", summary(_target, drafter))
        return None
    served = install_sglang_logits_gather(runner, dcp=dcp, rows=rows_from_sglang(runner))
    _remember_target(runner, served)
    return None


class Target(NamedTuple):
    """The target model's outcome in this process, for its drafter (the same on every
    rank: install's outcome is agreed)."""

    name: str  # the target model's class
    served: tuple  # its rows through a Lamport gather (() = SGLang's)
    gather: object  # the HeadGather serving them, or None
    group: object  # the agreement group it was built on (SGLang's TP CPU group)
    stock: str = NCCL_STOCK  # the kind of SGLang's gatherer it replaces (``stock_kind``)


_target = None  # the last target runner's outcome in this process (one scheduler: one)


def _remember_target(runner, served):
    global _target
    owner, lp = find_logits_processor(getattr(runner, "model", None))
    gather = getattr(lp, "head_gather", None) if served.served else None
    group = None
    if gather is not None:
        try:
            group = _sglang_tp()[0]
        except Exception:  # no SGLang TP group (an explicit test bed): no sharing
            group = None
    kept = getattr(lp, GATHERER, None)  # routed: a partial keeping SGLang's as its stock
    kept = getattr(kept, "keywords", {}).get("stock", kept)
    _target = Target(type(getattr(runner, "model", None)).__name__, served.rows, gather, group,
                     stock_kind(kept))


class Drafter(NamedTuple):
    """What the draft worker's install did, for the summary (the same on every rank)."""

    name: str  # the draft model's class
    outcome: object  # its Outcome (.shared: through the target's gather, the same group
    # and shard width)
    vocab: int  # its head's full (padded) vocabulary, TP x shard width (0: none found)
    rank: int  # this rank in the draft TP group (the summary is rank 0's)
    tp: int
    dcp: int


def install_sglang_draft_gather(runner, dcp=1, rows=None, target=None):
    """Route the draft worker's model (``runner.model``; SGLang's TP group is the draft's
    while its runner loads) after the target's install; a ``Drafter`` saying how.

    - Its head has the shard width and its logits the dtype of the gather the target
      was served by, on the same TP group (``target``: the target's ``Target``, default
      this process's): that gather serves it (``install.reroute``: no collective; the
      gather was agreed by
      every rank and the site's facts are the same on every rank).
    - Else its own install (``install.install`` with the draft rows): collective over
      the draft TP group, agreed, fail-stop as the target's; its outcome never
      touches the target's gather.

    Served: its runner's ``forward`` polls the gather (graph replays). Raises only as
    ``install_sglang_logits_gather`` does (a failure of this rank alone: fail-stop)."""
    target = _target if target is None else target
    model = getattr(runner, "model", runner)
    name = type(model).__name__
    group, tp, rank, device_group = _sglang_tp()
    owner, lp = find_logits_processor(model)
    what = "SGLang drafter logits gather"
    if lp is None:
        return Drafter(name, install.kept(Reason.NO_PROCESSOR,
                                           f"no LogitsProcessor with {GATHERER} in {name}", what),
                       0, rank, tp, dcp)
    site = _site(owner, lp)
    weight = site.weight
    width = weight.shape[0] if torch.is_tensor(weight) and weight.dim() == 2 else 0
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call routed it: keep it
        return Drafter(name, Outcome.serving(installed.rows, installed is getattr(
            target, "gather", None), install.gather_dtype(installed)), tp * width, rank, tp, dcp)
    why = _why_stock(lp, owner)
    if why is not None:
        return Drafter(name, install.kept(Reason.SITE, why, what), tp * width, rank, tp, dcp)
    shared_gather = getattr(target, "gather", None)
    if (shared_gather is None or getattr(target, "group", None) is not group
            or shared_gather.tp != tp or shared_gather.shard_width != width
            or not dtypes.served(site.logits_dtype)
            or dtypes.name(site.logits_dtype) != install.gather_dtype(shared_gather)):
        shared_gather = None
    device = weight.device if torch.is_tensor(weight) else "cpu"
    # Sharing skips the collective install its peers would run: every rank shares or
    # none does (a rank whose target lookup failed alone must not skip it).
    if not all_min(shared_gather is not None, group, device):
        shared_gather = None
    if shared_gather is not None:
        served = install.reroute(site, shared_gather, label=f"the SGLang drafter {name}")
    else:
        served = install.install(site, Ranks(group, tp, rank, device, dcp, device_group), rows,
                                 measure=measure_first_use)
    if served.served:
        poll_before_forward(runner, lp.head_gather)
    return Drafter(name, served, tp * width, rank, tp, dcp)


def target_clause(target):
    """The summary's words for the target model (its ``Target``, or None)."""
    if target is None:
        return "target: not loaded through the hook in this process"
    if target.served:
        return f"target {target.name}: Lamport logits gather for rows {list(target.served)}"
    return f"target {target.name}: SGLang's logits gather"


def summary(target, drafter):
    """Rank 0's one line for a speculative server: each model's outcome, then every
    path a Lamport gather serves ("target logits gather, drafter logits gather")."""
    head = f"SGLang speculative decoding, tp={drafter.tp}, dcp={drafter.dcp}: "
    first = target_clause(target)
    drafted = drafter.outcome
    if drafted.served:
        whose = ("the target's Lamport logits gather (its head has the target's shard width)"
                 if drafted.shared else f"its own Lamport logits gather (vocab {drafter.vocab})")
        second = f"drafter {drafter.name}: {whose} for rows {list(drafted.rows)}"
    else:
        second = (f"drafter {drafter.name}: SGLang's logits gather ({drafted.reason.label}: "
                  f"{drafted.message})")
    routed = ([p for p, on in (("target logits gather", target is not None and target.served),
                               ("drafter logits gather", drafted.served)) if on])
    return head + f"{first}; {second}; routed on all {drafter.tp} TP ranks: " + (
        ", ".join(routed) if routed else "none (SGLang's own gathers)")


def reroute_new_model(runner):
    """Route ``runner.model`` through the gather its first model was served by (the
    last in ``runner.lamport_head_gathers``, which its forward already polls): an
    ``Outcome``, one line either way. No collective
    (``install.reroute``): every rank holds the same new model and the gather agreed
    at load."""
    owner, lp = find_logits_processor(runner.model)
    gathers = runner.__dict__.get(POLLED, [])
    what = "logits gather on the new model"
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR, f"SGLang's new model has no LogitsProcessor "
                             f"with {GATHERER}: its gather is SGLang's", what)
    if not gathers:  # stock at load, agreed by every rank then: stays so, no collective
        return install.kept(Reason.NOT_GATHERED, "the model it replaced kept SGLang's logits "
                             "gather", what)
    why = _why_stock(lp, owner)
    if why is not None:
        return install.kept(Reason.SITE, why, what)
    return install.reroute(_site(owner, lp), gathers[-1])


def _after_update_model_fields(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.update_model_fields`` (a weight update hands the
    runner its model, possibly a new object): route the new model again through the
    gather the runner's first model was served by (target and draft runners alike)."""
    reroute_new_model(runner)


_registered = False
_unsaid = []  # register's line, until SGLang's logging is configured


def _say_registered():
    """Emit register's line once, at the first hook call: by then SGLang has
    configured logging (it loads plugins first, and a record emitted then had no
    handler but Python's last resort, which drops INFO)."""
    while _unsaid:
        logger.info(*_unsaid.pop())


def register():
    """SGLang general plugin: hook ``ModelRunner.load_model`` and
    ``update_model_fields`` once per process; harmless without SGLang's plugin
    framework (a debug line)."""
    global _registered
    if _registered:
        return
    try:  # lazy: SGLang
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as exc:
        logger.debug("lamport-head: no SGLang hook registry (%s)", exc)
        return
    HookRegistry.register(LOAD_MODEL, _after_load_model, HookType.AFTER)
    HookRegistry.register(UPDATE_MODEL, _after_update_model_fields, HookType.AFTER)
    _registered = True
    line = ("lamport-head: logits gather hooks registered on %s and %s", LOAD_MODEL,
            UPDATE_MODEL)
    if logging.getLogger().handlers or logger.handlers:
        logger.info(*line)  # logging configured already (the engine's own process)
    else:
        _unsaid.append(line)
