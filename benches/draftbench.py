"""``lamport-head bench --drafter``: every logits gather of one speculative decode step.

Per M (the requests of a decode step) with ``k`` draft tokens (``step_gathers``):

- the target's verification gather, ``[M (1 + k), V/TP]`` BF16 (each request's draft
  tokens and its bonus token);
- per draft token, the draft model's logits gather, ``[M, V_draft/TP]`` BF16 (vLLM's
  EAGLE/MTP drafter ``compute_logits``, SGLang's draft worker; an EAGLE3 head is
  about 32000 wide);
- or, per draft token with vLLM's ``use_local_argmax_reduction``, the candidate
  gather of ``get_top_tokens``: fp32 ``[M, 2]`` (value, global index) per rank, which
  lamport-head moves packed as a BF16 shard of ``candidate_width()`` columns;

and the step's totals: target + k x draft gather, target + k x candidate gather.

Emulated (one process, TP virtual ranks on one GPU): each gather's GPU µs per step
against the HBM floor of its bytes (``floor``), and the candidate gather, whose bytes
are nothing, against a one-kernel torch op (``torch.add_`` on every rank's stream:
the launch-latency floor of a step). Under torchrun on real ranks: each gather
against NCCL's all-gather + reorder of the same shape (vLLM's stock path).

Invariant: the shapes are this module's alone (``step_gathers``); both runners time
exactly the ``Gather``s handed to them (``runner.gather(target, rows, config)`` on
``runner.target_for(vocab)``), so the emulated and the torchrun path measure the
same shapes. Measurements only go through the runner (``bench.make_runner``, the
seam CPU tests replace); what is printed is every CSV column (``COLUMNS``).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lamport_head import dtypes
from lamport_head.table import MAX_ROWS, NCCL_STOCK, load_table

from . import report
from .floor import floor_us, step_bytes
from ..tuning.targets import make_target

FRAGMENT = 8  # BF16 per 16-byte fragment: a shard's width is whole fragments
# get_top_tokens' payload per rank: (value, global index) as fp32, [M, 2]
CANDIDATE_COLS, CANDIDATE_DTYPE = 2, torch.float32
KEYS = ("target", "draft", "cand")  # the gathers of a step, in table order
LABEL = {"target": "target logits", "draft": "draft logits", "cand": "candidates"}


@dataclass(frozen=True)
class Gather:
    """One gather of a decode step: ``rows`` x ``width`` BF16 per rank."""

    key: str  # one of KEYS
    rows: int
    width: int  # BF16 columns per rank (the shard width)

    def vocab(self, tp):
        """The full width every rank receives: what a table section is keyed by."""
        return tp * self.width


def candidate_width():
    """(BF16 columns per rank of the packed candidate shard, a note or None).
    ``lamport_head.candidates.packed_width`` owns the packing; where that module is
    missing the width is computed here as it packs: fp32 ``[M, 2]`` is four 16-bit
    halves a row, each widened to a 32-bit word of its own (so no word is the gather's
    sentinel), 8 BF16, in whole 8-BF16 fragments (the note says so)."""
    try:
        from lamport_head import candidates
    except ModuleNotFoundError as exc:
        if exc.name != "lamport_head.candidates":
            raise
        halves = CANDIDATE_COLS * torch.empty((), dtype=CANDIDATE_DTYPE).element_size() // 2
        width = -(-2 * halves // FRAGMENT) * FRAGMENT
        return width, (f"lamport_head.candidates not found: the candidate shard taken as {width} "
                       f"BF16 a rank (fp32 [M, {CANDIDATE_COLS}]: {halves} halves, a word each)")
    return candidates.packed_width(CANDIDATE_COLS, CANDIDATE_DTYPE), None


def step_gathers(m, tp, vocab, draft_vocab, k, cand_width):
    """The gathers of a decode step of ``m`` requests with ``k`` draft tokens: the
    target's verification, then one draft token's logits gather and candidate gather."""
    return (Gather("target", m * (1 + k), vocab // tp), Gather("draft", m, draft_vocab // tp),
            Gather("cand", m, cand_width))


def shard_problem(flag, vocab, tp):
    """Why ``vocab`` does not split into ``tp`` shards of whole 8-BF16 fragments, naming
    the nearest vocabularies that do; None when it does."""
    if vocab % tp == 0 and (vocab // tp) % FRAGMENT == 0:
        return None
    step = tp * FRAGMENT
    below, above = vocab // step * step, -(-vocab // step) * step
    nearest = f"{below} or {above}" if below else str(above)
    return (f"{flag} {vocab} / tp {tp} is not a multiple of {FRAGMENT} BF16 per rank "
            f"(the nearest that are: {nearest})")


def check(args):
    """What is wrong with ``bench --drafter``'s own arguments (None: nothing)."""
    if getattr(args, "dtype", "bfloat16") != "bfloat16":
        return (f"--drafter times BF16 heads and packed BF16 candidates only, not --dtype "
                f"{args.dtype} (drop --drafter to bench an FP32 head's gather)")
    problem = shard_problem("--draft-vocab", args.draft_vocab, args.tp)
    if problem:
        return problem
    top = max(args.rows) * (1 + args.draft_tokens)
    if top > MAX_ROWS:
        return (f"the target's verification gathers M x (1 + --draft-tokens {args.draft_tokens})"
                f" = {top} rows at M = {max(args.rows)}, over the limit of {MAX_ROWS} rows")
    return None


