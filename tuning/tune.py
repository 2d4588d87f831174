"""``lamport-head tune``: sweep each row count, print a summary, merge the table.

One GPU with ``--emulate``: TP virtual ranks (entries written ``emulated: true``,
never served, with the gather's time only: no stock figure, as in the printed table
and the plot). Under torchrun: one rank per GPU, NCCL for the stock path, the
mailbox on symmetric memory; rank 0 owns the studies and writes the table: the
user's table by default (``lamport_head.table.user_path``, a serving layer above the
packaged one), its Optuna studies beside it.

``--all-to-all`` (torchrun only): the all-to-all of vocab shards instead
(``harness.AllToAllTarget``: rows are a step's total M, split as vLLM's batch sharding
splits them, against ``all_to_all_single`` and vLLM's permute), written as the
section of stock ``nccl-all-to-all`` beside the gather's.
"""

import math
import shlex
import sys
from pathlib import Path

import torch

from lamport_head.provenance import provenance

from .sweep import DistComm, LocalComm, tune_rows
from .targets import make_target
from .writer import measured_rows, merge_section


class Progress:
    """A one-line progress bar over trials on stderr."""

    def __init__(self, total, enabled=True):
        self.total, self.done, self.enabled = max(total, 1), 0, enabled

    def step(self, rows, config, timing):
        self.done += 1
        if not self.enabled:
            return
        width = 30
        fill = int(width * min(self.done, self.total) / self.total)
        what = f"{timing.eager_us:8.2f} µs" if timing else "  failed verify"
        ctas, threads, unroll = config.ctas, config.threads, config.unroll
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"rows={rows:<3} ctas={ctas:<4} threads={threads:<4} unroll={unroll} {what}")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


def summary(results, emulated):
    """The table tune prints. Emulated (TP virtual ranks on one GPU, or processes sharing
    one): the gather's time alone; its only stand-in for the all-gather is a local cat
    or a time-sliced one, no all-gather, so no stock, speedup or enabled column."""
    if emulated:
        lines = [f"{'rows':>5} {'ctas':>5} {'thr':>5} {'unr':>4} {'gather µs':>10}"]
        for r in sorted(results, key=lambda r: r.rows):
            lines.append(f"{r.rows:>5} {r.entry.ctas:>5} {r.entry.config.threads:>5} {r.entry.config.unroll:>4} "
                         f"{r.lamport_us:>10.2f}")
        lines.append("emulated: TP virtual ranks on one GPU (or processes sharing one), no "
                     "all-gather to compare with. Written with emulated: true, never used for "
                     "serving.")
        return "\n".join(lines)
    lines = [f"{'rows':>5} {'ctas':>5} {'thr':>5} {'unr':>4} {'lamport µs':>11} {'stock µs':>9} "
             f"{'speedup':>8} {'enabled':>8}"]
    for r in sorted(results, key=lambda r: r.rows):
        lines.append(f"{r.rows:>5} {r.entry.ctas:>5} {r.entry.config.threads:>5} {r.entry.config.unroll:>4} "
                     f"{r.lamport_us:>11.2f} {r.stock_us:>9.2f} {r.speedup:>7.2f}x "
                     f"{str(r.entry.enabled).lower():>8}")
    return "\n".join(lines)


def section_rows(results, emulated):
    """The rows tune writes: ``writer.measured_rows``; for an emulated section without
    the stand-in's figure (``stock_us``) and with every row disabled (never served:
    ``enabled`` there would only say whether the gather beat a local cat)."""
    rows = measured_rows(results)
    if emulated:
        for entry in rows.values():
            entry.pop("stock_us", None)
            entry["enabled"] = False
    return rows


def plot_records(results, emulated):
    """What ``plot.plot_rows`` draws: each finished row's figures, stock's only on real
    ranks."""
    keep = ("rows", "lamport_us", "lamport_gpu_us") + (() if emulated else ("stock_us", "stock_gpu_us"))
    return [{k: getattr(r, k) for k in keep} for r in results if math.isfinite(r.lamport_us)]


def run(args):
    """Entry of the tune subcommand (args from lamport_head.cli)."""
    from lamport_head.table import ALL_TO_ALL_STOCK, NCCL_STOCK, normalize, user_path

    rows_list = args.rows
    stock = ALL_TO_ALL_STOCK if args.all_to_all else NCCL_STOCK  # the collective timed
    # time-sliced processes (ranks sharing a GPU) are written emulated, never served
    chosen = make_target("tune", args.tp, args.vocab, emulate=args.emulate,
                         shared_note="; the section is written emulated: true", dtype=args.dtype,
                         stock=stock)
    target, device, world, emulated = chosen.target, chosen.device, chosen.world, chosen.emulated
    comm = DistComm(None) if world > 1 else LocalComm()
    name = torch.cuda.get_device_name(device)
    out = Path(args.out) if args.out else user_path()  # the user layer by default
    storage = args.storage or f"sqlite:///{out.with_name(out.stem + '.optuna.db').resolve()}"
    root = comm.is_root
    if root:
        print(f"lamport-head tune: {name}, tp={args.tp}, dcp={args.dcp}, vocab={args.vocab}, "
              f"{args.dtype} logits, against {stock}, "
              f"rows {rows_list}, {'emulated on one GPU' if emulated else f'{world} GPUs'}; "
              f"studies in {storage}", flush=True)
    progress = Progress(args.trials * len(rows_list), enabled=root and not args.quiet)
    results = []
    for rows in rows_list:
        results.append(tune_rows(target, rows, device=normalize(name), tp=args.tp, dcp=args.dcp,
                                 vocab=args.vocab, trials=args.trials, storage=storage, comm=comm,
                                 margin=args.margin, threads=tuple(args.threads),
                                 unroll=tuple(args.unroll), on_trial=progress.step,
                                 stock_kind=stock))
    progress.close()
    if not root:
        return 0
    print(summary(results, emulated))
    command = "lamport-head " + shlex.join(getattr(args, "argv", sys.argv[1:]))
    if world > 1:
        command = f"torchrun --nproc-per-node {world} " + command
    path = merge_section(out, name, args.tp, args.dcp, section_rows(results, emulated),
                         provenance(device, command), emulated=emulated, vocab=args.vocab,
                         stock=stock, dtype=args.dtype)
    print(f"wrote {path} ({name}, tp={args.tp}, dcp={args.dcp}, vocab={args.vocab}, {args.dtype}, "
          f"stock {stock}{', emulated' if emulated else ''})")
    if args.plot:
        from .plot import plot_rows

        plot_rows(plot_records(results, emulated), args.plot,
                  f"{name} tp={args.tp}" + (" (emulated)" if emulated else ""), emulated=emulated)
        print(f"plot: {args.plot}")
    return 0
