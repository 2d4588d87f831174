"""``lamport-head bench --all-to-all``: the all-to-all of vocab shards beside the
all-gather, per M, in one run.

Per M (a step's rows: ``sum(send_splits)``), two collectives on the same ranks, one
after the other:

- the all-gather, ``[M, V/TP] -> [M, V]`` on every rank (vLLM's ``_gather_logits``);
- the all-to-all, ``[M, V/TP] -> [splits[rank], V]`` on each rank (vLLM 0.34's
  ``all_to_all_vocab_shards``, batch-sharded sampling), M split over the ranks evenly
  (``even_splits``: vLLM's round robin of one-row requests; the default) or unevenly
  (``support.splits.vllm_splits``: requests of 1-4 rows dealt as vLLM's batch sharding
  deals them, drawn from M and TP alone, so the same on every rank and in every run,
  empty ranks included: what the tuner times too).

Emulated (one process, TP virtual ranks on one GPU): each collective's GPU µs per step
against its HBM floor (``floor``: the gather's protocol bytes; the all-to-all's bytes
sent plus received). Under torchrun on real ranks: each also against its stock path
on the same ranks (NCCL all-gather + reorder; NCCL ``all_to_all_single`` + vLLM's
permute). Either way, the all-to-all over the all-gather of the same M
(``vs_all_gather``): a ratio of one run, never of times from two.

Invariants: records are the gather bench's (``rows``, the plan's ``ctas``, ``threads``,
``unroll`` and ``plan``, ``gpu_us``, ``floor_us``, ``floor_ratio``, ``step_bytes``,
``copy_gbs``, ``stock_gpu_us`` on real ranks) plus ``collective`` naming it, one per M
and collective, the all-to-all's with its ``splits`` ("a/b/..") and ``vs_all_gather``;
every printed figure is a CSV column of the same key (``fields``); the emulated mode
has no stock column (a one-GPU stand-in says nothing of an interconnect). Each
collective's plan is the table's section measured against its own stock
(``STOCK_OF``), else the built-in heuristic's under its own kernel's occupancy limit.
Measurements only go through the runner (``bench.make_runner``, the seam CPU tests
replace): ``runner.gather(target, rows, config)`` on ``runner.target_for(V)`` and on
``runner.all_to_all_target(splits)``.
"""

import functools
import json
import math
from pathlib import Path

import torch

from lamport_head.all_to_all import even_splits
from lamport_head.dtypes import itemsize
from lamport_head.table import ALL_TO_ALL_STOCK, NCCL_STOCK, load_table
from lamport_head.tuning.support.splits import vllm_splits

from . import bench, report
from .floor import all_to_all_bytes, floor_us, step_bytes
from ..tuning.harness import ALL_GATHER, ALL_TO_ALL
from .report import Column
from ..tuning.targets import make_target

COLLECTIVES = (ALL_GATHER, ALL_TO_ALL)  # each M's records, in this order
STOCK_OF = {ALL_GATHER: NCCL_STOCK, ALL_TO_ALL: ALL_TO_ALL_STOCK}  # the table section's stock
EVEN, UNEVEN = "even", "uneven"
SPLITS = (EVEN, UNEVEN)  # --splits (the CLI's own copy: its --help imports no torch)
SHAPE = {ALL_GATHER: "[M, V/TP] -> [M, V] on every rank",
         ALL_TO_ALL: "[M, V/TP] -> [splits[rank], V] on each rank"}
STOCK_PATH = {report.RANKS: {ALL_GATHER: "NCCL all-gather + reorder (vLLM's)",
                             ALL_TO_ALL: "NCCL all_to_all_single + permute (vLLM's)"},
              report.SHARED: {ALL_GATHER: "gloo all-gather + reorder",
                              ALL_TO_ALL: "gloo all_to_all_single + permute"}}


def splits_for(kind, tp):
    """``--splits kind``'s split of M rows over ``tp`` ranks, as a function of M."""
    return functools.partial(vllm_splits if kind == UNEVEN else even_splits, tp=tp)