@dataclass(frozen=True)
class Column:
    key: str  # the record's key and the CSV column
    header: str  # the printed header, unit included
    digits: int = 2


def columns(stock):
    """(caption, columns) of each printed table; ``stock``: real ranks (NCCL columns)."""
    per = [Column("rows", "M requests", 0), Column("target_rows", "target rows", 0)]
    for key in KEYS:
        per.append(Column(f"{key}_us", f"{LABEL[key]} µs"))
        per.append(Column(f"{key}_floor_ratio", "÷ floor (x)"))
        if stock:
            per.append(Column(f"{key}_nccl_us", "NCCL µs"))
            per.append(Column(f"{key}_nccl_ratio", "NCCL ÷ ours (x)"))
    per.append(Column("op_us", "torch op µs"))
    per.append(Column("cand_op_ratio", "candidates ÷ torch op (x)"))
    step = [Column("rows", "M requests", 0), Column("step_draft_us", "target + k x draft µs"),
            Column("step_cand_us", "target + k x candidates µs")]
    if stock:
        step += [Column("step_draft_nccl_us", "NCCL target + k x draft µs"),
                 Column("step_draft_nccl_ratio", "NCCL ÷ ours (x)"),
                 Column("step_cand_nccl_us", "NCCL target + k x candidates µs"),
                 Column("step_cand_nccl_ratio", "NCCL ÷ ours (x)")]
    against = ("NCCL all-gather + reorder of the same shape (vLLM's stock)" if stock else
               "the HBM floor of its bytes; candidates also against one torch.add_ per rank")
    where = "MAX over the ranks" if stock else "every virtual rank on this GPU"
    return [(f"GPU µs per gather (one row per M; {where}), against {against}", per),
            ("GPU µs per decode step: the target's gather plus k draft gathers, of logits or "
             "of candidates", step)]


def fields(stock):
    """The CSV columns: the run's scalars, every printed column, each gather's shape and
    floor, the copy bandwidth."""
    keys = ["tp", "vocab", "draft_vocab", "draft_tokens", "cand_width"]
    for _, cols in columns(stock):
        keys += [c.key for c in cols]
    keys += [f"{k}_{what}" for k in KEYS for what in ("rows", "width", "floor_us")]
    return list(dict.fromkeys(keys + ["copy_gbs"]))


def _ratio(a, b):
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def derive(record, gathers, *, tp, k, ranks_here, bandwidth_gbs):
    """Add the floors, ratios and step totals to ``record`` (measured: ``{key}_us``,
    ``{key}_nccl_us`` on real ranks, ``op_us``), in place; returned."""
    r = record
    for g in gathers:
        r[f"{g.key}_rows"], r[f"{g.key}_width"] = g.rows, g.width
        r[f"{g.key}_floor_us"] = floor_us(step_bytes(g.rows, tp, g.vocab(tp), ranks_here),
                                          bandwidth_gbs)
        r[f"{g.key}_floor_ratio"] = _ratio(r[f"{g.key}_us"], r[f"{g.key}_floor_us"])
        if f"{g.key}_nccl_us" in r:
            r[f"{g.key}_nccl_ratio"] = _ratio(r[f"{g.key}_nccl_us"], r[f"{g.key}_us"])
    r["cand_op_ratio"] = _ratio(r["cand_us"], r["op_us"])
    r["copy_gbs"] = bandwidth_gbs
    for key in ("draft", "cand"):
        r[f"step_{key}_us"] = r["target_us"] + k * r[f"{key}_us"]
        if f"{key}_nccl_us" in r:
            r[f"step_{key}_nccl_us"] = r["target_nccl_us"] + k * r[f"{key}_nccl_us"]
            r[f"step_{key}_nccl_ratio"] = _ratio(r[f"step_{key}_nccl_us"], r[f"step_{key}_us"])
    return r


