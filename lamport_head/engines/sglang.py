"""SGLang adapter: route ``LogitsProcessor._logits_gatherer`` (the TP all-gather of the
vocab-parallel lm_head's ``[M, V/TP]`` shard, SGLang 0.5.23) through a HeadGather for
the rows the HEAD_GATHER table enables; docs/sglang.md lists the SGLang names.

``install_sglang_logits_gather`` is the explicit call; ``register`` is SGLang's
general plugin (entry point ``sglang.srt.plugins`` -> ``lamport_head``): it hooks
``ModelRunner.load_model`` (AFTER) through SGLang's ``HookRegistry``, so every TP
rank installs once its model is loaded, before SGLang captures its CUDA graphs.

The checks, the table plan, the ranks' agreement and the build are the engine-neutral
install core's (``install.install`` on a ``GatherSite`` naming ``_logits_gatherer``):
the same fail-stop order, the same log lines as vLLM's. What is SGLang's own:
finding the processor and its lm_head, and leaving stock every configuration whose
logits do not take the plain TP all-gather along the last dim (DP attention,
``--enable-dp-lm-head``, the TP lm_head all-to-all, FP32 lm_head logits), with one
log line. Everything not served (rows, dtype, shape, ...) calls SGLang's own
gatherer, so its result is SGLang's, bitwise. SGLang is imported only here, lazily.
"""

import functools
import logging

import torch

from .. import install
from . import measure_first_use

logger = logging.getLogger("lamport_head")

GATHERER = "_logits_gatherer"  # LogitsProcessor's instance attribute: x [M, V/TP] -> [M, V]
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
# LogitsProcessor attributes (0.5.23) that must exist for us to read its gather path.
_REQUIRED = (GATHERER, "do_tensor_parallel_all_gather", "use_attn_tp_group",
             "do_tensor_parallel_all_gather_dp_attn")
# Set when true: the logits of that configuration do not take the plain TP gather.
_VARIANTS = (
    ("use_attn_tp_group", "--enable-dp-lm-head gathers over the attention TP group"),
    ("do_tensor_parallel_all_gather_dp_attn", "DP attention gathers the logits across "
                                              "DP ranks"),
    ("use_tp_lm_head_all_to_all", "the TP lm_head all-to-all replaces the gather"),
    ("use_fp32_lm_head", "FP32 lm_head logits"),
    ("use_fp32_lm_head_output", "FP32 lm_head logits"),
)


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


def _why_stock(lp):
    """Why this LogitsProcessor's logits do not take the plain TP gather; None if they do."""
    missing = [a for a in _REQUIRED if not hasattr(lp, a)]
    if missing:
        return f"this SGLang's LogitsProcessor lacks {', '.join(missing)} (not 0.5.23's)"
    if not lp.do_tensor_parallel_all_gather:
        return "SGLang does not gather the logits here (TP 1 or skip_all_gather)"
    for attr, why in _VARIANTS:
        if getattr(lp, attr, False):
            return why
    return None


def _sglang_tp():
    """SGLang's TP group: (agreement group: its CPU group where it has one, size, rank
    in group, device group)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp_group = get_tp_group()
    cpu = getattr(tp_group, "cpu_group", None)
    return (cpu if cpu is not None else tp_group.device_group, tp_group.world_size,
            tp_group.rank_in_group, tp_group.device_group)


def install_sglang_logits_gather(model_or_runner, group=None, tp=None, rank=None, device=None,
                                 dcp=1):
    """Route the SGLang model's ``logits_processor._logits_gatherer`` (an instance
    attribute: other processors keep theirs) through a HeadGather for the table's
    enabled rows. ``model_or_runner``: the model (an ``nn.Module``) or SGLang's
    ``ModelRunner`` (its ``.model``). ``group``/``tp``/``rank`` default to SGLang's
    TP group (``get_tp_group()``: ``device_group``, ``world_size``, ``rank_in_group``),
    ``device`` to the lm_head weight's. Collective over the TP group when a table
    entry applies; call it on every TP rank after the model loads and before CUDA
    graph capture. Returns the rows served; ``()`` means SGLang's own gather."""
    model = model_or_runner
    if not isinstance(model, torch.nn.Module) and hasattr(model, "model"):
        model = model.model  # a ModelRunner
    owner, lp = find_logits_processor(model)
    if lp is None:
        logger.info("lamport-head: no SGLang LogitsProcessor with %s found; stock logits "
                    "gather", GATHERER)
        return ()
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return tuple(sorted(installed.rows))
    why = _why_stock(lp)
    if why is not None:
        logger.info("lamport-head: SGLang logits gather stays stock: %s", why)
        return ()
    head = owner.lm_head
    head = getattr(head, "base_layer", head)  # a LoRA wrapper keeps the layer here
    device_group = None
    if group is None or tp is None or rank is None:
        sg_group, sg_tp, sg_rank, sg_device_group = _sglang_tp()
        if group is None:
            group, device_group = sg_group, sg_device_group
        tp = sg_tp if tp is None else tp
        rank = sg_rank if rank is None else rank
    if device is None:
        weight = getattr(head, "weight", None)
        device = weight.device if torch.is_tensor(weight) else "cpu"
    site = install.GatherSite(processor=lp, attr=GATHERER, weight=getattr(head, "weight", None),
                              head_tp=getattr(head, "tp_size", 1),
                              where=f"{type(owner).__name__}.logits_processor")
    served = install.install(site, group, tp, rank, device, dcp, measure=measure_first_use,
                             device_group=device_group)
    if served:  # the core routed GATHERER: gather(logits, stock=SGLang's) for these rows
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
    try:
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
    if getattr(runner, "is_draft_worker", False):
        logger.info("lamport-head: SGLang draft model: stock logits gather")
        return None
    install_sglang_logits_gather(runner, dcp=_dcp_size())
    return None


_registered = False


def register():
    """SGLang general plugin: hook ``ModelRunner.load_model`` once per process;
    harmless without SGLang's plugin framework (a debug line)."""
    global _registered
    if _registered:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as exc:
        logger.debug("lamport-head: no SGLang hook registry (%s)", exc)
        return
    HookRegistry.register(LOAD_MODEL, _after_load_model, HookType.AFTER)
    _registered = True
    logger.info("lamport-head: logits gather hook registered on %s", LOAD_MODEL)
