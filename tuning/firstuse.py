"""First-use tuning's measuring (``measure``): when no table layer holds a real-rank
section for this GPU model, TP, DCP, vocabulary V = TP x shard width and logits dtype
(a section measured at another V or dtype is none: the bytes a row moves scale with
both), or the user
table holds no version of it measured in this environment (``table.version``: another
environment's is kept beside it, not replaced), the install core measures before it
serves. The core decides when
(its agreed view, ``lamport_head.settings``); the engine adapters hand it ``measure``,
imported only then, so serving from a table never imports the tuner.

The measuring is ``lamport-head tune``'s: ``tuning.sweep.tune_rows`` per row count,
rank-agreed (``DistComm``: rank 0 owns an in-memory Optuna study, every rank times
every trial, a trial's figure is the maximum over ranks), on the real-rank harness of
the collective that replaces the site's stock (``harness.target_for``:
``DistributedTarget`` for a gather, ``AllToAllTarget`` for vLLM's all-to-all of vocab
shards, its rows the step's total M, its splits vLLM's batch sharding's; every
configuration verified bitwise before it is timed, Lamport and stock timed in the
same run), within small limits (``FIRST_USE_LIMITS``). Rank 0 writes
the measured rows to the user table (``table.user_path()``) with provenance and
``vocab: V``, beside the sections for other vocabularies (a second model with another
V on the same machine gets its own section, the first model's stays); the next start
of either reads its section and measures nothing.

Fail-stop: every step that can fail on one rank runs inside ``attempt`` and is
agreed (``agree``, or an exchange whose errors travel to every rank, marked
``together``) before the next collective; the harness raises on every rank together.
When to stop measuring is rank 0's clock's decision, broadcast (``DistComm``): a rank
stopping by its own clock would leave its peers alone in the next row's collectives.
The write is the one step whose failure costs nothing but itself: its outcome travels
to every rank (an all-gather), and a cache that cannot be written (read-only, full)
leaves every rank serving what it measured: the outcome's ``unsaved`` says why it was
not saved, and install says it in one line (one a start, with a broken user table's). Such a failure raises on every rank at the same step, marked
``collective.raised_together``; install catches it and leaves every rank stock with one
warning. A failure of one rank alone (the engine's own gather, timed as stock, failing
on one rank: its peers are inside that collective) is not marked: install lets it stop
the worker, and the engine stops every rank.

Processes sharing one GPU (detected by install from the ranks' device keys) time-
slice it: their figures are not performance. The section is written
``emulated: true`` and not served, on this start or later ones, unless
``LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED=1`` (for testing that mode end to end only).

``LAMPORT_HEAD_AUTOTUNE=0`` turns first-use tuning off: a missing section means stock,
a stale one is served as it is.
"""

import time
from dataclasses import dataclass

from lamport_head import dtypes, provenance
from lamport_head.collective import agree, all_gather_objects, attempt, together
from lamport_head.config import default_config
from lamport_head.kernels.protocol import DEFAULT_THREADS
from lamport_head.table import NCCL_STOCK, fill, normalize, user_path

COMMAND = "first-use tuning at install (lamport_head.tuning.firstuse)"


@dataclass(frozen=True)
class FirstUseLimits:
    """How much first-use tuning measures (its time allowance, not the kernel's spin
    budget). One kernel build per (threads, unroll): the default threads, and per row
    count the batches its default plan takes (``unroll`` None: register batches of 4
    or staged batches of 8, ``config.default_config``; a tuple: those for every row);
    a few CTA counts, each a trial (walked, not sampled); short timing loops; and a
    wall-clock stop between row counts (rows past it stay unmeasured, hence stock)."""

    seconds: float = 15.0
    ctas: tuple = (8, 16, 32, 64, 128)
    threads: tuple = (DEFAULT_THREADS,)
    unroll: tuple | None = None
    calls: int = 10
    reps: int = 3
    replays: int = 5
    margin: float = 0.05


