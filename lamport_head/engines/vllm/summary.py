"""Rank 0's one summary line for a vLLM TP group: the engine's release, then every
logits collective a step takes (gathers and all-to-alls of vocab shards) and whether a
Lamport collective serves it.

Built from values only (the installs' ``Outcome``s, ``find``'s paths): rewording a log
line changes no summary (tests/test_outcome.py). Every rank takes the same outcomes
(install's are agreed), so rank 0's line speaks for the group. A served gather's
logits dtype is named where it is not BF16 ("(float32 logits)": an FP32 lm_head).
"""

from ... import dtypes
from ...table import CUSTOM_STOCK, NCCL_STOCK
from .release import CUSTOM_GATHER, EXCHANGE


def summary(release, model_name, tp, dcp, outcome, through=("compute_logits",), around=(),
            drafter=None, candidates=(), others=(), exchanges=(), stock=NCCL_STOCK):
    """The line. ``release``: the running vLLM (``release.Release`` or its text);
    ``outcome``: the target's ``Outcome``; ``through``/``around``: ``find.logits_paths``
    (served rows are named only with the paths that really take the gather, and said
    unused when none does); ``drafter``: the drafter's ``route.Drafter`` (the target's
    paths are then named "target ...", and a clause names the drafter's paths, its rows
    and whose gather serves them, or why it stays stock); ``candidates``: the
    ``candidates.Candidates`` of the drafter's candidate paths, each in a clause of its
    own in place of the drafter's words for that path; ``others``: ``(path, why)`` for
    logits collectives no Lamport gather serves (``find.other_collectives``), each
    named as not routed; ``exchanges``: the ``vocab_shards.Exchange`` of each caller of
    the all-to-all of vocab shards a step takes, each in a clause of its own (served
    rows, or why vLLM's all-to-all stays); ``stock``: the stock of the logits gather
    (``find.gather_stock``), named where it is vLLM's custom all-gather (a release whose
    ``LogitsProcessor`` gathers through ``custom_all_gather``)."""
    candidates = list(candidates or ())
    if candidates and drafter is not None:
        paths = {c.path for c in candidates}
        drafter = drafter._replace(around=tuple(a for a in drafter.around
                                                if a.split(" (")[0] not in paths))
    if drafter is not None:
        through = [f"target {p}" for p in through]
        around = [a for a in around if not a.startswith("the drafter's")]  # said below
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
    if stock == CUSTOM_STOCK:  # never for a release that gathers by NCCL: its line is as before
        line += (f"; the logits gather's stock: {stock} (LogitsProcessor._gather_logits calls "
                 f"CudaCommunicator.{CUSTOM_GATHER})")
    line = line if drafter is None else line + "; " + _drafter_clause(drafter)
    clauses = [_exchange_clause(e) for e in exchanges]
    clauses += [_candidates_clause(c) for c in candidates]
    clauses += [f"{path}: not routed ({why})" for path, why in others]
    return "; ".join([line] + clauses)


def _dtype(outcome):
    """The served logits' dtype, named where it is not the engines' usual BF16."""
    return "" if outcome.dtype == dtypes.DEFAULT else f" ({outcome.dtype} logits)"


def _why(outcome):
    return f"{outcome.reason.label}: {outcome.message}"


def _exchange_clause(e):
    """The summary's words for a caller of the all-to-all of vocab shards
    (``vocab_shards.Exchange``)."""
    where = f"{e.path}'s {EXCHANGE}"
    if not e.outcome.served:
        return f"{where}: stock all-to-all ({_why(e.outcome)})"
    shared = " (shared with an earlier path: the same shard width)" if e.outcome.shared else ""
    return (f"Lamport all-to-all for rows {list(e.outcome.rows)}{_dtype(e.outcome)}{shared} "
            f"through {where}")


def _candidates_clause(c):
    """The summary's words for a candidate path (``Candidates``)."""
    if not c.served:
        stock = c.kept
        return f"{c.path}: stock candidate all-gather ({_why(stock) if stock else 'none built'})"
    gathers = ", ".join(f"rows {list(rows)} (packed width {width})" for width, rows in c.served)
    return f"{c.path}: Lamport candidate gather{'s' if len(c.served) > 1 else ''} for {gathers}"


def _drafter_clause(d):
    """The summary's words for the drafter (``route.Drafter``)."""
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
