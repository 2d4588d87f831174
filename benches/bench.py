"""``lamport-head bench``: where the gather stands, per row count, in one run.

Per row count: GPU time per step against the HBM floor (``floor``: the bytes every
rank on the GPU reads and writes, over the copy bandwidth measured in this run), the
default plan against the benchmarked one, the lm_head shard GEMM of the same shape
and the gather's visible cost behind it with PDL on and off, host µs per eager call
against ``torch.add_`` timed the same way in the same run, and what a captured
gather costs. Under torchrun on real ranks, also the stock path (NCCL all-gather +
reorder, vLLM's). The emulated mode (one process, TP virtual ranks on one GPU) has
no stock figure: its only stand-in would be a local ``torch.cat``, no all-gather.

Output: the tables and the targets' verdicts on stdout, a CSV (rewritten after every
row count, so a run cut short keeps what it measured), a JSON with the run's facts,
and a PNG with --plot whose title names the mode. The plan comes from the table
(emulated sections included when emulating), else the built-in CTA heuristic.
"""

import contextlib
import json
import math
import signal
import threading
from pathlib import Path

import torch

from lamport_head import config, dtypes
from lamport_head.dtypes import itemsize
from lamport_head.table import NCCL_STOCK, load_table

from . import goals, report
from ..tuning.targets import make_target


def config_for(target, rows, entries, threads=config.DEFAULT_THREADS, unroll=None):
    """The GatherConfig to time ``rows`` with: its entry's in ``entries`` (a section's
    ``{rows: TableRow}``, enabled or not), else the default heuristic's
    (``config.default_config``: unroll None chooses it per row count, as serving does)."""
    if rows in entries:
        return entries[rows].config
    return config.default_config(rows, target.tp, target.shard_width, threads, unroll,
                                 lambda c: target.limit(c.threads, c.unroll),
                                 getattr(target, "dtype", None) or "bfloat16")


def make_runner(chosen, args):
    """The measurements of ``chosen``'s mode (the seam CPU tests replace)."""
    if chosen.world > 1:
        from .rankbench import RanksRunner

        return RanksRunner(chosen.target, args.hidden, budget_s=args.budget_s)
    from .emubench import EmulatedRunner

    return EmulatedRunner(chosen.target, args.hidden, budget_s=args.budget_s)


def _say(root, *lines):
    if root:
        for line in lines:
            print(line, flush=True)


def run(args):
    dtype = getattr(args, "dtype", dtypes.DEFAULT)
    chosen = make_target("bench", args.tp, args.vocab, dtype=dtype)
    target, device, root = chosen.target, chosen.device, chosen.root
    mode = report.mode_of(chosen.emulated, chosen.world)
    name = torch.cuda.get_device_name(device)
    # the gather's section (measured against NCCL's all-gather, this bench's stock path),
    # whatever other collectives' sections the table holds at the key
    entries = load_table(args.table).entries(name, target.tp, args.dcp,
                                             emulated=chosen.emulated, vocab=args.vocab,
                                             stock=NCCL_STOCK, dtype=dtype)
    runner = make_runner(chosen, args)
    tp, vocab = target.tp, args.vocab
    ranks_here = tp if chosen.emulated else 1  # ranks whose bytes cross this GPU's memory
    bandwidth = runner.bandwidth_gbs()
    out = Path(args.out)
    if root:
        out.parent.mkdir(parents=True, exist_ok=True)
    _say(root, f"lamport-head bench: {report.title(name, tp, vocab, mode)}",
         f"  mode: {report.MODE_LABEL[mode]}",
         f"  lm_head shard: [M, {args.hidden}] x [{args.hidden}, {vocab // tp}] BF16 into "
         f"{dtype}; PDL on "
         f"this GPU: {'yes' if runner.pdl else 'no (PDL on = off)'}; spin budget "
         f"{args.budget_s} s; device-to-device copy {bandwidth:.0f} GB/s (read + write)")
    records = []
    try:
        with _term_interrupts(chosen.world == 1):
            _measure_rows(args, target, runner, entries, records, root, mode, out,
                          ranks_here, bandwidth)
        cut = False
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM from `timeout`: report what was measured
        cut = True
        _say(root, f"  interrupted after {len(records)} of {len(args.rows)} row counts: "
             "reporting those")
    if not root:
        return 0
    code = _report(args, name, tp, vocab, mode, runner, bandwidth, records, out)
    return 130 if cut else code


@contextlib.contextmanager
def _term_interrupts(enabled):
    """SIGTERM raises KeyboardInterrupt while measuring (one process only: ranks under
    torchrun are the launcher's to stop), so a run cut short still prints its tables."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _measure_rows(args, target, runner, entries, records, root, mode, out, ranks_here,
                  bandwidth):
    """Measure each row count into ``records`` (appended as each is done), the CSV
    rewritten after each."""
    tp, vocab = target.tp, args.vocab
    for rows in args.rows:
        benchmarked = config_for(target, rows, entries)
        default = config_for(target, rows, {})
        record = {"rows": rows, "ctas": benchmarked.ctas, "threads": benchmarked.threads,
                  "unroll": benchmarked.unroll,
                  "plan": "table" if rows in entries else "default"}
        record.update(runner.row(rows, benchmarked, default))
        report.derive(record, tp=tp, vocab=vocab, ranks_here=ranks_here, bandwidth_gbs=bandwidth,
                      itemsize=itemsize(getattr(args, "dtype", dtypes.DEFAULT)))
        records.append(record)
        if root:
            report.write_csv(out.with_suffix(".csv"), mode, records, tp=tp, vocab=vocab,
                             hidden=args.hidden)
        _say(root, f"  M={rows}: {record['gpu_us']:.2f} GPU µs/step, "
             f"{record['floor_ratio']:.2f}x the HBM floor")


def _report(args, name, tp, vocab, mode, runner, bandwidth, records, out):
    """The root's tables, verdicts, notes, JSON and plot; the exit status."""
    for caption, columns in report.tables(mode):
        print()
        print("\n".join(report.format_table(caption, columns, records)))
    print("\nTargets (issue 21; ratios within this run):")
    print("\n".join(goals.verdicts(records, tp)))
    for note in runner.notes:
        print(f"note: {note}")
    meta = {"gpu": name, "mode": mode, "mode_label": report.MODE_LABEL[mode], "tp": tp,
            "vocab": vocab, "hidden": args.hidden, "pdl": runner.pdl, "copy_gbs": bandwidth,
            "budget_s": args.budget_s, "notes": runner.notes, "records": records}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    if args.plot:
        from .benchplot import plot_bench

        plot_bench(records, args.plot, report.title(name, tp, vocab, mode))
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.json')}"
          + (f", {args.plot}" if args.plot else ""))
    return 0 if all(math.isfinite(r["gpu_us"]) for r in records) else 1
