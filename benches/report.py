"""What ``lamport-head bench`` prints and writes: the measuring mode's label, the
per-row record's derived figures, the plain-text tables (units in every header) and
the CSV. Pure Python: it runs, and is tested, without a GPU.

Invariants: every figure a table shows is a CSV column of the same key; the
emulated mode has no stock column at all (its only stand-in for the all-gather would
be a local ``torch.cat``, which says nothing about an interconnect); the stock
columns, on real ranks, are NCCL's all-gather + reorder (vLLM's path). No time is
negative: the captured host figure, a difference of two medians, is clamped at the host
timer's resolution (``HOST_RESOLUTION_US``), and the table's caption says so.
"""

import csv
import math
import time
from dataclasses import dataclass

from .floor import floor_us, step_bytes

EMULATED, RANKS, SHARED = "emulated", "ranks", "shared"
MODE_LABEL = {
    EMULATED: "emulated: TP virtual ranks on one GPU, one stream each (no NVLink: says "
              "nothing about the interconnect)",
    RANKS: "real ranks: one GPU per rank (torchrun); stock = NCCL all-gather + reorder",
    SHARED: "processes sharing one GPU (time-sliced): correctness only, not performance",
}


# time.perf_counter times every host figure; a difference of two of its medians below
# its resolution (1 ns on Linux) says only "no more than the timer can tell apart"
HOST_RESOLUTION_US = time.get_clock_info("perf_counter").resolution * 1e6


def mode_of(emulated: bool, world: int) -> str:
    """The mode of a run: one process emulating, or torchrun's ranks (sharing a GPU or not)."""
    if world <= 1:
        return EMULATED
    return SHARED if emulated else RANKS


def title(gpu, tp, vocab, mode):
    """The plot's title and the table's first line: GPU, shape, and the mode, named."""
    short = {EMULATED: "emulated, TP virtual ranks on one GPU (no NVLink)",
             RANKS: "real ranks, one GPU each",
             SHARED: "processes sharing one GPU (not performance)"}
    return f"{gpu}, TP {tp}, V = {vocab}: {short[mode]}"


@dataclass(frozen=True)
class Column:
    key: str  # the record's key and the CSV column
    header: str  # the printed header, unit included
    digits: int = 2


PLAN = [Column("rows", "M rows", 0), Column("ctas", "CTAs", 0), Column("threads", "threads", 0),
        Column("unroll", "unroll", 0), Column("plan", "plan from", 0)]
GPU = [Column("gpu_us", "GPU µs/step"), Column("gpu_nopdl_us", "PDL off µs/step"),
       Column("floor_us", "HBM floor µs"), Column("floor_ratio", "÷ floor (x)"),
       Column("copy_us", "TP copies µs/step"), Column("copy_ratio", "÷ copies (x)"),
       Column("default_gpu_us", "default plan µs/step"),
       Column("default_vs_plan", "default ÷ plan (x)"),
       Column("captured_gpu_us", "captured GPU µs/step")]
OVERLAP = [Column("lm_head_us", "lm_head µs/step"),
           Column("lm_head_gather_pdl_us", "lm_head+gather PDL on µs"),
           Column("visible_pdl_us", "visible PDL on µs"),
           Column("visible_pdl_share", "visible ÷ standalone PDL on (x)"),
           Column("lm_head_gather_nopdl_us", "lm_head+gather PDL off µs"),
           Column("visible_nopdl_us", "visible PDL off µs"),
           Column("visible_nopdl_share", "visible ÷ standalone PDL off (x)")]
HOST = [Column("host_us", "host µs/eager call"), Column("add_us", "torch.add_ host µs"),
        Column("host_vs_add", "÷ add_ (x)"),
        Column("captured_host_us", "captured host µs/gather beyond launch")]
STOCK = [Column("eager_us", "eager µs/call"), Column("stock_eager_us", "NCCL eager µs/call"),
         Column("stock_gpu_us", "NCCL GPU µs/step"),
         Column("nccl_vs_gather", "NCCL GPU ÷ gather GPU (x)")]
