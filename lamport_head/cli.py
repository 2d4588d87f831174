"""lamport-head: tune, show, verify and benchmark the Lamport logits gather.

Errors are one line on stderr and exit status 2, never a traceback, for what a user
can get wrong (no GPU, bad arguments, a malformed table). This is an entry point at
the top of the import graph, beside the engine adapters: it reaches the tuner
(``lamport_head.tuning``) lazily, and nothing in the runtime imports it.
"""

import argparse
import os
import random
import shutil
import sys

from lamport_head import __version__
from lamport_head.config import SWEEP_THREADS, SWEEP_UNROLL
from lamport_head import dtypes
from lamport_head.dtypes import NAMES as DTYPES
from lamport_head.dtypes import fragment
from lamport_head.kernels.protocol import THREADS, UNROLL_MAX
from lamport_head.settings import BENCH_BUDGET_S
from lamport_head.table import (ALL_TO_ALL_STOCK, KIMI_K2_VOCAB, MAX_ROWS,
                                TableError, fill, fix_for, load_table, mailbox_cost, normalize,
                                row_span)
from lamport_head.benches.lmhead import KIMI_K2_HIDDEN  # no torch: every command's parser needs it


def _rows(text):
    try:
        rows = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"rows must be comma-separated ints, got {text!r}") from None
    if not rows or rows[0] < 1:
        raise argparse.ArgumentTypeError(f"rows must be positive, got {text!r}")
    if rows[-1] > MAX_ROWS:  # refused up front, not after a sweep whose table can't load
        raise argparse.ArgumentTypeError(f"rows {rows[-1]} exceed the limit of {MAX_ROWS} rows: "
                                         f"{mailbox_cost(rows[-1])}")
    return rows


