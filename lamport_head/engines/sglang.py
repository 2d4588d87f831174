"""SGLang adapter: ``LogitsProcessor._logits_gatherer`` through a HeadGather (SGLang 0.5.23;
docs/sglang.md holds the names, the hooks and why). ``register`` hooks ``ModelRunner.load_model``
(every TP rank installs after load, before graph capture; a draft worker's runner installs its
drafter, a DSpark draft's is ``sglang_dspark``'s) and ``update_model_fields`` (a new model is
rerouted, no collective). Whatever is not served calls SGLang's own gatherer: its result,
bitwise. SGLang is imported only in the adapters, lazily."""

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

# SGLang 0.5.23's names we rely on, checked against its wheel's source (docs/sglang.md)
GATHERER = "_logits_gatherer"
MULTIMEM_GATHERER = "MultimemAllGatherer"
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
LOAD_MODEL = f"{RUNNER}.load_model"
UPDATE_MODEL = f"{RUNNER}.update_model_fields"
CONTEXT = "sglang.srt.runtime_context"
REQUESTS = "max_running_requests"
PER_REQUEST = "decode_num_tokens_per_req"
DRAFT_TOKENS = "max_speculative_num_draft_tokens"
DRAFT_WORKER = "is_draft_worker"
SPEC = "get_spec"
TOPK = "speculative_eagle_topk"
_REQUIRED = (GATHERER, "do_tensor_parallel_all_gather", "use_attn_tp_group",
             "do_tensor_parallel_all_gather_dp_attn")
_VARIANTS = (
    ("use_attn_tp_group", "--enable-dp-lm-head gathers over the attention TP group"),
    ("do_tensor_parallel_all_gather_dp_attn", "DP attention gathers the logits across "
                                              "DP ranks"),
    ("use_tp_lm_head_all_to_all", "the TP lm_head all-to-all replaces the gather"),
    ("use_fp32_lm_head_output", "FP32 lm_head output (enable_lm_head_output_fp32): its logits' "
                                "dtype depends on the device"),
)
FP32_HEAD = "use_fp32_lm_head"
SOFTCAP = "final_logit_softcapping"


def find_logits_processor(model):
    """(owner, LogitsProcessor) of the outermost module with an ``lm_head`` and a
    ``logits_processor`` that has ``_logits_gatherer``; (None, None) if none."""
    modules = (m for _, m in model.named_modules()) if isinstance(model, torch.nn.Module) \
        else iter((model,))
    for owner in modules:
        lp = getattr(owner, "logits_processor", None)
        if lp is not None and hasattr(lp, GATHERER) and hasattr(owner, "lm_head"):
            return owner, lp
    return None, None


def _why_stock(lp, owner=None):
    """Why the logits skip the plain TP gather (None: they take it), alike on every rank."""
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
    """SGLang's TP group: (agreement group, size, rank, device group)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp_group = get_tp_group()
    cpu = getattr(tp_group, "cpu_group", None)
    return (cpu if cpu is not None else tp_group.device_group, tp_group.world_size,
            tp_group.rank_in_group, tp_group.device_group)


def rows_from_sglang(runner):
    """Row counts: 1 .. max running requests x logits rows per request, capped; up to the
    cap while SGLang has not sized max running requests (after load). None: SGLang did not say."""
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
    """A draft step's row counts: 1 .. max running requests x ``speculative_eagle_topk`` (1
    when unset), capped. None: SGLang did not say."""
    try:
        context = importlib.import_module(CONTEXT)
        requests = getattr(context.get_schedule(), REQUESTS)
        topk = getattr(getattr(context, SPEC)(), TOPK)
    except Exception as exc:
        logger.debug("lamport-head: SGLang's draft rows unknown (%s: %s)", type(exc).__name__,
                     exc)
        return None
    if requests is not None and (not isinstance(requests, int) or requests < 1):
        return None
    return install.decode_rows(requests, topk if isinstance(topk, int) and topk > 1 else 1)


def stock_kind(gatherer) -> str:
    """SGLang's gatherer as a table stock: a ``MultimemAllGatherer`` SGLang left enabled
    (``_state`` set) is the multimem gather (docs/sglang.md, "Caveats"); any other, NCCL's."""
    if type(gatherer).__name__ == MULTIMEM_GATHERER and getattr(gatherer, "_state", None) is not None:
        return MULTIMEM_STOCK
    return NCCL_STOCK


def _fp32_logits(lp, owner):
    head = getattr(getattr(owner, "lm_head", None), "base_layer", getattr(owner, "lm_head", None))
    weight = getattr(head, "weight", None)
    return bool(getattr(lp, FP32_HEAD, False)) or (
        torch.is_tensor(weight) and weight.dtype == torch.float32)


def _site(owner, lp):
    """The install core's view: FP32 logits where ``use_fp32_lm_head`` and the head is not
    LoRA-wrapped, else the weight's dtype. SGLang wraps for LoRA after this hook: an FP32
    projection with an lm_head LoRA gets a float32 gather every call passes by (stock,
    reported served), alike on every rank."""
    wrapper = owner.lm_head
    head = getattr(wrapper, "base_layer", wrapper)
    lora = hasattr(wrapper, "set_lora") and hasattr(wrapper, "apply_lora")
    fp32 = bool(getattr(lp, FP32_HEAD, False)) and not lora
    return install.GatherSite(processor=lp, attr=GATHERER, weight=getattr(head, "weight", None),
                              head_tp=getattr(head, "tp_size", 1),
                              where=f"{type(owner).__name__}.logits_processor",
                              stock=stock_kind(getattr(lp, GATHERER, None)),
                              dtype=torch.float32 if fp32 else None)


