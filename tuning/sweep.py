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
DCP, vocab, the stock collective, rows, the kernel's identity and the search space
(``study_name``); each trial stores its configuration's values (``label``), never an
index into a grid. A re-run loads its study, counts the finished trials against
``trials``, and a configuration already finished is answered from the study, never
re-timed.

Without a storage (first-use tuning at install) a grid no larger than ``trials`` is
walked in order in memory (``_Walk``), so serving never imports Optuna; Optuna is
imported only where a study is opened.
"""

import logging
import math
from dataclasses import dataclass

from lamport_head.collective import together
from lamport_head.config import CTA_STEPS, SWEEP_THREADS, SWEEP_UNROLL, GatherConfig, sweep_grid
from lamport_head import dtypes
from lamport_head.dtypes import name as dtype_name
from lamport_head.provenance import digest, kernel_identity
from lamport_head.table import NCCL_STOCK, TableRow


@dataclass
class RowResult:
    rows: int
    entry: TableRow  # the best verified configuration; enabled = beats stock by margin
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


def grid(target, threads=SWEEP_THREADS, unroll=SWEEP_UNROLL, ctas=None):
    """Every ``GatherConfig`` the device can hold co-resident; ``ctas`` (None: every
    step of ``CTA_STEPS``) narrows the CTA counts tried."""
    return _space(target, threads, unroll, ctas)[0]


def _space(target, threads, unroll, ctas):
    """``(grid, limits)``: the grid and the co-resident limit per (threads, unroll) it
    was cut at (collective on real ranks: ``target.limit`` is)."""
    limits = {(t, u): target.limit(t, u) for t in threads for u in unroll}
    return sweep_grid(limits, ctas), limits


def _no_fit(limits, ctas):
    """The error every rank raises on an empty grid: what was asked, what fits."""
    asked = sorted(ctas) if ctas is not None else list(CTA_STEPS)
    fits = ", ".join(f"limit {limit} at threads={t}, unroll={u}"
                     for (t, u), limit in limits.items())
    return ValueError(f"lamport-head tune: no CTA count fits: {fits}; the CTA counts tried are "
                      f"{asked}")




def study_name(device, tp, dcp, rows, emulated, *, vocab, kernel, space, dtype=dtypes.DEFAULT,
               stock=NCCL_STOCK):
    """The study key: a timing is reused only for the same device, TP, DCP, vocab,
    logits dtype, stock collective (``table.STOCKS``: the all-to-all's trials time
    another collective than the gather's), rows and kernel build. The search space's
    hash is in it too: Optuna refuses a categorical parameter whose choices change
    within a study. BF16's key names no dtype and the NCCL gather's no stock (the keys
    studies were stored under before dtypes and stocks)."""
    grid_hash = digest(*(c.label().encode() for c in space), size=8)
    dtype = dtype_name(dtype)
    return (f"lamport-head|{device}|tp{tp}|dcp{dcp}|vocab{vocab}"
            + ("" if dtype == dtypes.DEFAULT else f"|{dtype}")
            + ("" if stock == NCCL_STOCK else f"|{stock}")
            + f"|rows{rows}|kernel-{kernel}|space-{grid_hash}" + ("|emulated" if emulated else ""))


def _report(on_trial, *args):
    """The caller's per-trial callback (a progress bar): display only, so a failure
    there is logged and the sweep goes on. Raising would take this rank out of the
    sweep's collectives alone while its peers wait in the next one."""
    try:
        on_trial(*args)
    except Exception as exc:
        logging.getLogger("lamport_head").warning(
            "lamport-head tune: the per-trial callback failed (%s: %s); the sweep goes on",
            type(exc).__name__, exc)


def tune_rows(target, rows, *, device, tp, dcp, vocab, trials, storage, comm=None,
              margin=0.05, threads=SWEEP_THREADS, unroll=SWEEP_UNROLL, seed=0, on_trial=None, kernel=None,
              ctas=None, stock_kind=NCCL_STOCK):
    """Sweep one row count; every rank calls it, only the root touches Optuna.

    ``kernel`` (default ``kernel_identity()``) names the kernel build in the study key.
    ``ctas`` (default: every step) narrows the CTA counts of the grid (``grid``).
    ``stock_kind``: the stock collective ``target`` times (``table.STOCKS``), in the key.
    Invariant: the result names a configuration timed in this study (these device,
    TP, DCP, vocab, stock, rows, kernel and search space), never one merely indexed
    alike.
    Fail-stop: every rank returns the same result or raises at the same step. An empty
    grid (no CTA count asked fits the agreed limit) raises ``ValueError`` on every rank
    before anything is timed; whatever fails on the root alone (the study's key, which
    reads the kernel's files, Optuna) runs inside its guard and becomes an error order
    every rank raises as ``RuntimeError``.
    """
    comm = comm or LocalComm()
    # Every rank builds the grid: target.limit is collective on real ranks. The ranks
    # then use the root's grid, so they measure the same configurations.
    space, limits = comm.broadcast(_space(target, threads, unroll, ctas))
    if not space:  # the same broadcast answer on every rank: every rank raises here
        raise together(_no_fit(limits, ctas))
    stock = target.stock(rows)
    root = None
    if comm.is_root:
        # No storage and a grid it can walk whole: nothing to resume, nothing to sample.
        walk = storage is None and len(space) <= trials
        root = (_Walk if walk else _Study)(space, trials)

    def key():  # root only, inside its guard: kernel_identity() reads files
        return study_name(device, tp, dcp, rows, target.emulated, vocab=vocab,
                          kernel=kernel or kernel_identity(), space=space,
                          dtype=getattr(target, "dtype", dtypes.DEFAULT), stock=stock_kind)

    failure = root.run(root.open, key, storage, seed) if root else None
    timed = 0
    while True:
        order = None
        if root:
            order = ("error", failure) if failure else root.guard(root.next_order)
        order = comm.broadcast(order)
        if order[0] == "error":  # the study failed on the root: every rank stops together
            raise together(RuntimeError(
                f"lamport-head tune: the Optuna study failed on rank 0: {order[1]}"))
        if order[0] == "stop":
            break
        config = order[1]
        timing = target.lamport(rows, config)
        timed += 1
        value = getattr(timing, target.objective) if timing is not None else math.inf
        if value != value:  # no usable figure (e.g. host-bound GPU timing)
            value = math.inf
        # A failure on one rank (None or no figure) is a failure on all: every rank
        # must tell the study, the callback and its peers the same story.
        value = comm.max(value)
        if value == math.inf:
            timing = None
        if root:
            failure = root.run(root.record, config, timing, value)
        if on_trial:
            _report(on_trial, rows, config, timing)
    result = root.guard(root.conclude, rows, stock, target.objective, margin, timed) if root \
        else None
    result = comm.broadcast(result)
    if isinstance(result, tuple):  # ("error", why)
        raise together(RuntimeError(
            f"lamport-head tune: the Optuna study failed on rank 0: {result[1]}"))
    return result


class _Root:
    """The root's side of a sweep. Its steps never raise past ``run``/``guard``: a
    failure becomes an order every rank receives. Construction only stores its
    arguments (it cannot fail); everything that can fail happens in ``open``."""

    def __init__(self, space, trials):
        self.space, self.trials = space, trials
        self.current = None

    def run(self, step, *args):
        """``step(*args)``; the failure's text, or None."""
        try:
            step(*args)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def guard(self, step, *args):
        """``step(*args)``, or ``("error", why)``."""
        try:
            return step(*args)
        except Exception as exc:
            return ("error", f"{type(exc).__name__}: {exc}")

    def _result(self, rows, stock, objective, margin, timed, finished):
        """The RowResult from ``finished``: (config, value, gpu_us) of every completed
        trial in trial order; the first fastest wins."""
        base = getattr(stock, objective)
        if not finished:
            return RowResult(rows, TableRow(GatherConfig(1), False), math.inf, base, math.nan,
                             stock.gpu_us, 0, timed)
        config, value, gpu_us = min(finished, key=lambda f: f[1])
        enabled = value < base * (1 - margin)
        return RowResult(rows, TableRow(config, enabled), value, base, gpu_us, stock.gpu_us,
                         len({c for c, _, _ in finished}), timed)


class _Walk(_Root):
    """A grid walked in order in memory, each configuration once: what an Optuna
    study without storage does for a grid no larger than its trials (every point
    enqueued, asked in order), without importing Optuna (first-use tuning runs in the
    serving process)."""

    def open(self, key, storage, seed):
        self.pending = list(self.space)
        self.finished = []  # (config, value, gpu_us), trial order

    def next_order(self):
        if not self.pending:
            return ("stop",)
        self.current = self.pending.pop(0)
        return ("measure", self.current)

    def record(self, config, timing, value):
        if timing is not None:  # failed verification: never a candidate
            self.finished.append((config, float(value), timing.gpu_us))

    def conclude(self, rows, stock, objective, margin, timed):
        return self._result(rows, stock, objective, margin, timed, self.finished)


class _Study(_Root):
    """The root's Optuna study: opened (or resumed) from its storage, sampled by TPE
    (a small grid is enqueued and walked)."""

    def open(self, key, storage, seed):
        """Open (or resume) the study named ``key()``; enqueue a small grid's walk."""
        import optuna

        self.optuna = optuna
        self.labels = {c.label(): c for c in self.space}
        self.choices = optuna.distributions.CategoricalDistribution(list(self.labels))
        name = key()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = study = optuna.create_study(
            study_name=name, storage=storage, sampler=optuna.samplers.TPESampler(seed=seed),
            direction="minimize", load_if_exists=True)
        self.done = {t.params["config"]: t for t in study.trials
                     if t.state in (optuna.trial.TrialState.COMPLETE,
                                    optuna.trial.TrialState.FAIL)
                     and t.params.get("config") in self.labels}
        self.trials_left = max(0, min(self.trials, len(self.space)) - len(self.done))
        self.repeats = 0
        if len(self.space) <= self.trials:  # a small grid: walk it (enqueued), TPE never guesses
            for name in self.labels:
                if name not in self.done:
                    study.enqueue_trial({"config": name})

    def next_order(self):
        """("measure", config) for the next untimed trial, or ("stop",)."""
        optuna, study, done = self.optuna, self.study, self.done
        while self.trials_left > 0:
            trial = study.ask({"config": self.choices})
            name = trial.params["config"]
            if name in done:  # already timed in this study: answer, don't re-time
                for key, value in done[name].user_attrs.items():
                    trial.set_user_attr(key, value)
                if done[name].state == optuna.trial.TrialState.FAIL:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, done[name].value)
                self.repeats += 1
                if self.repeats >= 20:  # TPE keeps proposing known points: take an untried one
                    untried = [n for n in self.labels if n not in done]
                    if not untried:
                        self.trials_left = 0
                    else:
                        study.enqueue_trial({"config": untried[0]})
                    self.repeats = 0
                continue
            self.repeats = 0
            self.current = trial
            return ("measure", self.labels[name])
        return ("stop",)

    def record(self, config, timing, value):
        current = self.current
        # The configuration's values travel with the trial, so a reader of the study
        # never has to trust an index into some run's grid.
        for key, v in config.values().items():
            current.set_user_attr(key, v)
        if timing is None:  # failed verification: never a candidate
            self.study.tell(current, state=self.optuna.trial.TrialState.FAIL)
        else:
            current.set_user_attr("gpu_us", timing.gpu_us)
            current.set_user_attr("eager_us", timing.eager_us)
            current.set_user_attr("host_us", timing.host_us)
            self.study.tell(current, value)
        self.done[config.label()] = self.study.trials[current.number]
        self.trials_left -= 1

    def conclude(self, rows, stock, objective, margin, timed):
        finished = [(self.labels[tr.params["config"]], tr.value,
                     tr.user_attrs.get("gpu_us", math.nan)) for tr in self.study.trials
                    if tr.state == self.optuna.trial.TrialState.COMPLETE
                    and tr.params.get("config") in self.labels]
        return self._result(rows, stock, objective, margin, timed, finished)