def check(args):
    """What is wrong with ``bench --all-to-all``'s own arguments (None: nothing)."""
    if args.drafter:
        return "--all-to-all and --drafter are two benches: run one at a time"
    if args.plot:
        return ("--plot draws the gather bench's figures; --all-to-all writes its tables, CSV "
                "and JSON only")
    return None


def columns(collective, mode):
    """The printed columns of ``collective``'s table in ``mode``."""
    cols = [Column("rows", "M rows", 0)]
    if collective == ALL_TO_ALL:
        cols.append(Column("splits", "splits (rows a rank)", 0))
    cols += [Column("ctas", "CTAs", 0), Column("threads", "threads", 0),
             Column("unroll", "unroll", 0), Column("plan", "plan from", 0),
             Column("gpu_us", "GPU µs/step"), Column("floor_us", "HBM floor µs"),
             Column("floor_ratio", "÷ floor (x)")]
    if mode != report.EMULATED:
        cols += [Column("stock_gpu_us", "stock GPU µs/step"),
                 Column("stock_ratio", "stock ÷ ours (x)")]
    if collective == ALL_TO_ALL:
        cols.append(Column("vs_all_gather", "÷ all-gather (x)"))
    return cols


def tables(mode, kind):
    """(caption, collective, columns) of each printed table, in order, for ``mode`` and
    the all-to-all's ``--splits kind``."""
    where = ("every virtual rank on this GPU" if mode == report.EMULATED
             else "MAX over the ranks")
    out = []
    for c in COLLECTIVES:
        caption = f"{c}, {SHAPE[c]}"
        if c == ALL_TO_ALL:
            caption += f", splits {kind}"
        caption += f": GPU µs per step ({where}) against the HBM floor"
        if mode != report.EMULATED:
            caption += f" and the stock path, {STOCK_PATH[mode][c]}"
            if mode == report.SHARED:
                caption += " (processes sharing a GPU: not performance)"
        if c == ALL_TO_ALL:
            caption += "; ÷ all-gather: over the all-gather of the same M, this run"
        out.append((caption, c, columns(c, mode)))
    return out


def fields(mode):
    """The CSV columns: the run's scalars, the collective, every printed column, the
    step's bytes and the copy bandwidth."""
    keys = ["tp", "vocab", "dtype", "collective"]
    for c in COLLECTIVES:
        keys += [col.key for col in columns(c, mode)]
    return list(dict.fromkeys(keys + ["step_bytes", "copy_gbs"]))


def _ratio(a, b):
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def derive(gather, a2a, splits, *, tp, vocab, ranks_here, bandwidth_gbs, itemsize):
    """Add the floors and ratios to one M's measured records (in place; returned):
    ``gather`` (the all-gather's) and ``a2a`` (the all-to-all's of ``splits``), each with
    ``gpu_us`` and, on real ranks, ``stock_gpu_us``."""
    gather["step_bytes"] = step_bytes(gather["rows"], tp, vocab, ranks_here, itemsize)
    a2a["step_bytes"] = all_to_all_bytes(splits, vocab, ranks_here, itemsize)
    for r in (gather, a2a):
        r["copy_gbs"] = bandwidth_gbs
        r["floor_us"] = floor_us(r["step_bytes"], bandwidth_gbs)
        r["floor_ratio"] = _ratio(r["gpu_us"], r["floor_us"])
        if "stock_gpu_us" in r:
            r["stock_ratio"] = _ratio(r["stock_gpu_us"], r["gpu_us"])
    a2a["vs_all_gather"] = _ratio(a2a["gpu_us"], gather["gpu_us"])
    return gather, a2a


def format_tables(records, mode, kind):
    out = []
    for caption, c, cols in tables(mode, kind):
        out += [""] + report.format_table(caption, cols,
                                          [r for r in records if r["collective"] == c])
    return out


def write_csv(path, records, mode, **scalars):
    report.write_records(path, fields(mode), records, **scalars)