def install_sglang_logits_gather(model_or_runner, group=None, tp=None, rank=None, device=None,
                                 dcp=1, rows=None):
    """Route the model's (or ``ModelRunner``'s) ``_logits_gatherer`` through a HeadGather: an
    ``outcome.Outcome``. Collective: call it on every TP rank after load, before graph capture.
    ``group``/``tp``/``rank`` default to SGLang's TP group, ``device`` to the head's."""
    model = model_or_runner
    if not isinstance(model, torch.nn.Module) and hasattr(model, "model"):
        model = model.model
    owner, lp = find_logits_processor(model)
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR,
                             f"no SGLang LogitsProcessor with {GATHERER} found")
    installed = getattr(lp, "head_gather", None)
    if installed is not None:
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
    if served.served:
        if model is not model_or_runner and callable(getattr(model_or_runner, "forward", None)):
            poll_before_forward(model_or_runner, lp.head_gather)
        else:
            logger.info("lamport-head: installed on a model, not a ModelRunner's: whoever "
                        "replays its CUDA graphs calls head_gather.poll() before each replay")
    return served


POLLED = "lamport_head_gathers"


def poll_before_forward(runner, gather):
    """Make ``runner.forward`` (every batch, eager or graph replay) poll ``gather`` first: a
    replay skips ``HeadGather.__call__``, and a peer's timeout would otherwise leave every
    later step with NaN logits and no rank raising."""
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
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:  # older releases lack it: no DCP
        return 1


def _after_load_model(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.load_model``. Nothing is caught: install raises only for this
    rank's own failure, which must stop the worker (docs/design.md, "The fail-stop rule")."""
    _say_registered()
    dcp = _dcp_size()
    if getattr(runner, DRAFT_WORKER, False):
        from . import sglang_dspark  # lazy: it imports this module

        if sglang_dspark.is_dspark(getattr(runner, "model", None)):
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
    """The target model's agreed outcome in this process, for its drafter."""

    name: str
    served: tuple
    gather: object
    group: object  # the agreement group it was built on
    stock: str = NCCL_STOCK


_target = None  # one scheduler per process: one target


def _remember_target(runner, served):
    global _target
    owner, lp = find_logits_processor(getattr(runner, "model", None))
    gather = getattr(lp, "head_gather", None) if served.served else None
    group = None
    if gather is not None:
        try:
            group = _sglang_tp()[0]
        except Exception:  # no SGLang TP group: no sharing
            group = None
    kept = getattr(lp, GATHERER, None)  # routed: a partial with SGLang's as its stock
    kept = getattr(kept, "keywords", {}).get("stock", kept)
    _target = Target(type(getattr(runner, "model", None)).__name__, served.rows, gather, group,
                     stock_kind(kept))


class Drafter(NamedTuple):
    """What the draft worker's install did, for the summary."""

    name: str
    outcome: object  # .shared: through the target's gather
    vocab: int  # TP x shard width (0: none found)
    rank: int
    tp: int
    dcp: int


def install_sglang_draft_gather(runner, dcp=1, rows=None, target=None):
    """Route the draft worker's model (SGLang's TP group is the draft's while it loads): a
    ``Drafter``. The target's gather serves it where group, shard width and dtype match
    (``install.reroute``); else its own install, agreed, never touching the target's gather."""
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
    if installed is not None:
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
    if target is None:
        return "target: not loaded through the hook in this process"
    if target.served:
        return f"target {target.name}: Lamport logits gather for rows {list(target.served)}"
    return f"target {target.name}: SGLang's logits gather"


def summary(target, drafter):
    """Rank 0's line for a speculative server: each model's outcome, then the routed paths."""
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
    """Route ``runner.model`` through the gather its first model was served by: an ``Outcome``.
    No collective: every rank holds the same new model and the gather agreed at load."""
    owner, lp = find_logits_processor(runner.model)
    gathers = runner.__dict__.get(POLLED, [])
    what = "logits gather on the new model"
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR, f"SGLang's new model has no LogitsProcessor "
                             f"with {GATHERER}: its gather is SGLang's", what)
    if not gathers:  # stock as agreed at load
        return install.kept(Reason.NOT_GATHERED, "the model it replaced kept SGLang's logits "
                             "gather", what)
    why = _why_stock(lp, owner)
    if why is not None:
        return install.kept(Reason.SITE, why, what)
    return install.reroute(_site(owner, lp), gathers[-1])


def _after_update_model_fields(result, runner, *args, **kwargs):
    reroute_new_model(runner)


_registered = False
_unsaid = []


def _say_registered():
    """Emit register's line at the first hook call: SGLang loads plugins before it configures
    logging, and an INFO record emitted then would be dropped."""
    while _unsaid:
        logger.info(*_unsaid.pop())


def register():
    """SGLang's general plugin: hook ``load_model`` and ``update_model_fields`` once per process."""
    global _registered
    if _registered:
        return
    try:
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
        logger.info(*line)
    else:
        _unsaid.append(line)