KEY = [PLAN[0]]  # each table after the first starts with the row count


def tables(mode):
    """(caption, columns) of each printed table, in order, for ``mode``."""
    overlap = ("Overlap with the lm_head shard GEMM (the kernel before the gather on its "
               "stream); visible = (lm_head + gather) - lm_head")
    host = ("Host time: one eager call as vLLM makes it (measured inside the call); captured: "
            "what a gather adds to a graph replay (a difference of two medians, clamped at the "
            f"host timer's resolution, {HOST_RESOLUTION_US:g} µs: never negative)")
    out = [("GPU time per step (every rank on this GPU) against the HBM floor", PLAN + GPU),
           (overlap, KEY + OVERLAP), (host, KEY + HOST)]
    if mode != EMULATED:
        out.append(("Against the stock path, "
                    + ("NCCL all-gather + reorder (vLLM's)" if mode == RANKS else
                       "gloo all-gather + reorder (processes sharing a GPU: not performance)"),
                    KEY + STOCK))
    return out


def fields(mode):
    """The CSV columns of ``mode``, in table order, then the run's scalars."""
    keys = []
    for _, columns in tables(mode):
        keys += [c.key for c in columns if c.key not in keys]
    return ["tp", "vocab", "hidden"] + keys + ["copy_gbs", "step_bytes"]


def _ratio(a, b):
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def derive(record, *, tp, vocab, ranks_here, bandwidth_gbs, itemsize=2):
    """Add the derived figures to a row's measured ``record`` (in place; returned):
    the floor and ratios; visible = (lm_head + gather) - lm_head, over the standalone
    gather of the same launch kind; host over ``torch.add_`` (the record's own, timed
    in the same loop); the captured host figure clamped at the timer's resolution."""
    r = record
    nbytes = step_bytes(r["rows"], tp, vocab, ranks_here, itemsize)
    r["step_bytes"], r["copy_gbs"] = nbytes, bandwidth_gbs
    r["floor_us"] = floor_us(nbytes, bandwidth_gbs)
    r["floor_ratio"] = _ratio(r["gpu_us"], r["floor_us"])
    r["copy_ratio"] = _ratio(r["gpu_us"], r.get("copy_us", math.nan))
    r["default_vs_plan"] = _ratio(r["default_gpu_us"], r["gpu_us"])
    for pdl in ("pdl", "nopdl"):
        visible = r[f"lm_head_gather_{pdl}_us"] - r["lm_head_us"]
        r[f"visible_{pdl}_us"] = visible
        # over the standalone time of the same launch kind (PDL on or off)
        r[f"visible_{pdl}_share"] = _ratio(visible, r["gpu_us" if pdl == "pdl" else "gpu_nopdl_us"])
    r["host_vs_add"] = _ratio(r["host_us"], r["add_us"])
    if "captured_host_us" in r:
        r["captured_host_us"] = clamp_host_us(r["captured_host_us"])
    if "stock_gpu_us" in r:
        r["nccl_vs_gather"] = _ratio(r["stock_gpu_us"], r["gpu_us"])
    return r


def clamp_host_us(value):
    """A host-time difference, at least the host timer's resolution (NaN stays NaN): a
    captured gather's cost measured below it (noise: the difference of two medians
    can come out negative) reads as the resolution, never as a negative time."""
    return value if not math.isfinite(value) or value >= HOST_RESOLUTION_US else HOST_RESOLUTION_US


def _cell(value, digits):
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(caption, columns, records):
    """A plain-text table: the caption, a header line, one line per record."""
    cells = [[_cell(r.get(c.key, math.nan), c.digits) for c in columns] for r in records]
    widths = [max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = [caption, "  ".join(c.header.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return lines


def write_csv(path, mode, records, **scalars):
    """Every record as one CSV row with ``fields(mode)``; floats rounded to 4 places."""
    write_records(path, fields(mode), records, **scalars)


def write_records(path, keys, records, **scalars):
    """Every record (with ``scalars`` added) as one CSV row of the columns ``keys``; floats
    rounded to 4 places."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in records:
            row = dict(scalars, **r)
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