def run(args):
    """``lamport-head bench --all-to-all``; the exit status (1: a figure not measured;
    130: interrupted, after reporting the M measured)."""
    dtype, kind = args.dtype, args.splits or EVEN
    chosen = make_target("bench", args.tp, args.vocab, dtype=dtype)
    root, tp = chosen.root, chosen.target.tp
    mode = report.mode_of(chosen.emulated, chosen.world)
    name = torch.cuda.get_device_name(chosen.device)
    runner = bench.make_runner(chosen, args)
    split = splits_for(kind, tp)
    targets = {ALL_GATHER: runner.target_for(args.vocab),
               ALL_TO_ALL: runner.all_to_all_target(split)}
    table = load_table(args.table)
    entries = {c: table.entries(name, tp, args.dcp, emulated=chosen.emulated, vocab=args.vocab,
                                stock=STOCK_OF[c], dtype=dtype) for c in COLLECTIVES}
    ranks_here = tp if chosen.emulated else 1  # ranks whose bytes cross this GPU's memory
    bandwidth = runner.bandwidth_gbs()
    out = Path(f"{args.out}-all-to-all")
    if root:
        out.parent.mkdir(parents=True, exist_ok=True)
    stocks = ("" if mode == report.EMULATED else
              "; stock: " + ", ".join(f"{STOCK_PATH[mode][c]} for the {c}" for c in COLLECTIVES))
    bench._say(root, f"lamport-head bench --all-to-all: {report.title(name, tp, args.vocab, mode)}",
               f"  mode: {report.MODE_LABEL[mode]}",
               f"  per M: the all-gather {SHAPE[ALL_GATHER]} and the all-to-all "
               f"{SHAPE[ALL_TO_ALL]}, {dtype}, M split {kind}ly{stocks}; spin budget "
               f"{args.budget_s} s; device-to-device copy {bandwidth:.0f} GB/s")
    scalars = dict(tp=tp, vocab=args.vocab, dtype=dtype)
    records = []
    try:
        with bench._term_interrupts(chosen.world == 1):
            for m in args.rows:
                gather, a2a = (_measure(runner, targets[c], m, entries[c], mode)
                               for c in COLLECTIVES)
                a2a["splits"] = "/".join(map(str, split(m)))
                derive(gather, a2a, split(m), tp=tp, vocab=args.vocab, ranks_here=ranks_here,
                       bandwidth_gbs=bandwidth, itemsize=itemsize(dtype))
                records += [gather, a2a]
                if root:
                    write_csv(out.with_suffix(".csv"), records, mode, **scalars)
                bench._say(root, f"  M={m}: all-gather {gather['gpu_us']:.2f}, all-to-all "
                           f"{a2a['gpu_us']:.2f} GPU µs/step ({a2a['vs_all_gather']:.2f}x)")
        cut = False
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM from `timeout`: report what was measured
        cut = True
        bench._say(root, f"  interrupted after {len(records) // 2} of {len(args.rows)} row "
                   "counts: reporting those")
    if not root:
        return 0
    print("\n".join(format_tables(records, mode, kind)))
    for line in runner.notes:
        print(f"note: {line}")
    meta = dict(scalars, gpu=name, mode=mode, mode_label=report.MODE_LABEL[mode], splits=kind,
                copy_gbs=bandwidth, budget_s=args.budget_s, notes=runner.notes, records=records)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.json')}")
    if cut:
        return 130
    return 0 if all(math.isfinite(r["gpu_us"]) for r in records) else 1


def _measure(runner, target, rows, entries, mode):
    """One collective's record at ``rows`` (measured; ``derive`` adds the rest): the
    plan's configuration (its table entry, else the heuristic's) and the runner's GPU
    µs per step, the stock path's too on real ranks."""
    config = bench.config_for(target, rows, entries)
    record = {"rows": rows, "collective": target.collective, "ctas": config.ctas,
              "threads": config.threads, "unroll": config.unroll,
              "plan": "table" if rows in entries else "default"}
    figures = runner.gather(target, rows, config)
    record["gpu_us"] = figures["gpu_us"]
    if mode != report.EMULATED:
        record["stock_gpu_us"] = figures["stock_gpu_us"]
    return record