FIRST_USE_LIMITS = FirstUseLimits()


def rows_to_measure(rows):
    """A few representative row counts of ``rows``: its smallest, the powers of two
    between, and its largest (the cap). The table's fill rule covers the gaps."""
    rows = sorted(set(rows))
    lo, hi = rows[0], rows[-1]
    picks = {lo, hi} | {1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi}
    return sorted(m for m in picks if m in rows)


def row_unroll(target, rows, tp, shard, threads, dtype=dtypes.DEFAULT):
    """The unrolls the default plans of ``rows`` take at ``threads`` (a tuple, in
    order): what serving would build without a table, so first use measures that
    kernel. Collective on real ranks (``target.limit`` is): every rank asks the same
    limits in the same order."""
    def limit(config):
        return target.limit(config.threads, config.unroll)

    picks = [default_config(rows, tp, shard, t, None, limit, dtype).unroll for t in threads]
    return tuple(dict.fromkeys(picks))


def make_target(ranks, vocab, limits=FIRST_USE_LIMITS, stock=None, dtype=dtypes.DEFAULT, *,
                stock_kind=NCCL_STOCK):
    """The real-rank harness first-use tuning measures on: the one of the collective
    serving in place of ``stock_kind`` (``harness.target_for``); ``stock``: the engine's
    own collective the route replaces (None: the tuner's NCCL stand-in); ``dtype``: the
    model's logits dtype (a ``dtypes`` name), the one the trials move."""
    from .harness import target_for

    return target_for(stock_kind)(ranks, vocab, calls=limits.calls, reps=limits.reps,
                                  replays=limits.replays, stock=stock,
                                  dtype=dtypes.torch_dtype(dtype))


@dataclass
class Outcome:
    entries: dict  # {rows: TableRow}: the enabled entries of ``rows`` after the fill rule
    results: list  # tuning.sweep.RowResult per measured row count
    emulated: bool
    seconds: float
    path: str  # this rank's host's user table
    unsaved: str | None = None  # why the table could not be written (served all the same)


