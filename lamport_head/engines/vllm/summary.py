"""Rank 0's summary line for a vLLM TP group, built from values only (the installs' agreed
``Outcome``s, ``find``'s paths), never from log text."""

from ... import dtypes
from ...table import CUSTOM_STOCK, NCCL_STOCK
from .release import CUSTOM_GATHER, EXCHANGE


def summary(release, model_name, tp, dcp, outcome, through=("compute_logits",), around=(),
            drafter=None, candidates=(), others=(), exchanges=(), stock=NCCL_STOCK):
    """The release, then every logits collective of a step and whether a Lamport collective
    serves it. ``through``/``around``: ``find.logits_paths``; ``drafter``: a ``route.Drafter``;
    ``others``: ``find.other_collectives``; ``stock``: ``find.gather_stock``."""
    candidates = list(candidates or ())
    if candidates and drafter is not None:
        paths = {c.path for c in candidates}
        drafter = drafter._replace(around=tuple(a for a in drafter.around
                                                if a.split(" (")[0] not in paths))
    if drafter is not None:
        through = [f"target {p}" for p in through]
        around = [a for a in around if not a.startswith("the drafter's")]
    head = f"{release}, {model_name}, tp={tp}, dcp={dcp}: "
    skip = f"{' and '.join(around)} skip{'s' if len(around) == 1 else ''}"
    if outcome.served and not through:
        line = head + (f"Lamport logits gather installed for rows {list(outcome.rows)} on all "
                       f"{tp} TP ranks{_dtype(outcome)}, but no step takes it: {skip} the "
                       "gather")
    elif outcome.served:
        line = head + (f"Lamport logits gather for rows {list(outcome.rows)} on all {tp} TP "
                       f"ranks{_dtype(outcome)}, through {' and '.join(through)}"
                       + (f"; {skip} it" if around else ""))
    else:
        line = head + f"stock logits gather on all {tp} TP ranks ({_why(outcome)})"
    if stock == CUSTOM_STOCK:
        line += (f"; the logits gather's stock: {stock} (LogitsProcessor._gather_logits calls "
                 f"CudaCommunicator.{CUSTOM_GATHER})")
    line = line if drafter is None else line + "; " + _drafter_clause(drafter)
    clauses = [_exchange_clause(e) for e in exchanges]
    clauses += [_candidates_clause(c) for c in candidates]
    clauses += [f"{path}: not routed ({why})" for path, why in others]
    return "; ".join([line] + clauses)


def _dtype(outcome):
    return "" if outcome.dtype == dtypes.DEFAULT else f" ({outcome.dtype} logits)"


def _why(outcome):
    return f"{outcome.reason.label}: {outcome.message}"


def _exchange_clause(e):
    where = f"{e.path}'s {EXCHANGE}"
    if not e.outcome.served:
        return f"{where}: stock all-to-all ({_why(e.outcome)})"
    shared = " (shared with an earlier path: the same shard width)" if e.outcome.shared else ""
    return (f"Lamport all-to-all for rows {list(e.outcome.rows)}{_dtype(e.outcome)}{shared} "
            f"through {where}")


def _candidates_clause(c):
    if not c.served:
        stock = c.kept
        return f"{c.path}: stock candidate all-gather ({_why(stock) if stock else 'none built'})"
    gathers = ", ".join(f"rows {list(rows)} (packed width {width})" for width, rows in c.served)
    return f"{c.path}: Lamport candidate gather{'s' if len(c.served) > 1 else ''} for {gathers}"


def _drafter_clause(d):
    skip = "".join(f"; {a} skips it" for a in d.around)
    if d.outcome.served:
        whose = ("the target's Lamport logits gather (its head has the target's shard width)"
                 if d.outcome.shared else f"its own Lamport logits gather (vocab {d.vocab})")
        return (f"drafter {d.name}: {whose} for rows {list(d.outcome.rows)}{_dtype(d.outcome)}, "
                f"through "
                f"{' and '.join(d.through)}{skip}")
    if not d.through:
        return f"drafter {d.name}: no draft step gathers logits{skip}"
    return (f"drafter {d.name}: stock logits gather for {' and '.join(d.through)} "
            f"({_why(d.outcome)}){skip}")
