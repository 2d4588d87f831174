"""Issue 40's Done-when, on this machine: for each fault the issue lists, start an engine
twice on 2 gloo CPU ranks (the real install path, install_logits_gather; the kernel a
CPU stand-in, first-use tuning's timing a collective cost model: tests/helpers.py) and
print what each start served on every rank and the lines it logged.

    python scripts/heal-demo.py            # every fault
    python scripts/heal-demo.py cut line   # the faults named

Each start is the test suite's (tests/test_autotune.py ``_start``): fresh processes, the
user table in a temporary cache directory.
"""

import os
import pathlib
import stat
import sys
import tempfile

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import test_autotune as t  # noqa: E402  (tests/ on the path first)


def show(label, results, root):
    """One start: per rank what it served and measured; the lines rank 0 logged (and rank
    1's where they differ), each cut at 240 characters."""
    print(f"  {label}:")
    for rank, r in enumerate(results):
        print(f"    rank {rank}: served rows {_span(r['served'])}; measured rows "
              f"{r['rows'] or 'none'} ({r['timed']} trials); a 1-row call went to "
              f"{'the Lamport gather' if r['routed'] == [t.FAKE_BYTE] else 'stock'}")
    logs = [[_short(x, root) for x in r["log"]] for r in results]
    for rank, lines in enumerate(logs):
        if rank and lines == logs[0]:
            print(f"    rank {rank} logged the same {len(lines)} line(s)")
            continue
        print(f"    rank {rank} logged {len(lines)} line(s):")
        for line in lines:
            print(f"      | {line}")


def _short(line, root):
    line = line.replace(str(root), "$TMP")
    line = line.replace(", routed at SimpleNamespace.logits_processor; spin budget 10 s "
                        "(LAMPORT_HEAD_BUDGET_S), agreed by every rank; a give-up stops the "
                        "GPU context", " [...]")
    return line if len(line) <= 240 else line[:237] + "..."


def _span(rows):
    if not rows:
        return "none (stock)"
    return f"{rows[0]}-{rows[-1]}" if rows == list(range(rows[0], rows[-1] + 1)) else str(rows)


def twice(root, label, prepare=None, **kwargs):
    print(f"\n== {label}")
    if prepare is not None:
        prepare()
    show("start 1", t._start(root, **kwargs), root)
    show("start 2", t._start(root, **kwargs), root)


def fresh():
    return pathlib.Path(tempfile.mkdtemp(prefix="heal-"))


def cut_case(at):
    root = fresh()
    t._start(root)  # a whole table, measured and written
    path = root / "cache" / "head_gather.yaml"
    whole = path.read_bytes()
    n = at if isinstance(at, int) else whole.rindex(b"\n      16:") + 1

    def cut():
        path.write_bytes(whole[:n])

    twice(root, f"user table ({len(whole)} bytes) cut at {n} bytes"
          + (" (a line boundary: rows 1-8 left, valid YAML)" if not isinstance(at, int) else ""),
          cut)
    print(f"  set aside: {[p.name for p in path.parent.glob('head_gather.yaml.broken-*')]}")


def main(names):
    cases = {
        "cut": lambda: [cut_case(n) for n in (0, 1, 10, 366, 732, 1098, 1425)],
        "line": lambda: cut_case("line"),
        "mode": mode_case,
        "newer": newer_case,
        "readonly": readonly_case,
        "absurd": absurd_case,
        "named": named_case,
        "hostkey": lambda: twice(fresh(), "device_key fails on rank 1 in first-use tuning's "
                                 "host exchange", fail="hostkey@1"),
        "clock": lambda: twice(fresh(), "rank 1's clock runs 1000 s a read ahead (rank 0's "
                               "broadcast decides when to stop)", fail="clock@1", timeout_s=20),
        "negview": negview_case,
        "versions": versions_case,
    }
    for name in names or cases:
        cases[name]()


def mode_case():
    root = fresh()
    old = os.umask(0o022)
    try:
        twice(root, "durable write under umask 022 (the table's mode)")
    finally:
        os.umask(old)
    path = root / "cache" / "head_gather.yaml"
    print(f"  {path.name}: mode {oct(stat.S_IMODE(path.stat().st_mode))}, first line: "
          f"{path.read_text().splitlines()[0][:60]}...")


def newer_case():
    root = fresh()
    path = root / "cache" / "head_gather.yaml"

    def write():
        path.parent.mkdir(parents=True)
        path.write_text("schema: 2\ndevices:\n  NVIDIA H200:\n    - tp: 2\n      vocab: 128\n"
                        "      provenance: {gpu: NVIDIA H200, fabric: nvl72}\n      rows:\n"
                        "        1: {ctas: 8, enabled: true, warp_split: 2}\n")

    twice(root, "a user table from a newer lamport-head (schema 2, a new row knob, a new "
          "provenance key)", write)


def readonly_case():
    root = fresh()
    (root / "blocked").write_text("")
    twice(root, "a cache directory that cannot be written (its parent is a file: "
          "NotADirectoryError; running as root, a read-only mode would not stop the write)",
          cache=str(root / "blocked" / "cache"))


ABSURD = ("schema: 1\ndevices:\n  NVIDIA H200:\n"
          "    - {tp: 4096, vocab: 128, rows: {1: {ctas: 8, enabled: true}}}\n"
          "    - {tp: 2, vocab: 1000000000000000000000000000000, rows: {1: {ctas: 8, enabled: true}}}\n"
          "    - {tp: 2, vocab: 129, rows: {1: {ctas: 8, enabled: true}}}\n"
          "    - {tp: 2, vocab: 128, rows: {1: {ctas: 0, enabled: true}, 2000: {ctas: 8, "
          "enabled: true}}}\n")


def absurd_case():
    root = fresh()
    path = root / "cache" / "head_gather.yaml"

    def write():
        path.parent.mkdir(parents=True)
        path.write_text(ABSURD)

    twice(root, "absurd values in a hand-written user table (tp 4096, vocab 10^30, vocab not "
          "a multiple of tp, ctas 0 and rows 2000)", write)


def named_case():
    root = fresh()
    t._start(root)
    named = root / "named.yaml"
    named.write_bytes((root / "cache" / "head_gather.yaml").read_bytes()[:500])
    twice(root, "LAMPORT_HEAD_TABLE names a torn file (the user table below it is whole)",
          env={"LAMPORT_HEAD_TABLE": str(named)})
    print(f"  {named.name} still there, {named.stat().st_size} bytes (never moved)")


def versions_case():
    root = fresh()
    other = dict(t.FACTS, torch="2.14.0", lamport_head="0.4.0")
    print("\n== two environments (torch 2.13.0 / lamport-head 0.1.0, torch 2.14.0 / 0.4.0) "
          "sharing one user table, started in turn")
    for n, (name, facts) in enumerate([("A", t.FACTS), ("B", other)] * 2):
        show(f"start {n + 1} (environment {name})", t._start(root, facts=facts), root)


def negview_case():
    import test_install
    from spawn import spawn

    root = fresh()
    table = root / "t.yaml"
    table.write_text(test_install.TABLE)
    print("\n== a torch._neg_view tensor through the installed gather (stand-in kernel copies "
          "its input's storage)")
    for rank, r in enumerate(spawn(test_install._neg_view_worker, 2, root, str(table))):
        print(f"    rank {rank}: served {r['served']}, first values gathered "
              f"{r['out'][0][:4]} (the engine holds {r['want'][0][:4]})")


if __name__ == "__main__":
    main(sys.argv[1:])