def _ints(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _margin(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"margin must be a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"margin must be in [0, 1), got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2): the message, then where to get help."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.HelpFormatter):
    """Plain-text help that states each option's default, unless its help already
    says it or there is none to state (a flag, an optional path)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        value = action.default
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        return f"{text} (default: {value})"


# bench --drafter's defaults (here: --help imports no torch)
DRAFT_VOCAB = 32000  # a typical EAGLE3 draft head (Llama 3's EAGLE3 drafters)
DRAFT_TOKENS = 3  # k: a usual num_speculative_tokens
SPLITS = ("even", "uneven")  # bench --all-to-all's --splits (tuning.a2abench.SPLITS)

_ROWS_HELP = "comma-separated row counts M (the decode batch: requests x (1 + draft tokens))"
_DTYPE_HELP = ("the logits' dtype (float32: an engine's FP32 lm_head, vLLM's head_dtype float32 "
               "or SGLang's --enable-fp32-lm-head); V/TP must be a multiple of 8 BF16 or 4 FP32")


def parser():
    fmt = _Help
    p = _Parser(prog="lamport-head", description=__doc__.splitlines()[0].split(": ", 1)[1],
                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("tune", help="Optuna sweep that fills the HEAD_GATHER table",
                       description="Measure the gather per row count and write the fastest "
                       "plan into a table; on real ranks (torchrun) against the stock all-gather, "
                       "which decides each row's enabled flag. Emulated (--emulate, one GPU): the "
                       "gather alone, no stock figure (a one-GPU cat is no all-gather), written "
                       "emulated: true, never served.", formatter_class=fmt)
    t.add_argument("--tp", type=_positive, default=8, help="tensor-parallel ranks (TP)")
    t.add_argument("--dcp", type=_positive, default=1,
                   help="decode context-parallel size (DCP); must divide --tp")
    t.add_argument("--rows", type=_rows, default=_rows("1,2,4,8,16,32,64"), help=_ROWS_HELP)
    t.add_argument("--vocab", type=_positive, default=KIMI_K2_VOCAB,
                   help="vocabulary size V (Kimi K2's); V/TP must be a multiple of 8")
    t.add_argument("--dtype", choices=DTYPES, default=dtypes.DEFAULT,
                   help=_DTYPE_HELP + "; the section is written for it")
    t.add_argument("--emulate", action="store_true", help="TP virtual ranks on one GPU")
    t.add_argument("--all-to-all", action="store_true",
                   help="tune the all-to-all of vocab shards instead (vLLM's batch-sharded "
                   "sampling, all_to_all_vocab_shards): rows are a step's total M, split over "
                   "the ranks as vLLM's batch sharding splits them (uneven, ranks of 0 rows), "
                   "against all_to_all_single; written as the section of stock "
                   "nccl-all-to-all; real ranks only (torchrun)")
    t.add_argument("--auto", action="store_true",
                   help="use every GPU here: torchrun over several, --emulate on one")
    t.add_argument("--storage", help="Optuna storage URL (default: SQLite beside --out)")
    t.add_argument("--trials", type=_positive, default=40, help="trials per row count")
    t.add_argument("--margin", type=_margin, default=0.05,
                   help="a row is enabled only when the gather beats stock by this fraction")
    t.add_argument("--threads", type=_ints, default=list(SWEEP_THREADS),
                   help="comma-separated threads per CTA to try")
    t.add_argument("--unroll", type=_ints, default=list(SWEEP_UNROLL),
                   help="comma-separated fragments in flight per thread to try")
    t.add_argument("--out", help="table to merge into (default: the user table, "
                   "$LAMPORT_HEAD_CACHE/head_gather.yaml or ~/.cache/lamport-head/head_gather.yaml)")
    t.add_argument("--plot", help="write a PNG of latency against rows (on real ranks also "
                   "the speedup over stock; emulated: the gather's latency alone)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("show", help="print the resolved table entries", formatter_class=fmt,
                       description="Print the table entries serving would use (each row "
                       "count's configuration and whether it is served), per table section.")
    s.add_argument("--device", help="GPU model, case-insensitive; a unique part of a name "
                   "is enough (default: this machine's GPU)")
    s.add_argument("--tp", type=_positive, help="only sections for this TP (default: every TP)")
    s.add_argument("--dcp", type=_positive, default=1, help="DCP of the sections shown")
    s.add_argument("--table", help="one table file (default: the layers serving reads: packaged "
                   "< user table < $LAMPORT_HEAD_TABLE)")
    s.add_argument("--emulated", action="store_true", help="show emulated sections")

    v = sub.add_parser("verify", help="bitwise check of the gather on this GPU (emulated ranks; "
                                      "under torchrun: real ranks, free-running)",
                       description="Check the gather bitwise against the reference on this GPU: "
                       "--calls gathers of planted data at random row counts of --rows, on TP "
                       "virtual ranks (one process), or under torchrun on real ranks (one per "
                       "process, free-running; torchrun's ranks are the TP), then that every "
                       "mailbox word is re-armed.", formatter_class=fmt)
    v.add_argument("--tp", type=_positive, default=8, help="tensor-parallel ranks (TP)")
    v.add_argument("--vocab", type=_positive, default=KIMI_K2_VOCAB, help="vocabulary size V")
    v.add_argument("--dtype", choices=DTYPES, default=dtypes.DEFAULT, help=_DTYPE_HELP)
    v.add_argument("--rows", type=_rows, default=_rows("1,2,3,7,8,16,33,64"), help=_ROWS_HELP)
    v.add_argument("--calls", type=_positive, default=200, help="gathers to check")

    b = sub.add_parser(
        "bench", help="the gather per row count: GPU time vs the HBM floor, the lm_head "
        "and the overlap behind it, host cost", formatter_class=fmt,
        description="Measure the gather per row count, in one run: GPU time per step against "
        "the HBM floor (bytes every rank moves over the copy bandwidth measured in the same run), "
        "the default plan against the table's, the lm_head shard GEMM of the same shape and the "
        "gather's visible cost behind it with PDL on and off, host time per eager call against "
        "torch.add_, and what a captured gather costs. One process: TP virtual ranks on this "
        "GPU (emulated; says nothing about NVLink, and has no stock figure). Under torchrun: "
        "real ranks, also against the stock path (NCCL all-gather + reorder, vLLM's). "
        "--all-to-all: the all-to-all of vocab shards beside the all-gather instead; "
        "--drafter: every logits gather of a speculative decode step instead.")
    b.add_argument("--tp", type=_positive, default=8, help="tensor-parallel ranks (TP)")
    b.add_argument("--dcp", type=_positive, default=1, help="DCP of the table section used")
    b.add_argument("--vocab", type=_positive, default=KIMI_K2_VOCAB, help="vocabulary size V")
    b.add_argument("--dtype", choices=DTYPES, default=dtypes.DEFAULT,
                   help=_DTYPE_HELP + "; the table's section for it is benchmarked")
    b.add_argument("--hidden", type=_positive, default=KIMI_K2_HIDDEN,
                   help="lm_head input width (Kimi K2's hidden size): the GEMM before the gather "
                   "is [M, hidden] x [hidden, V/TP]")
    b.add_argument("--rows", type=_rows, default=_rows("1,2,4,8,16,32,64"), help=_ROWS_HELP)
    b.add_argument("--table", help="table whose plan is benchmarked (default: the layers "
                   "serving reads)")
    b.add_argument("--budget-s", type=_seconds, default=BENCH_BUDGET_S,
                   help="spin budget of the benchmarked gathers, seconds: a wait that runs out "
                   "makes that figure n/a instead of stalling the run")
    b.add_argument("--out", default="results/bench", help="path prefix of the CSV and JSON "
                   "(the CSV is rewritten after every row count)")
    b.add_argument("--plot", help="write a PNG (its title names the mode: emulated or real ranks)")
    b.add_argument("--drafter", action="store_true",
                   help="every logits gather of a speculative decode step instead, per M "
                   "requests: the target's [M x (1 + k), V/TP], a draft head's [M, V_draft/TP] "
                   "and the candidate gather (vLLM's get_top_tokens, fp32 [M, 2] a rank, "
                   "packed), each against the HBM floor (emulated) or NCCL (torchrun), and the "
                   "step's totals (target + k x draft, target + k x candidates); writes "
                   "OUT-drafter.csv and .json")
    b.add_argument("--draft-vocab", type=_positive, default=DRAFT_VOCAB,
                   help="the draft head's vocabulary V_draft (an EAGLE3 head's); V_draft/TP "
                   "must be a multiple of 8 (with --drafter)")
    b.add_argument("--draft-tokens", type=_positive, default=DRAFT_TOKENS,
                   help="draft tokens k per step (with --drafter)")
    b.add_argument("--all-to-all", action="store_true",
                   help="the all-to-all of vocab shards instead (vLLM's all_to_all_vocab_shards, "
                   "batch-sharded sampling: [M, V/TP] -> [splits[rank], V]), per M beside the "
                   "all-gather of the same M in the same run: each against its HBM floor "
                   "(emulated) or its NCCL path (torchrun: all_to_all_single + vLLM's permute; "
                   "all-gather + reorder); writes OUT-all-to-all.csv and .json")
    b.add_argument("--splits", choices=SPLITS,
                   help="how the all-to-all splits M over the ranks (with --all-to-all; default: "
                   "even, vLLM's round robin of one-row requests); uneven: drawn from M and TP "
                   "alone, the same every run, empty ranks included")
    return p


def _plan_text(plan):
    """A plan as the table writes its entries: ``1: ctas=20,threads=256,unroll=4; ...``."""
    return "; ".join(f"{m}: {c.label()}" for m, c in sorted(plan.items()))


def _fail(message, code=2):
    print(f"lamport-head: {message}", file=sys.stderr)
    return code


def _need_cuda(command):
    import torch  # lazy: --help and show must not pay torch's import

    if not torch.cuda.is_available():
        return _fail(f"{command}: no CUDA GPU on this machine; it measures the gather on GPUs "
                     "(use `lamport-head show` to read tables here)")
    return 0


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        sys.stderr.close()
        return 0


def _main(argv=None):
    args = parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])  # for provenance
    tp, dcp = getattr(args, "tp", None), getattr(args, "dcp", None)
    if tp is not None and dcp is not None and tp % dcp:
        return _fail(f"{args.command}: --dcp {dcp} does not divide --tp {tp}")
    try:
        if args.command == "show":
            return show(args)
        problem = check_arguments(args)  # a wrong argument is wrong on any machine
        if problem:
            return _fail(f"{args.command}: {problem}")
        code = _need_cuda(args.command)
        if code:
            return code
        if args.command == "tune":
            if args.auto:
                return auto_tune(args, argv)
            from lamport_head.tuning.tune import run  # lazy: the tuner

            return run(args)
        if args.command == "bench":
            if args.drafter:
                from lamport_head.benches.draftbench import run  # lazy: the tuner
            elif args.all_to_all:
                from lamport_head.benches.a2abench import run  # lazy: the tuner
            else:
                from lamport_head.benches.bench import run  # lazy: the tuner

            return run(args)
        if args.command == "verify":
            return verify(args)
    except TableError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted (finished trials are kept in the study storage)", 130)
    return 0


def check_arguments(args):
    """What is wrong with a GPU command's arguments, in one line (None: nothing), checked
    before anything looks for a GPU. ``tune --auto`` without ``--tp`` takes the GPUs'
    count as TP later (checked then); ``verify`` under torchrun takes torchrun's."""
    command = args.command
    if command == "tune":
        for t in args.threads:
            if t not in THREADS:
                return f"--threads {t} is not one of {', '.join(map(str, THREADS))}"
        for u in args.unroll:
            if not 1 <= u <= UNROLL_MAX:
                return f"--unroll {u} is not in 1-{UNROLL_MAX}"
        if args.all_to_all and args.emulate:
            return "--all-to-all is timed on real ranks only (torchrun): no --emulate"
    tp_given = not (command == "tune" and args.auto and "--tp" not in args.argv
                    and not any(a.startswith("--tp=") for a in args.argv))
    if command == "verify" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        tp_given = False
    if command == "bench" and args.tp < 2:
        return "--tp must be at least 2 (one rank has nothing to gather)"
    values = fragment(getattr(args, "dtype", dtypes.DEFAULT))  # a 16-byte fragment's
    if tp_given and (args.vocab % args.tp or (args.vocab // args.tp) % values):
        return f"vocab {args.vocab} / tp {args.tp} is not a multiple of {values}" + (
            "" if args.dtype == dtypes.DEFAULT else f" ({args.dtype})")
    if command == "bench" and args.splits is not None and not args.all_to_all:
        return f"--splits {args.splits} says how --all-to-all splits M: add --all-to-all"
    if command == "bench" and args.all_to_all:
        from lamport_head.benches.a2abench import check  # lazy: the tuner

        return check(args)
    if command == "bench" and args.drafter:
        from lamport_head.benches.draftbench import check  # lazy: the tuner

        return check(args)
    return None


def auto_tune(args, argv):
    import torch  # lazy: --help and show must not pay torch's import

    count = torch.cuda.device_count()
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--auto"]
    if count > 1 and "WORLD_SIZE" not in os.environ:
        rest = [a for a in rest if a != "--emulate"]
        if "--tp" not in rest:
            rest[1:1] = ["--tp", str(count)]
        torchrun = shutil.which("torchrun") or "torchrun"
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   NVSHMEM_DISABLE_NVLS="1")
        os.execvpe(torchrun, [torchrun, "--nproc-per-node", str(count), "-m", "lamport_head.cli",
                              *rest], env)
    args.emulate = True
    args.auto = False
    return main([*rest, "--emulate"]) if "--emulate" not in rest else main(rest)


def show(args):
    try:  # lenient: a skipped section or layer is one line saying what to do about it
        table = load_table(args.table, strict=False) if args.table else load_table()
    except TableError as exc:  # the one file asked for cannot be read whole
        return _fail(f"{exc}; {fix_for(args.table, 'file')}")
    for problem in table.problems:
        print("lamport-head: show: problem: " + (
            f"{problem.line}; {fix_for(args.table, problem.kind)}" if args.table
            else problem.line), file=sys.stderr)
    # a file asked for by name is being checked: its problems fail the check (serving's
    # layered view works around them: 0)
    code = 2 if args.table and table.problems else 0
    device = args.device
    known = sorted({s.device for s in table.sections}, key=normalize)
    if device is None:
        import torch  # lazy: torch, only to name this machine's GPU

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
    elif not any(normalize(k) == normalize(device) for k in known):
        parts = [k for k in known if normalize(device) in normalize(k)]
        if len(parts) > 1:
            return _fail(f"show: more than one GPU model matches {device!r}: {', '.join(parts)}")
        if not parts:
            return _fail(f"show: no GPU model in these tables matches --device {device!r}; "
                         f"{_what_exists(table.sections)}")
        device = parts[0]
    on_device = [s for s in table.sections
                 if device is None or normalize(s.device) == normalize(device)]
    dcp_given = any(a == "--dcp" or a.startswith("--dcp=") for a in getattr(args, "argv", []))
    for flag, value, pick in (
            ("--tp", args.tp, lambda s: s.tp == args.tp),
            ("--dcp", args.dcp if dcp_given else None,
             lambda s: s.dcp == args.dcp and args.tp in (None, s.tp))):
        if value is not None and not any(pick(s) for s in on_device):
            if flag == "--dcp" and args.tp is not None:
                flag, value = "--tp", f"{args.tp} and --dcp {args.dcp}"
            where = f" for {on_device[0].device}" if args.device and on_device else ""
            return _fail(f"show: no section{where} has {flag} {value}; "
                         f"{_what_exists(on_device if args.device else table.sections)}")
    sections = [s for s in on_device
                if (args.tp is None or s.tp == args.tp) and s.dcp == args.dcp
                and (args.emulated or not s.emulated)]
    print("table: " + " < ".join(table.layers))
    if not sections:
        what = f"{device or 'any GPU'}, tp={args.tp or 'any'}, dcp={args.dcp}"
        print(f"no {'' if args.emulated else 'serving '}entries for {what}: the stock gather is used")
        print(f"GPU models in these tables: {', '.join(known) or 'none'}"
              + ("" if args.emulated else " (--emulated also shows emulated sections)"))
        return code
    for s in sections:
        print(f"\n{s.device}  tp={s.tp} dcp={s.dcp}" + ("  (emulated: never served)" if s.emulated else ""))
        print(f"  from {s.source}")
        shard = f", {s.vocab // s.tp} a rank" if s.vocab % s.tp == 0 else ""
        print(f"  vocab V = {s.vocab}{shard}" + (
            "" if s.vocab_written else f" (not written in the section: taken as {KIMI_K2_VOCAB}, "
            "the tuner's default; served only to a model of that V)"))
        print(f"  {s.dtype} logits" + (
            "" if "dtype" in s.raw else " (not written in the section: BF16)")
            + "; served only to a head of that dtype")
        collective = "all-to-all" if s.stock == ALL_TO_ALL_STOCK else "gather"
        print(f"  measured against {s.stock}" + (
            "" if "stock" in s.raw else " (not written in the section: NCCL's all-gather)")
            + f"; served only where the route replaces that {collective}"
            + (" (rows: a step's total M)" if collective == "all-to-all" else ""))
        prov = s.provenance
        if prov:
            print(f"  measured {prov.get('date', '?')} on {prov.get('gpu', '?')}, "
                  f"commit {prov.get('commit', '?')}")
        # an emulated section: TP virtual ranks on one GPU, never served; its only
        # stand-in for the all-gather was a local cat, so no stock figure and no flag
        head = f"  {'rows':>9} {'ctas':>5} {'threads':>7} {'unroll':>6}"
        print(head + (f" {'gather µs':>10}" if s.emulated
                      else f" {'enabled':>7} {'lamport µs':>10} {'stock µs':>9}"))
        for key, row, entry, note in _show_rows(s):
            lam = entry.get("lamport_us", "")
            cells = f"  {key:>9} {row.ctas:>5} {row.config.threads:>7} {row.config.unroll:>6}"
            if s.emulated:
                print(f"{cells} {lam!s:>10}{note}")
            else:
                print(f"{cells} {('yes' if row.enabled else 'no'):>7} {lam!s:>10} "
                      f"{entry.get('stock_us', '')!s:>9}{note}")
        if not s.emulated:
            print(f"  rows above {max(s.rows)}: the stock {collective} (past the largest "
                  "measured row)"
                  + (f"; rows below {min(s.rows)} too" if min(s.rows) > 1 else ""))
    return code


def _what_exists(sections):
    """The sections there are, in one clause: 'sections: NVIDIA H200 tp=8 dcp=1 (emulated)'."""
    if not sections:
        return "these tables have no sections"
    names = sorted(sections, key=lambda s: (normalize(s.device), s.tp, s.dcp, s.emulated))
    return "sections: " + ", ".join(f"{s.device} tp={s.tp} dcp={s.dcp}"
                                    + (" (emulated)" if s.emulated else "") for s in names)


def _show_rows(section):
    """(key, row, entry, note) in row order (``row``: the ``TableRow`` serving reads;
    ``entry``: the row key's entry as written): the measured entries, and between them
    the rows serving fills in (entry ``{}``, a note naming the source)."""
    entries = fill(section.rows)
    measured = sorted((row_span(key), key, entry) for key, entry in section.raw["rows"].items())
    last = None
    for (lo, hi), key, entry in measured:
        if last is not None and lo > last + 1:
            gap = str(last + 1) if lo == last + 2 else f"{last + 1}-{lo - 1}"
            yield gap, entries[lo - 1], {}, f"  filled (not measured) from rows {lo}"
        yield str(key), entries[lo], entry, ""
        last = hi


def verify(args):
    import torch  # lazy: --help and show must not pay torch's import

    from lamport_head.tuning.support.emulate import EmulatedGather  # lazy: the tuner
    from lamport_head.tuning.support.reference import planted, reference_gather  # lazy: the tuner

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # real ranks: the free-running check
        from lamport_head.benches.diagnostics.ranks import main as ranks_main  # lazy: the tuner

        return ranks_main(["--calls", str(args.calls), "--vocab", str(args.vocab),
                           "--rows", ",".join(map(str, args.rows)), "--dtype", args.dtype])
    values = fragment(args.dtype)
    if args.vocab % args.tp or (args.vocab // args.tp) % values:
        return _fail(f"verify: vocab {args.vocab} / tp {args.tp} is not a multiple of {values}")
    device = torch.device("cuda", torch.cuda.current_device())
    shard = args.vocab // args.tp
    dtype = getattr(torch, args.dtype)
    gather = EmulatedGather.default(device, args.tp, shard, args.rows, dtype=dtype)
    rng = random.Random(0)
    for call in range(args.calls):
        rows = rng.choice(args.rows)
        data = planted(args.tp, rows, shard, device=device, dtype=dtype)
        shards = [data[r] for r in range(args.tp)]
        want = reference_gather(shards).view(torch.int32)
        for r, out in enumerate(gather(shards)):
            if not torch.equal(out.view(torch.int32), want):
                return _fail(f"verify: call {call}, rank {r}, rows {rows}: output differs", 1)
    gather.check()
    if not gather.armed():
        return _fail("verify: mailbox words left un-armed", 1)
    print(f"verify: {args.calls} emulated calls, tp={args.tp}, vocab={args.vocab}, "
          f"{args.dtype}, rows {args.rows}, plan {_plan_text(gather.plan)}: bitwise equal to "
          "the reference, mailbox armed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