def measure(group, device, tp, rank, dcp, shard, rows, shared, name, limits=FIRST_USE_LIMITS, *,
            stock=None, stock_kind=NCCL_STOCK, dtype=dtypes.DEFAULT):
    """Collective over ``group``: measure ``rows_to_measure(rows)``, the first rank of
    each host writes the agreed rows into that host's user table, every rank returns
    the same ``Outcome`` (but ``path``: its own host's table). Raises on every rank
    together when any rank fails (nothing is written then).

    ``stock``: the engine's own collective that the route replaces (the callable
    install found at the site: a gather ``[M, V/TP] -> [M, V]``, or for
    ``ALL_TO_ALL_STOCK`` vLLM's ``all_to_all_vocab_shards(shard, send_splits,
    num_local_rows)``, called with the splits the harness draws), timed in place of the
    tuner's NCCL stand-in, so a row is enabled only where the Lamport collective beats
    the path it replaces (SGLang's multimem one-shot gather where SGLang built one);
    ``stock_kind`` (``table.STOCKS``) picks the collective measured (the all-to-all
    for ``ALL_TO_ALL_STOCK``, whose rows are the step's total M), and the section is
    written with ``stock: stock_kind`` and served only against that stock.
    ``dtype``: the model's logits dtype (a ``dtypes`` name, the head's: FP32 for an
    FP32 lm_head): every trial moves it, and the section is written with ``dtype:
    dtype`` and served only to logits of that dtype."""
    import torch
    import torch.distributed as dist

    from lamport_head.mailbox import choose_backend, device_key, exchange
    from lamport_head.tuning.support.procs import Ranks

    from .sweep import DistComm, tune_rows

    start = time.monotonic()
    vocab = tp * shard

    def prepare():
        ranks = Ranks(torch.device(device), rank, tp, shared, dist.get_backend(group), group)
        return (make_target(ranks, vocab, limits, stock, dtype, stock_kind=stock_kind),
                provenance.kernel_identity(), provenance.facts())

    prepared, error = attempt(prepare)
    agree(error, group, device, "to prepare first-use tuning")
    target, kernel, now = prepared
    # Collective, the same answer on every rank. Ranks that can have no mailbox (several
    # hosts, nothing forced) raise here on every rank and nothing is written: measured,
    # every trial would fail alike and the section would read as a measured "all stock".
    try:
        choose_backend(group, torch.device(device))
    except Exception as exc:  # decided from gathered facts: the same error on every rank
        raise together(exc)
    comm = DistComm(group)
    results = []
    for m in rows_to_measure(rows):
        # Rank 0's clock decides for everyone.
        if comm.broadcast(time.monotonic() - start > limits.seconds and bool(results)):
            break
        unroll = limits.unroll or row_unroll(target, m, tp, shard, limits.threads, dtype)
        results.append(tune_rows(
            target, m, device=normalize(name), tp=tp, dcp=dcp, vocab=vocab,
            trials=len(limits.ctas) * len(limits.threads) * len(unroll), storage=None,
            comm=comm, margin=limits.margin, threads=limits.threads, unroll=unroll,
            ctas=limits.ctas, kernel=kernel, stock_kind=stock_kind))
    emulated = bool(shared or target.emulated)
    # Only measurements are saved: a row count none of whose configurations could be
    # built and verified was not measured (its "disabled" entry would read as a
    # measured loss for good). The results are the same on every rank (agreed trials),
    # so every rank takes the same branch; none measured: every rank raises, nothing
    # is written, the next start measures again.
    unmeasured = [r.rows for r in results if not r.trials]
    results = [r for r in results if r.trials]
    if not results:
        raise together(RuntimeError(
            f"no configuration could be built and verified for rows {unmeasured} "
            f"({len(limits.ctas)} CTA counts each): nothing written; the next start "
            "measures again"))
    # Rank 0's clock and date, so that every host writes the same section.
    seconds, date = comm.broadcast((time.monotonic() - start, provenance.now()))

    def write():
        from .writer import measured_rows, merge_section

        prov = provenance.provenance(device, COMMAND, name=name, facts=now, date=date)
        prov["note"] = (f"{len(results)} row counts of {min(rows)}-{max(rows)} in {seconds:.1f} s, "
                        f"{len(limits.ctas)} CTA counts each"
                        + (f"; rows {unmeasured} could not be built (not written)"
                           if unmeasured else ""))
        if emulated:
            prov["note"] += "; processes sharing one GPU: not performance, never served"
        return str(merge_section(user_path(), name, tp, dcp, measured_rows(results), prov,
                                 emulated=emulated, vocab=vocab, stock=stock_kind,
                                 dtype=dtype))

    # Every host gets the table: its first rank writes the agreed rows into its own
    # user table (ranks on several hosts, an NVL72 domain, would otherwise find the
    # section only on rank 0's host and stay stock for good at the next start).
    try:  # exchange raises on every rank alike (its errors travel in the one all-gather)
        hosts = exchange(lambda: device_key(torch.device(device))[0], group, what="name its host")
    except Exception as exc:
        raise together(exc)
    writes = hosts.index(hosts[rank]) == rank
    path, error = attempt(write) if writes else (None, None)
    # A write that failed (a read-only or full cache) costs the table, not this start:
    # the rows were measured and agreed, so every rank serves them; the outcome travels
    # to every rank, so every rank logs the same line and takes the same path.
    failed = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}",
                                group)
    unsaved = failed[hosts.index(hosts[rank])]
    path = str(user_path())  # the file this rank's host serves from (its writer's)
    measured = {r.rows: r.entry for r in results}
    entries = {m: e for m, e in fill(measured).items() if e.enabled and m in set(rows)}
    return Outcome(entries, results, emulated, seconds, path, unsaved)
