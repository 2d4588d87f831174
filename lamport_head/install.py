"""``install_logits_gather``: route a model's LogitsProcessor gather through HeadGather
for the rows the HEAD_GATHER table enables on this GPU model and (TP, DCP).

Fail-stop order: the model checks (the same on every rank) need no collective; then
each rank reads the tables alone (anything can fail here), the ranks agree on the
plan (one all-gather: a rank whose table failed or differs takes every rank to
stock), and only then build the HeadGather, itself collective and fail-stop (local
part, agree, map the peers' mailboxes, agree, arm, barrier): every rank serves the
rows or every rank stays stock. When no layer holds a real-rank section for this
GPU model, TP and DCP (or the user table's is stale), the agreed view says so on
every rank alike, and first-use tuning (``autotune.measure``, collective and
fail-stop) measures, writes the user table and hands back the plan to build. Never raises into serving: a missing table entry,
a non-CUDA device or a failed build leaves the stock gather with one log line.
"""

import logging
import os
from dataclasses import dataclass
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


def install_logits_gather(model, group, tp, rank, device, dcp=1, rows=None):
    """Route the model's LogitsProcessor ``_gather_logits`` (an instance attribute:
    other LogitsProcessors keep theirs) through a HeadGather for the table's enabled
    rows; which processor (nested language model, LoRA base layer, a subclass with its
    own gather) is ``vllm_model.find_gather_target``'s to say.
    ``rows``: the row counts the server's decode steps gather (vLLM: 1 .. max running
    requests x (1 + speculative tokens)); served rows are limited to them, so the
    mailbox's cap follows, and first-use tuning measures among them. None: the
    table's rows, and 1-64 for first-use tuning.
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
    view, reason = _local_view(tp, dcp, device, name, rows)
    if os.environ.get("LAMPORT_HEAD_DISABLE", "") not in ("", "0"):
        # An environment variable may reach some ranks only: it travels with the plan.
        view, reason = None, "disabled by LAMPORT_HEAD_DISABLE"
    # Collective 1: agree on the plan and on whether to measure first. A rank whose
    # table failed or differs must not be left behind while its peers enter the
    # mailbox's (or the sweep's) collectives.
    views = all_gather_objects((view and view.agreed, view and view.key, reason), group)
    reasons = [(r, why) for r, (_, _, why) in enumerate(views) if why]
    if reasons:
        mine = reason or f"rank {reasons[0][0]}: {reasons[0][1]}"
        logger.warning("lamport-head: logits gather stays stock: %s", mine)
        return ()
    if len({agreed for agreed, _, _ in views}) > 1:
        logger.warning("lamport-head: logits gather stays stock: the TP ranks resolved "
                       "different HEAD_GATHER plans (different tables or environments, "
                       "first-use tuning settings included)")
        return ()
    keys = [key for _, key, _ in views]
    shared = None if None in keys else len(set(keys)) < tp  # several ranks on one GPU
    choice, plan = _choose(view, shared)
    if choice == "unknown":
        logger.warning("lamport-head: logits gather stays stock: first-use tuning cannot tell "
                       "whether the TP ranks share a GPU (no device key)")
        return ()
    if choice == "tune":
        from . import autotune

        try:  # collective, fail-stop: every rank gets the same outcome or every rank raises
            outcome = autotune.measure(group, device, tp, rank, dcp, shard, view.rows, shared, name)
        except Exception as exc:
            logger.warning("lamport-head: logits gather stays stock: first-use tuning failed: "
                           "%s: %s", type(exc).__name__, exc)
            return ()
        logger.info("lamport-head: first-use tuning on %s (tp=%d, dcp=%d, %s): measured rows "
                    "%s in %.1f s, wrote %s%s", name, tp, dcp, view.real, 
                    [r.rows for r in outcome.results], outcome.seconds, outcome.path,
                    " (emulated: true)" if outcome.emulated else "")
        plan = outcome.plan
        if outcome.emulated:
            choice = "emulated" if autotune.serve_emulated() else "unserved"
    if choice == "unserved":
        logger.info("lamport-head: stock logits gather: the ranks share one GPU, so the %s "
                    "section for %s, tp=%d, dcp=%d is emulated: true, never served (%s=1 "
                    "serves it, to test this mode only)", name, name, tp, dcp,
                    "LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED")
        return ()
    if choice == "emulated":
        logger.warning("lamport-head: serving an emulated section (processes sharing one GPU: "
                       "not performance) because LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED is set")
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


@dataclass(frozen=True)
class _View:
    """This rank's reading of the tables and settings (no collectives)."""

    plan: dict  # enabled rows of the real-rank section
    emulated_plan: dict  # enabled rows of the emulated section
    real: str  # autotune.status of the real-rank section
    emulated: str  # ... and of the emulated one
    autotune: bool
    serve_emulated: bool
    rows: tuple  # the rows first-use tuning measures among
    key: object  # mailbox._device_key: equal keys mean ranks sharing one GPU

    @property
    def agreed(self):
        """What every rank must see alike."""
        return (_digest(self.plan), _digest(self.emulated_plan), self.real, self.emulated,
                self.autotune, self.serve_emulated, self.rows)


def _local_view(tp, dcp, device, name, rows):
    """(_View, None) or (None, why): this rank's reading of the tables, no collectives."""
    from . import autotune
    from .mailbox import _device_key
    from .table import TableError, load_table

    try:
        table = load_table()
        on = autotune.enabled()

        def read(emulated):
            section = table.section(name, tp, dcp, emulated=emulated)
            plan = table.plan(name, tp, dcp, emulated=emulated)
            plan = {m: p for m, p in plan.items() if p.enabled and (rows is None or m in rows)}
            # Only first-use tuning asks whether a section is stale (it costs nvidia-smi).
            state = autotune.status(section) if on else ("missing" if section is None
                                                         else "current")
            return plan, state

        (plan, real), (emulated_plan, emulated) = read(False), read(True)
        key = None
        try:
            key = _device_key(device)
        except Exception:  # no device key: first-use tuning will not guess
            pass
        return _View(plan, emulated_plan, real, emulated, on, autotune.serve_emulated(),
                     tuple(sorted(set(rows or autotune.DEFAULT_ROWS))), key), None
    except TableError as exc:
        return None, str(exc)
    except Exception as exc:  # told to every rank by the agreement, never raised alone
        return None, f"{type(exc).__name__}: {exc}"


def _choose(view, shared):
    """('table', plan), ('tune', {}), ('emulated', plan), ('unserved', {}) or
    ('unknown', {}); the same on every rank (its inputs are agreed)."""
    if view.real != "missing" and (shared or not view.autotune or view.real == "current"):
        return "table", view.plan  # processes sharing a GPU cannot re-measure real ranks
    if view.autotune and (not shared or view.emulated != "current"):
        return ("unknown", {}) if shared is None else ("tune", {})
    if shared and view.emulated != "missing":
        return ("emulated", view.emulated_plan) if view.serve_emulated else ("unserved", {})
    return "table", {}


def _digest(plan):
    return tuple(sorted((m, p.ctas, p.threads, p.unroll) for m, p in plan.items()))
