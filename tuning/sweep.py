"""The Optuna sweep behind ``lamport-head tune``: per row count, the fastest verified
(CTAs, threads, unroll) and whether it beats stock by the margin. The figure
minimized is the target's ``objective``: eager latency on real ranks (what serving
sees), GPU time when emulated (there, eager time is the host launching TP ranks).

Rank agreement: every rank issues every collective the target issues, in the same
order: every rank builds the search space (``target.limit`` is collective on real
ranks), times stock, and times each trial. Rank 0 alone owns the study; it
broadcasts its search space, each trial's parameters (or the stop signal) to every
rank, every rank measures, and the trial's value is the maximum over ranks (the
target reduces its figures; the sweep also agrees on failure: a trial that failed
on any rank failed on all). Non-root ranks never touch the study.

Resume and no repeats: studies live in ``storage`` under names carrying device, TP,
DCP, vocab, rows, the kernel's identity and the search space (``study_name``); each
trial stores its configuration's values (``label``), never an index into a grid. A
re-run loads its study, counts the finished trials against ``trials``, and a
configuration already finished is answered from the study, never re-timed.
"""

import hashlib
import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import optuna

from lamport_head.table import RowPlan

SWEEP_THREADS = (128, 256, 512)  # the CTA sizes a sweep tries (a subset of the kernel's THREADS)
SWEEP_UNROLL = (2, 4, 8)
_CTA_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass
class RowResult:
    rows: int
    plan: RowPlan  # the best verified configuration; enabled = beats stock by margin
    lamport_us: float
    stock_us: float
    lamport_gpu_us: float = math.nan
    stock_gpu_us: float = math.nan
    trials: int = 0
    timed: int = 0  # trials actually measured in this run

    @property
    def speedup(self):
        return self.stock_us / self.lamport_us if self.lamport_us else math.nan


class LocalComm:
    """A single process: it is the root and agrees with itself."""

    is_root = True

    def broadcast(self, obj):
        return obj

    def max(self, value):
        return value


class DistComm:
    """Rank 0 decides; ``broadcast`` hands its object to every rank of ``group``."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group
        self.is_root = dist.get_rank(group) == 0

    def broadcast(self, obj):
        from lamport_head.collective import broadcast_object

        return broadcast_object(obj, self.group)

    def max(self, value):
        """The largest of every rank's float (collective; NaN-free inputs). An object
        collective: works on gloo (CPU) and NCCL (current device) alike."""
        from lamport_head.collective import all_gather_objects

        return max(all_gather_objects(float(value), self.group))


def cta_choices(limit):
    return [c for c in _CTA_STEPS if c <= limit]


def grid(target, threads=SWEEP_THREADS, unroll=SWEEP_UNROLL, ctas=None):
    """Every (ctas, threads, unroll) the device can hold co-resident; ``ctas`` (None:
    every step of ``_CTA_STEPS``) narrows the CTA counts tried."""
    return [(c, t, u) for t in threads for u in unroll for c in cta_choices(target.limit(t, u))
            if ctas is None or c in ctas]


def label(config):
    """A configuration's values as the study stores them: 'ctas=32,threads=128,unroll=4'."""
    ctas, threads, unroll = config
    return f"ctas={ctas},threads={threads},unroll={unroll}"


def _digest(*parts, size=12):
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two splits collide
        h.update(part)
    return h.hexdigest()[:size]


def kernel_identity(sources=None):
    """12 hex digits naming the kernel build a timing belongs to: the bytes of the
    kernel package's ``*.py`` files (by name; default: the installed
    ``lamport_head.kernels`` directory) and the nvidia-cutlass-dsl version. Reads the
    files without importing the package, which would import cutlass."""
    if sources is None:
        sources = importlib.util.find_spec("lamport_head.kernels").submodule_search_locations
    elif isinstance(sources, (str, Path)):
        sources = [sources]
    parts = []
    for directory in sources:
        for path in sorted(Path(directory).glob("*.py")):
            parts += [path.name.encode(), path.read_bytes()]
    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl = "absent"
    return _digest(*parts, f"nvidia-cutlass-dsl {dsl}".encode())


def study_name(device, tp, dcp, rows, emulated, *, vocab, kernel, space):
    """The study key: a timing is reused only for the same device, TP, DCP, vocab,
    rows and kernel build. The search space's hash is in it too: Optuna refuses a
    categorical parameter whose choices change within a study."""
    grid_hash = _digest(*(label(c).encode() for c in space), size=8)
    return (f"lamport-head|{device}|tp{tp}|dcp{dcp}|vocab{vocab}|rows{rows}|kernel-{kernel}"
            f"|space-{grid_hash}" + ("|emulated" if emulated else ""))


