"""``install_logits_gather``: route a model's LogitsProcessor gather through HeadGather
for the rows the HEAD_GATHER table enables on this GPU model and (TP, DCP).

Fail-stop order: the model checks (the same on every rank) need no collective; then
each rank reads the tables alone (anything can fail here), the ranks agree on the
plan (one all-gather: a rank whose table failed or differs takes every rank to
stock), and only then build the HeadGather, itself collective and fail-stop (local
part, agree, map the peers' mailboxes, agree, arm, barrier): every rank serves the
rows or every rank stays stock. Never raises into serving: a missing table entry,
a non-CUDA device or a failed build leaves the stock gather with one log line.
"""

import logging
import os
from functools import partial

import torch

from .collective import all_gather_objects
from .vllm_model import find_gather_target

logger = logging.getLogger("lamport_head")


def _device_name(device):
    """The GPU model of ``device``; None when it is not a usable CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


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
    if lp is None:
        logger.info("lamport-head: stock logits gather: %s", where)
        return ()
    if tp <= 1:
        logger.info("lamport-head: tp=%d has no logits gather to replace", tp)
        return ()
    weight = getattr(head, "weight", None)
    if (weight is None or weight.dim() != 2 or weight.dtype != torch.bfloat16
            or getattr(lp, "logits_as_input", False)
            or getattr(lp, "head_dtype", None) not in (None, torch.bfloat16)
            or getattr(head, "tp_size", 1) != tp or not getattr(lp, "use_all_gather", False)):
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
    name = _device_name(device)
    if name is None:  # the same on every rank: no collective needed to agree
        logger.info("lamport-head: %s is not a CUDA device; stock logits gather", device)
        return ()
    plan, reason = _local_plan(tp, dcp, device)
    if os.environ.get("LAMPORT_HEAD_DISABLE", "") not in ("", "0"):
        # An environment variable may reach some ranks only: it travels with the plan.
        plan, reason = {}, "disabled by LAMPORT_HEAD_DISABLE"
    # Collective 1: agree on the plan. A rank whose table failed or differs must not
    # be left behind while its peers enter the mailbox's collectives.
    views = all_gather_objects((_digest(plan), reason), group)
    reasons = [(r, why) for r, (_, why) in enumerate(views) if why]
    if reasons:
        mine = reason or f"rank {reasons[0][0]}: {reasons[0][1]}"
        logger.warning("lamport-head: logits gather stays stock: %s", mine)
        return ()
    if len({d for d, _ in views}) > 1:
        logger.warning("lamport-head: logits gather stays stock: the TP ranks resolved "
                       "different HEAD_GATHER plans (different tables or environments)")
        return ()
    if not plan:
        logger.info("lamport-head: no enabled HEAD_GATHER rows for %s, tp=%d, dcp=%d; "
                    "stock logits gather", name, tp, dcp)
        return ()
    try:  # collective, fail-stop: every rank gets a gather or every rank raises
        gather = _build(group, device, tp, rank, shard, plan)
    except Exception as exc:  # a capability fallback, taken by every rank together
        logger.warning("lamport-head: logits gather stays stock: %s: %s",
                       type(exc).__name__, exc)
        return ()
    stock = lp._gather_logits
    lp.head_gather = gather
    lp._gather_logits = partial(gather, stock=stock)
    served = tuple(sorted(gather.rows))
    logger.info("lamport-head: Lamport logits gather on %s (tp=%d, dcp=%d) for rows %s, "
                "routed at %s", name, tp, dcp, served, where)
    return served


def _local_plan(tp, dcp, device):
    """(plan, None) or ({}, why): this rank's reading of the tables, no collectives."""
    from .table import TableError

    try:
        return serving_plan(tp, dcp, device)[1], None
    except TableError as exc:
        return {}, str(exc)


def _digest(plan):
    return tuple(sorted((m, p.ctas, p.threads, p.unroll) for m, p in plan.items()))