def format_tables(records, stock):
    out = []
    for caption, cols in columns(stock):
        out += [""] + report.format_table(caption, cols, records)
    return out


def write_csv(path, records, stock, **scalars):
    report.write_records(path, fields(stock), records, **scalars)


def run(args):
    """``lamport-head bench --drafter``; the exit status (1: a figure not measured)."""
    from .bench import _say, config_for, make_runner

    chosen = make_target("bench", args.tp, args.vocab)
    root, tp, k = chosen.root, chosen.target.tp, args.draft_tokens
    mode = report.mode_of(chosen.emulated, chosen.world)
    stock = mode != report.EMULATED
    name = torch.cuda.get_device_name(chosen.device)
    cand, note = candidate_width()
    runner = make_runner(chosen, args)
    if note:
        runner.notes.append(note)
    table = load_table(args.table)
    vocabs = {"target": args.vocab, "draft": args.draft_vocab, "cand": tp * cand}
    targets = {key: runner.target_for(v) for key, v in vocabs.items()}
    entries = {key: table.entries(name, tp, args.dcp, emulated=chosen.emulated, vocab=v,
                                  stock=NCCL_STOCK,  # its gathers' sections
                                  dtype=dtypes.BFLOAT16)  # the drafter bench is BF16 only
               for key, v in vocabs.items()}
    ranks_here = tp if chosen.emulated else 1
    bandwidth = runner.bandwidth_gbs()
    op = runner.op_us()
    _say(root, f"lamport-head bench --drafter: {report.title(name, tp, args.vocab, mode)}",
         f"  mode: {report.MODE_LABEL[mode]}",
         f"  per M requests, k = {k} draft tokens: target [M x {1 + k}, {args.vocab // tp}], "
         f"draft [M, {args.draft_vocab // tp}] (V_draft = {args.draft_vocab}), candidates "
         f"[M, {cand}] BF16 a rank (get_top_tokens' fp32 [M, {CANDIDATE_COLS}], packed); "
         f"device-to-device copy {bandwidth:.0f} GB/s")
    records = []
    out = Path(f"{args.out}-drafter")
    if root:
        out.parent.mkdir(parents=True, exist_ok=True)
    scalars = dict(tp=tp, vocab=args.vocab, draft_vocab=args.draft_vocab, draft_tokens=k,
                   cand_width=cand)
    for m in args.rows:
        gathers = step_gathers(m, tp, args.vocab, args.draft_vocab, k, cand)
        record = {"rows": m, "target_rows": gathers[0].rows, "op_us": op}
        for g in gathers:
            target = targets[g.key]
            figures = runner.gather(target, g.rows, config_for(target, g.rows, entries[g.key]))
            record[f"{g.key}_us"] = figures["gpu_us"]
            if stock:
                record[f"{g.key}_nccl_us"] = figures["stock_gpu_us"]
        derive(record, gathers, tp=tp, k=k, ranks_here=ranks_here, bandwidth_gbs=bandwidth)
        records.append(record)
        if root:
            write_csv(out.with_suffix(".csv"), records, stock, **scalars)
        _say(root, f"  M={m}: step {record['step_draft_us']:.2f} µs with draft logits, "
             f"{record['step_cand_us']:.2f} µs with candidates")
    if not root:
        return 0
    print("\n".join(format_tables(records, stock)))
    for line in runner.notes:
        print(f"note: {line}")
    meta = dict(scalars, gpu=name, mode=mode, mode_label=report.MODE_LABEL[mode],
                copy_gbs=bandwidth, op_us=op, notes=runner.notes, records=records)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.json')}")
    measured = [r[f"{key}_us"] for r in records for key in KEYS]
    return 0 if all(math.isfinite(x) for x in measured) else 1