def tune_rows(target, rows, *, device, tp, dcp, vocab, trials, storage, comm=None,
              margin=0.05, threads=SWEEP_THREADS, unroll=SWEEP_UNROLL, seed=0, on_trial=None, kernel=None,
              ctas=None):
    """Sweep one row count; every rank calls it, only the root touches Optuna.

    ``kernel`` (default ``kernel_identity()``) names the kernel build in the study key.
    ``ctas`` (default: every step) narrows the CTA counts of the grid (``grid``).
    Invariant: the result names a configuration timed in this study (these device,
    TP, DCP, vocab, rows, kernel and search space), never one merely indexed alike.
    """
    comm = comm or LocalComm()
    # Every rank builds the grid: target.limit is collective on real ranks. The ranks
    # then use the root's grid, so they measure the same configurations.
    space = comm.broadcast(grid(target, threads, unroll, ctas))
    stock = target.stock(rows)
    timed, study, current = 0, None, None
    if comm.is_root:
        labels = {label(c): c for c in space}
        choices = optuna.distributions.CategoricalDistribution(list(labels))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=study_name(device, tp, dcp, rows, target.emulated, vocab=vocab,
                                  kernel=kernel or kernel_identity(), space=space),
            storage=storage, sampler=optuna.samplers.TPESampler(seed=seed),
            direction="minimize", load_if_exists=True)
        done = {t.params["config"]: t for t in study.trials
                if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
                and t.params.get("config") in labels}
        budget = max(0, min(trials, len(space)) - len(done))
        repeats = 0
        if len(space) <= trials:  # a small grid: walk it (enqueued), TPE never guesses
            for name in labels:
                if name not in done:
                    study.enqueue_trial({"config": name})
    while True:
        order = None
        if comm.is_root:
            order = ("stop",)
            while budget > 0:
                trial = study.ask({"config": choices})
                name = trial.params["config"]
                if name in done:  # already timed in this study: answer, don't re-time
                    for key, value in done[name].user_attrs.items():
                        trial.set_user_attr(key, value)
                    if done[name].state == optuna.trial.TrialState.FAIL:
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    else:
                        study.tell(trial, done[name].value)
                    repeats += 1
                    if repeats >= 20:  # TPE keeps proposing known points: take an untried one
                        untried = [n for n in labels if n not in done]
                        if not untried:
                            budget = 0
                        else:
                            study.enqueue_trial({"config": untried[0]})
                        repeats = 0
                    continue
                repeats = 0
                current = trial
                order = ("measure", labels[name])
                break
        order = comm.broadcast(order)
        if order[0] == "stop":
            break
        ctas, t, u = config = order[1]
        timing = target.lamport(rows, RowPlan(ctas, True, t, u))
        timed += 1
        value = getattr(timing, target.objective) if timing is not None else math.inf
        if value != value:  # no usable figure (e.g. host-bound GPU timing)
            value = math.inf
        # A failure on one rank (None or no figure) is a failure on all: every rank
        # must tell the study, the callback and its peers the same story.
        value = comm.max(value)
        if value == math.inf:
            timing = None
        if comm.is_root:
            # The configuration's values travel with the trial, so a reader of the
            # study never has to trust an index into some run's grid.
            for key, v in zip(("ctas", "threads", "unroll"), config):
                current.set_user_attr(key, v)
            if timing is None:  # failed verification: never a candidate
                study.tell(current, state=optuna.trial.TrialState.FAIL)
            else:
                current.set_user_attr("gpu_us", timing.gpu_us)
                current.set_user_attr("eager_us", timing.eager_us)
                current.set_user_attr("host_us", timing.host_us)
                study.tell(current, value)
            done[label(config)] = study.trials[current.number]
            budget -= 1
        if on_trial:
            on_trial(rows, config, timing)
    result = None
    if comm.is_root:
        finished = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE
                    and tr.params.get("config") in labels]
        if finished:
            top = min(finished, key=lambda tr: tr.value)
            ctas, t, u = labels[top.params["config"]]
            graph = top.user_attrs.get("gpu_us", math.nan)
            base = getattr(stock, target.objective)
            enabled = top.value < base * (1 - margin)
            result = RowResult(rows, RowPlan(ctas, enabled, t, u), top.value, base,
                               graph, stock.gpu_us,
                               len({tr.params['config'] for tr in finished}), timed)
        else:
            result = RowResult(rows, RowPlan(1, False), math.inf, getattr(stock, target.objective),
                               math.nan, stock.gpu_us, 0, timed)
    return comm.broadcast(result)
