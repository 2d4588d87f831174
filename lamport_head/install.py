"""``install_logits_gather``: route a model's LogitsProcessor gather through HeadGather
for the rows the HEAD_GATHER table enables on this GPU model and (TP, DCP).

Collective over the TP group whenever a table entry applies: every rank runs the
same checks on the same inputs, builds its HeadGather, and the ranks agree with a
MIN all-reduce, so either every rank serves the rows or every rank stays stock. That
all-reduce also orders every rank's armed mailbox before any rank's first push.
Never raises into serving: a missing table entry, a non-CUDA device or a failed
build leaves the stock gather with one log line.
"""

import logging
import os
from functools import partial

import torch

from .vllm_model import find_gather_target

logger = logging.getLogger("lamport_head")


def _device_name(device):
    """The GPU model of ``device``; None when it is not a usable CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def _agree(ok: bool, group, device) -> bool:
    """MIN over the group of each rank's outcome (True only if every rank built)."""
    import torch.distributed as dist

    where = torch.device(device) if torch.device(device).type == "cuda" else torch.device("cpu")
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=where)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _build(group, device, tp, rank, shard, plan):
    from .head_gather import HeadGather

    return HeadGather(group, device, tp, rank, shard, plan.keys(), plan)


def serving_plan(tp, dcp, device, table=None):
    """{rows: RowPlan} of enabled rows for this device's GPU model; {} if none."""
    from .table import load_table

    name = _device_name(device)
    if name is None:
        return name, {}
    table = table or load_table()
    return name, {m: p for m, p in table.plan(name, tp, dcp).items() if p.enabled}


def install_logits_gather(model, group, tp, rank, device, dcp=1):
    """Route the model's LogitsProcessor ``_gather_logits`` (an instance attribute:
    other LogitsProcessors keep theirs) through a HeadGather for the table's enabled
    rows; which processor (nested language model, LoRA base layer, a subclass with its
    own gather) is ``vllm_model.find_gather_target``'s to say.
    Returns the rows served; ``()`` means the stock gather."""
    lp, head, where = find_gather_target(model)
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return tuple(sorted(installed.rows))
    if os.environ.get("LAMPORT_HEAD_DISABLE", "") not in ("", "0"):
        logger.info("lamport-head: disabled by LAMPORT_HEAD_DISABLE; stock logits gather")
        return ()
    if lp is None:
        logger.info("lamport-head: stock logits gather: %s", where)
        return ()
    if tp <= 1:
        logger.info("lamport-head: tp=%d has no logits gather to replace", tp)
        return ()
    weight = getattr(head, "weight", None)
    if (lp is None or weight is None or weight.dim() != 2 or weight.dtype != torch.bfloat16
            or getattr(lp, "logits_as_input", False)
            or getattr(lp, "head_dtype", None) not in (None, torch.bfloat16)
            or getattr(head, "tp_size", 1) != tp or not getattr(lp, "use_all_gather", False)
            or tp <= 1):
        logger.info("lamport-head: stock logits gather: %s is not a BF16 vocab-parallel head "
                    "gathered by all-gather over tp=%d (lm_head weight %s, tp_size %s; "
                    "use_all_gather=%s, logits_as_input=%s, head_dtype=%s)", where, tp,
                    None if weight is None else f"{tuple(weight.shape)} {weight.dtype}",
                    getattr(head, "tp_size", None), getattr(lp, "use_all_gather", None),
                    getattr(lp, "logits_as_input", None), getattr(lp, "head_dtype", None))
        return ()
    shard = weight.shape[0]
    if shard % 8:
        logger.info("lamport-head: stock logits gather: shard width %d is not a multiple of 8",
                    shard)
        return ()
    from .table import TableError

    try:
        name, plan = serving_plan(tp, dcp, device)
    except TableError as exc:
        logger.warning("lamport-head: stock logits gather: %s", exc)
        return ()
    if name is None:
        logger.info("lamport-head: %s is not a CUDA device; stock logits gather", device)
        return ()
    if not plan:
        logger.info("lamport-head: no enabled HEAD_GATHER rows for %s, tp=%d, dcp=%d; "
                    "stock logits gather", name, tp, dcp)
        return ()
    gather, error = None, "it failed on another TP rank"
    try:
        gather = _build(group, device, tp, rank, shard, plan)
    except Exception as exc:  # a capability fallback: the stock gather
        error = f"{type(exc).__name__}: {exc}"
    try:
        built = _agree(gather is not None, group, device)
    except Exception as exc:
        built, error = False, f"the ranks could not agree: {exc}"
    if not built:
        logger.warning("lamport-head: logits gather stays stock: %s", error)
        return ()
    stock = lp._gather_logits
    lp.head_gather = gather
    lp._gather_logits = partial(gather, stock=stock)
    served = tuple(sorted(gather.rows))
    logger.info("lamport-head: Lamport logits gather on %s (tp=%d, dcp=%d) for rows %s, "
                "routed at %s", name, tp, dcp, served, where)
    return served
