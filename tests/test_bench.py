"""``lamport-head bench`` without a GPU: the floor's byte count, the tables and CSV
(units in every header, every printed figure a CSV column), no stock or single-cat
figure in the emulated mode, NCCL's columns on real ranks, the plot's title naming
the mode, the targets' verdicts, a run cut short keeping its rows, and the CLI; the
same of ``bench --drafter`` and ``bench --all-to-all`` (its floor, its splits, its
records beside the all-gather's). The measurements are a fake runner
(``bench.make_runner`` is the seam)."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
from lamport_head.benches import bench, benchplot, goals, report
from lamport_head.benches.floor import floor_us, step_bytes
from lamport_head.tuning.targets import Chosen

from lamport_head import cli

V = 163840
BANDWIDTH = 4000.0  # GB/s the fake runner "measures"


class FakeTarget:
    def __init__(self, tp, vocab=V):
        self.tp, self.shard_width = tp, vocab // tp

    def limit(self, threads, unroll):
        return 16


class FakeRunner:
    """Figures as simple functions of the row count; ``fail_at``: raise there."""

    def __init__(self, mode, fail_at=None, interrupt_at=None):
        self.mode, self.fail_at, self.pdl, self.notes = mode, fail_at, True, []
        self.interrupt_at = interrupt_at
        self.stock_asked = 0
        self.captured_host_us = {}  # rows -> the figure measured (default 0.5)

    def bandwidth_gbs(self):
        return BANDWIDTH

    def row(self, rows, config, default):
        if rows == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends
        if rows == self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        gpu = 2.0 + rows
        out = {"gpu_us": gpu, "gpu_nopdl_us": gpu + 1, "default_gpu_us": gpu * 1.02,
               "captured_gpu_us": gpu * 0.9, "copy_us": gpu / 1.25, "lm_head_us": 50.0 + rows,
               "lm_head_gather_pdl_us": 50.0 + rows + 0.4 * gpu,
               "lm_head_gather_nopdl_us": 50.0 + rows + 0.9 * (gpu + 1),
               "host_us": 8.0, "add_us": 10.0,
               "captured_host_us": self.captured_host_us.get(rows, 0.5)}
        if self.mode != report.EMULATED:
            self.stock_asked += 1
            out.update(eager_us=gpu + 5, stock_eager_us=30.0, stock_gpu_us=20.0)
        return out


def _fake(monkeypatch, mode=report.EMULATED, tp=8, fail_at=None, interrupt_at=None):
    """The bench on a machine that claims one H200; ``mode``'s target and runner."""
    runner = _on_one_h200(monkeypatch, bench, FakeRunner(mode, fail_at, interrupt_at), mode, tp)
    titles = []
    real = benchplot.plot_bench
    monkeypatch.setattr(benchplot, "plot_bench", lambda *a: titles.append(real(*a)) or titles[-1])
    return runner, titles


def _on_one_h200(monkeypatch, module, runner, mode, tp):
    """``module``'s target (``mode``'s, TP ``tp``) and ``runner`` on a machine that
    claims one H200; returns ``runner``."""
    world = 1 if mode == report.EMULATED else tp
    chosen = Chosen(FakeTarget(tp), torch.device("cpu"), world, True, mode != report.RANKS)
    monkeypatch.setattr(module, "make_target", lambda command, tp, vocab, dtype="bfloat16": chosen)
    monkeypatch.setattr(bench, "make_runner", lambda chosen, args: runner)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    return runner


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _bench(tmp_path, *extra):
    empty = tmp_path / "empty.yaml"
    empty.write_text("schema: 1\ndevices: {}\n")
    return cli.main(["bench", "--rows", "1,8,64", "--table", str(empty),
                     "--out", str(tmp_path / "b"), *extra])


def test_floor_counts_every_byte_the_protocol_moves():
    # per rank: shard 1 + pushes TP-1 + own box TP-1 + output TP + re-arm TP-1 shards
    shard = 20480 * 2  # one row of V/8 BF16
    assert step_bytes(1, 8, V, 1) == shard * (1 + 7 + 7 + 8 + 7)
    # 8 virtual ranks on one GPU: M x V x 2 B x (4 - 2/TP) per rank, all of them
    assert step_bytes(1, 8, V, 8) == 8 * V * 2 * (4 - 2 / 8) == 9_830_400
    assert step_bytes(8, 2, V, 1) == 8 * V * 2 * (4 - 2 / 2)
    assert step_bytes(64, 8, V, 8) == 64 * step_bytes(1, 8, V, 8)
    assert floor_us(9_830_400, 4000.0) == pytest.approx(2.4576)


def test_emulated_tables_csv_and_json(tmp_path, monkeypatch, capsys):
    _, titles = _fake(monkeypatch)
    assert _bench(tmp_path, "--plot", str(tmp_path / "b.png")) == 0
    printed = capsys.readouterr().out
    rows = _csv(tmp_path / "b.csv")
    assert list(rows[0]) == report.fields(report.EMULATED)
    assert [int(r["rows"]) for r in rows] == [1, 8, 64]
    r8 = {k: float(v) for k, v in rows[1].items() if k != "plan"}
    assert r8["floor_us"] == pytest.approx(8 * 9_830_400 / (BANDWIDTH * 1e9) * 1e6, rel=1e-3)
    assert r8["floor_ratio"] == pytest.approx(r8["gpu_us"] / r8["floor_us"], rel=1e-3)
    assert r8["copy_ratio"] == pytest.approx(1.25, rel=1e-3)  # gpu_us over the TP copies'
    assert r8["visible_pdl_us"] == pytest.approx(0.4 * 10, rel=1e-3)
    assert r8["visible_pdl_share"] == pytest.approx(0.4, rel=1e-3)
    assert r8["visible_nopdl_share"] == pytest.approx(0.9, rel=1e-3)  # over PDL-off standalone
    assert r8["host_vs_add"] == pytest.approx(0.8) and r8["captured_host_us"] == 0.5
    assert r8["default_vs_plan"] == pytest.approx(1.02, rel=1e-3)
    assert rows[1]["plan"] == "default"
    # every printed table: a caption, a header with units, one line per row count
    for caption, columns in report.tables(report.EMULATED):
        header = "  ".join(c.header for c in columns)
        assert caption in printed
        assert any(line.split() == header.split() for line in printed.splitlines()), header
    assert "emulated: TP virtual ranks on one GPU" in printed and "NVLink" in printed
    meta = json.loads((tmp_path / "b.json").read_text())
    assert meta["mode"] == "emulated" and meta["copy_gbs"] == BANDWIDTH
    assert titles == ["NVIDIA H200, TP 8, V = 163840: emulated, TP virtual ranks on one GPU (no NVLink)"]
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_an_fp32_bench_asks_for_fp32_benchmarks_the_fp32_section_and_counts_4_bytes(
        tmp_path, monkeypatch, capsys):
    """``bench --dtype float32``: the target is made for FP32 logits, the plan is the
    table's float32 section (a BF16 section of the same key is not it), and the HBM
    floor counts 4 bytes a value (twice BF16's). V/TP need only be whole 4-FP32
    fragments (163840 / 8 = 20480)."""
    asked = []
    _fake(monkeypatch)
    chosen = bench.make_target("bench", 8, V)
    monkeypatch.setattr(bench, "make_target", lambda command, tp, vocab, dtype="bfloat16": (
        asked.append(dtype), chosen)[1])
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, rows: {8: {ctas: 5, enabled: false}}}\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, dtype: float32,\n"
                     "       rows: {8: {ctas: 7, enabled: false}}}\n")
    assert cli.main(["bench", "--rows", "1,8", "--table", str(table), "--dtype", "float32",
                     "--out", str(tmp_path / "b")]) == 0
    assert asked == ["float32"]
    rows = _csv(tmp_path / "b.csv")
    assert [(r["plan"], int(r["ctas"])) for r in rows][1] == ("table", 7)  # not BF16's 5
    assert float(rows[1]["step_bytes"]) == 2 * step_bytes(8, 8, V, 8)
    assert "into float32" in capsys.readouterr().out


def test_the_gather_bench_reads_the_gathers_section_beside_an_all_to_alls(
        tmp_path, monkeypatch):
    """A table holding the all-to-all's section at the gather's key (same GPU, TP, V,
    dtype): plain ``bench`` serves the section measured against NCCL's all-gather."""
    _fake(monkeypatch)
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, stock: nccl-all-to-all,\n"
                     "       rows: {8: {ctas: 7, enabled: false}}}\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, rows: {8: {ctas: 5, enabled: false}}}\n")
    assert cli.main(["bench", "--rows", "1,8", "--table", str(table),
                     "--out", str(tmp_path / "b")]) == 0
    assert [(r["plan"], int(r["ctas"])) for r in _csv(tmp_path / "b.csv")][1] == ("table", 5)


def test_a_negative_captured_host_time_is_clamped_at_the_timers_resolution(
        tmp_path, monkeypatch, capsys):
    """TP 2 M = 2 measured -0.78 µs (a difference of two medians, noise): the bench
    writes and prints the host timer's resolution instead, and its caption says so."""
    runner, _ = _fake(monkeypatch)
    runner.captured_host_us = {1: -0.7812, 8: math.nan}
    assert _bench(tmp_path) == 0
    printed = capsys.readouterr().out
    rows = _csv(tmp_path / "b.csv")
    got = [float(r["captured_host_us"]) for r in rows]
    assert got[0] == pytest.approx(report.HOST_RESOLUTION_US) and 0 < got[0] < 0.01
    assert math.isnan(got[1]) and got[2] == 0.5  # n/a stays n/a; a real figure stays
    assert all(not (float(v) < 0) for r in rows for k, v in r.items()
               if k.endswith("_us"))  # no negative time anywhere in the CSV
    assert f"clamped at the host timer's resolution, {report.HOST_RESOLUTION_US:g} µs" in printed
    meta = json.loads((tmp_path / "b.json").read_text())
    assert meta["records"][0]["captured_host_us"] == report.HOST_RESOLUTION_US


def test_emulated_has_no_baseline_figure(tmp_path, monkeypatch, capsys):
    runner, _ = _fake(monkeypatch)
    assert _bench(tmp_path) == 0
    printed = capsys.readouterr().out.lower().replace(str(tmp_path).lower(), "")
    header = (tmp_path / "b.csv").read_text().splitlines()[0].lower().split(",")
    for column in header:
        for word in ("stock", "cat", "speedup", "nccl", "eager"):
            assert word not in column, column
    assert "torch.cat" not in printed and "speedup" not in printed and "stock" not in printed
    assert runner.stock_asked == 0


def test_real_ranks_add_nccl_columns(tmp_path, monkeypatch, capsys):
    _, titles = _fake(monkeypatch, report.RANKS)
    assert _bench(tmp_path, "--plot", str(tmp_path / "b.png")) == 0
    printed = capsys.readouterr().out
    rows = _csv(tmp_path / "b.csv")
    assert list(rows[0]) == report.fields(report.RANKS)
    assert float(rows[0]["nccl_vs_gather"]) == pytest.approx(20.0 / 3.0, rel=1e-3)
    r1_floor = float(rows[0]["floor_us"])  # one rank's bytes per GPU on real ranks
    assert r1_floor == pytest.approx(step_bytes(1, 8, V, 1) / (BANDWIDTH * 1e9) * 1e6, rel=1e-3)
    assert "NCCL all-gather + reorder (vLLM's)" in printed
    assert titles == ["NVIDIA H200, TP 8, V = 163840: real ranks, one GPU each"]


def test_processes_sharing_a_gpu_say_so(tmp_path, monkeypatch, capsys):
    _, titles = _fake(monkeypatch, report.SHARED, tp=2)
    assert _bench(tmp_path, "--plot", str(tmp_path / "b.png")) == 0
    printed = capsys.readouterr().out
    assert "not performance" in printed
    assert titles == ["NVIDIA H200, TP 2, V = 163840: processes sharing one GPU (not performance)"]


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    _fake(monkeypatch, fail_at=64)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _bench(tmp_path)
    rows = _csv(tmp_path / "b.csv")
    assert [int(r["rows"]) for r in rows] == [1, 8]


def test_a_terminated_run_reports_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    _, titles = _fake(monkeypatch, interrupt_at=64)
    previous = signal.getsignal(signal.SIGTERM)
    assert _bench(tmp_path, "--plot", str(tmp_path / "b.png")) == 130
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is put back
    printed = capsys.readouterr().out
    assert "interrupted after 2 of 3 row counts: reporting those" in printed
    meta = json.loads((tmp_path / "b.json").read_text())
    assert [r["rows"] for r in meta["records"]] == [1, 8] and len(titles) == 1
    assert "GPU time / HBM floor at M=8" in printed


def test_every_figure_column_states_its_unit():
    for mode in (report.EMULATED, report.RANKS):
        for _, columns in report.tables(mode):
            for c in columns:
                if c.key.endswith("_us"):
                    assert "µs" in c.header, c
                elif c.digits:  # a ratio
                    assert "(x)" in c.header, c


def test_verdicts_name_each_target_and_its_outcome():
    def record(rows, gpu, floor_ratio=1.0, plan="table"):
        return {"rows": rows, "gpu_us": gpu, "floor_ratio": floor_ratio, "host_vs_add": 1.2,
                "captured_host_us": 0.4, "visible_pdl_share": math.nan, "default_vs_plan": 1.01,
                "plan": plan}

    lines = goals.verdicts([record(1, 4.0), record(8, 30.0, 1.35)], tp=8)
    assert "  GPU µs per step at M=1: 4.00 (target <= 4.5): met" in lines
    assert "  GPU time / HBM floor at M=8: 1.35 (target <= 1.3): MISSED" in lines
    copies = goals.verdicts([{**record(2, 4.0), "copy_ratio": 1.4}, {**record(8, 9.0), "copy_ratio": 1.1}], tp=8)
    assert "  GPU time / TP plain copies at M=2: 1.40 (target <= 1.3): MISSED" in copies
    assert not any("plain copies at M=8" in line for line in copies)  # up to M = 4
    assert "  host per call / torch.add_ at M=1: 1.20 (target <= 1.0): MISSED" in lines
    assert "  visible / standalone, PDL on at M=1: not measured" in lines
    assert not any("HBM floor at M=1" in line for line in lines)  # floor from M = 8
    assert "  default plan / table's plan at M=8: 1.01 (target <= 1.05): met" in lines
    # a row benchmarked on the default plan has nothing to compare it with
    assert not any("default plan" in line for line in goals.verdicts([record(1, 4.0, plan="default")], 8))
    assert "  GPU µs per step at M=1: 4.00 (target <= 3.5): MISSED" in goals.verdicts(
        [record(1, 4.0)], tp=2)


class _CpuEmuTarget:
    """An emulated target on the CPU: each build a stand-in gather of its PDL, verified."""

    dtype, collective = torch.bfloat16, "all-gather"

    def build(self, plan, pdl=None):
        return types.SimpleNamespace(pdl=pdl, streams=[None, None])

    def verify(self, emu, rows, calls=3):
        return True


def test_an_lm_head_gather_run_that_cannot_run_emulated_is_skipped_and_the_rest_kept(monkeypatch):
    from lamport_head.config import GatherConfig
    from lamport_head.status import GatherTimeout
    from lamport_head.benches import emubench

    # an EmulatedRunner (TP 2, tiny shapes) whose only GPU work is stubbed: every timing
    # is 1 µs, but the lm_head GEMM then the gather with PDL on gives up, as on one H100
    runner = object.__new__(emubench.EmulatedRunner)
    runner.target, runner.hidden, runner.budget_s = _CpuEmuTarget(), 8, 1.0
    runner.device, runner.tp, runner.shard_width = torch.device("cpu"), 2, 4
    runner.steps, runner.reps, runner.calls, runner.pdl = 2, 1, 1, True
    runner.streams, runner.notes = [None, None], []
    timeout = GatherTimeout(1, [0], 144)

    def rank_steps(n, streams, device, emu=None, shards=None, heads=None):
        if emu is not None and heads is not None and emu.pdl is None:
            raise timeout

    monkeypatch.setattr(emubench, "rank_steps", rank_steps)
    runner._gated = lambda emu, run: run(1) or 1.0
    runner._host = lambda emu, shards: (8.0, 10.0)
    runner._captured = lambda emu, shards: (2.0, 0.5)
    runner.copies_us = lambda rows: 1.5
    config = GatherConfig(ctas=24)

    row = runner.row(1, config, config)

    for kept in ("gpu_us", "gpu_nopdl_us", "default_gpu_us", "host_us", "add_us",
                 "captured_gpu_us", "captured_host_us", "lm_head_us", "lm_head_gather_nopdl_us"):
        assert math.isfinite(row[kept]), kept
    assert math.isnan(row["lm_head_gather_pdl_us"])
    assert row["skipped"] == {"lm_head_gather_pdl_us": "cannot run emulated"}
    assert runner.notes == [
        f"M=1 {config.label()} pdl=arch: the lm_head GEMM then the gather cannot run emulated "
        "here, skipped: a virtual rank's spinning gather holds the SMs another's GEMM needs "
        f"(real ranks each have their own GPU) ({timeout})"]
    assert not any("later figures NaN" in note for note in runner.notes)
    record = report.derive({"rows": 1, "plan": "default", **row}, tp=2, vocab=8, ranks_here=2,
                           bandwidth_gbs=BANDWIDTH)
    lines = goals.verdicts([record], tp=8)
    assert "  visible / standalone, PDL on at M=1: skipped (cannot run emulated)" in lines
    assert "  host per call / torch.add_ at M=1: 0.80 (target <= 1.0): met" in lines


def test_bench_help_names_the_modes_and_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "emulated; says nothing about NVLink" in text
    assert "NCCL all-gather + reorder" in text and "HBM floor" in text
    assert "(default: 7168)" in text and "(default: 0.5)" in text and "(default: 8)" in text
    assert "cat" not in text.replace("captured", "").replace("comma", "")


@pytest.mark.parametrize("argv,message", [
    (("--tp", "1"), "lamport-head: bench: --tp must be at least 2"),
    (("--tp", "3"), "lamport-head: bench: vocab 163840 / tp 3 is not a multiple of 8"),
    (("--budget-s", "0"), "lamport-head bench: argument --budget-s: expected a positive number"),
    (("--dtype", "float32", "--vocab", "1004", "--tp", "2"),
     "lamport-head: bench: vocab 1004 / tp 2 is not a multiple of 4 (float32)"),
    (("--dtype", "float16"), "lamport-head bench: argument --dtype: invalid choice"),
    (("--dtype", "float32", "--drafter"), "lamport-head: bench: --drafter times BF16 heads"),
])
def test_bench_refuses_bad_arguments_on_any_machine(argv, message):
    _refused(argv, message)


def _refused(argv, message):
    """``lamport-head bench ARGV`` exits 2 with one line starting ``message``, before
    anything needs a GPU."""
    p = subprocess.run([sys.executable, "-m", "lamport_head.cli", "bench", *argv],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(message), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def _docs_csv(name):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return _csv(root / "docs" / name), " ".join((root / "docs" / "figures.md").read_text().split())


@pytest.mark.parametrize("name", ["bench-emulated-tp8.csv", "bench-emulated-tp2.csv"])
def test_docs_bench_csvs_hold_no_negative_time(name):
    rows, _ = _docs_csv(name)
    for r in rows:
        for key, value in r.items():
            if key.endswith("_us"):
                assert not float(value) < 0, (name, r["rows"], key, value)


def test_figures_doc_states_the_figures_of_the_plotted_bench_runs():
    """docs/figures.md reads its figures from the CSVs the plots draw, naming the plan."""
    tp8, readme = _docs_csv("bench-emulated-tp8.csv")
    tp2, _ = _docs_csv("bench-emulated-tp2.csv")
    m1 = tp8[0]
    assert m1["plan"] == "table"
    assert ("emulated TP 8 on the packaged table's plan" in readme
            and f"{float(m1['gpu_us']):.2f} µs per step at M = 1 (the default plan, timed in the "
                f"same run: {float(m1['default_gpu_us']):.2f})" in readme)
    ratios = [float(r["floor_ratio"]) for r in tp8 if int(r["rows"]) >= 4]
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x the floor from M = 4" in readme
    assert {r["plan"] for r in tp2} == {"default"}
    ratios = [float(r["floor_ratio"]) for r in tp2 if int(r["rows"]) >= 16]
    assert (f"TP 2 on the default plan (no table section; staged at M = 64): "
            f"{float(tp2[0]['gpu_us']):.2f} µs at M = 1, {min(ratios):.2f}-{max(ratios):.2f}x the "
            f"floor from M = 16 ({float(tp2[3]['floor_ratio']):.2f}x at M = 8)") in readme
    host = [float(r["host_us"]) for r in tp8 + tp2]
    vs_add = [float(r["host_vs_add"]) for r in tp8 + tp2]
    captured = max(float(r["captured_host_us"]) for r in tp8 + tp2)
    assert f"host {min(host):.1f}-{max(host):.1f} µs per eager call" in readme
    assert f"{min(vs_add):.2f}-{max(vs_add):.2f}x `torch.add_`" in readme
    assert f"at most {captured:.2f} µs per captured gather" in readme


# ---- bench --drafter (issue 32 item 6) ------------------------------------------------

from lamport_head.benches import draftbench, rankbench  # noqa: E402
from lamport_head.tuning.harness import DistributedTarget, Timing  # noqa: E402

DRAFT_V, K = 32000, 3


def _drafter_figures(rows, shard):
    """The fake GPU µs of one gather: a function of its shape alone (any mode)."""
    return 1.0 + rows * shard / 1000.0


class FakeDrafterRunner(FakeRunner):
    """``FakeRunner`` with the drafter's measurements; ``timed``: (rows, width) asked."""

    def __init__(self, mode, tp):
        super().__init__(mode)
        self.tp, self.timed = tp, []

    def target_for(self, vocab):
        return FakeTarget(self.tp, vocab)

    def gather(self, target, rows, config):
        self.timed.append((rows, target.shard_width))
        out = {"gpu_us": _drafter_figures(rows, target.shard_width)}
        if self.mode != report.EMULATED:
            out["stock_gpu_us"] = 20.0 + rows
        return out

    def op_us(self):
        return 2.0


def _fake_drafter(monkeypatch, mode=report.EMULATED, tp=8):
    runner = FakeDrafterRunner(mode, tp)
    world = 1 if mode == report.EMULATED else tp
    chosen = Chosen(FakeTarget(tp), torch.device("cpu"), world, True, mode != report.RANKS)
    monkeypatch.setattr(draftbench, "make_target", lambda command, tp, vocab, dtype="bfloat16": chosen)
    monkeypatch.setattr(bench, "make_runner", lambda chosen, args: runner)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    return runner


def _expected_shapes(rows, tp, k=K, vocab=V, draft=DRAFT_V):
    return [(g.rows, g.width) for m in rows
            for g in draftbench.step_gathers(m, tp, vocab, draft, k, 8)]


def test_drafter_arguments_and_their_defaults():
    args = cli.parser().parse_args(["bench", "--drafter"])
    assert args.drafter and args.draft_vocab == 32000 and args.draft_tokens == 3
    args = cli.parser().parse_args(["bench", "--drafter", "--draft-vocab", "151936",
                                    "--draft-tokens", "5", "--tp", "2"])
    assert (args.draft_vocab, args.draft_tokens, args.tp) == (151936, 5, 2)
    assert not cli.parser().parse_args(["bench"]).drafter


def test_drafter_help_states_its_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--drafter" in text and "get_top_tokens" in text
    assert "(default: 32000)" in text and "(default: 3)" in text


@pytest.mark.parametrize("argv,message", [
    (("--drafter", "--draft-vocab", "32001"),
     "lamport-head: bench: --draft-vocab 32001 / tp 8 is not a multiple of 8 BF16 per rank "
     "(the nearest that are: 32000 or 32064)"),
    (("--drafter", "--tp", "3", "--vocab", "163920"),
     "lamport-head: bench: --draft-vocab 32000 / tp 3 is not a multiple of 8 BF16 per rank "
     "(the nearest that are: 31992 or 32016)"),
    (("--drafter", "--draft-vocab", "40"),
     "lamport-head: bench: --draft-vocab 40 / tp 8 is not a multiple of 8 BF16 per rank "
     "(the nearest that are: 64)"),
    (("--drafter", "--rows", "1,512"),
     "lamport-head: bench: the target's verification gathers M x (1 + --draft-tokens 3) = 2048 "
     "rows at M = 512, over the limit of 1024 rows"),
    (("--drafter", "--draft-tokens", "0"),
     "lamport-head bench: argument --draft-tokens: expected a positive int"),
])
def test_drafter_refuses_bad_arguments_on_any_machine(argv, message):
    _refused(argv, message)


def test_drafter_shapes_of_a_decode_step():
    target, draft, cand = draftbench.step_gathers(4, 8, V, DRAFT_V, 3, 8)
    assert (target.key, target.rows, target.width) == ("target", 16, 20480)  # M x (1 + k)
    assert (draft.key, draft.rows, draft.width) == ("draft", 4, 4000)
    assert (cand.key, cand.rows, cand.width) == ("cand", 4, 8)
    assert draft.vocab(8) == DRAFT_V and cand.vocab(8) == 64
    assert draftbench.step_gathers(1, 2, V, DRAFT_V, 1, 8)[1].width == 16000


def test_candidate_width_is_the_packed_fp32_pair(monkeypatch):
    """get_top_tokens' fp32 [M, 2] moves as 8 BF16 a rank: candidates.packed_width's
    answer, and the same where that module is not there yet (with a note)."""
    import lamport_head

    width, note = draftbench.candidate_width()
    assert (width, note) == (8, None)
    monkeypatch.setitem(sys.modules, "lamport_head.candidates", None)
    monkeypatch.delattr(lamport_head, "candidates", raising=False)
    width, note = draftbench.candidate_width()
    assert width == 8 and "lamport_head.candidates not found" in note


def test_drafter_emulated_table_from_fake_figures(tmp_path, monkeypatch, capsys):
    runner = _fake_drafter(monkeypatch)
    assert _bench(tmp_path, "--drafter") == 0
    printed = capsys.readouterr().out
    assert runner.timed == _expected_shapes([1, 8, 64], 8)
    rows = _csv(tmp_path / "b-drafter.csv")
    assert list(rows[0]) == draftbench.fields(False)
    assert [int(r["rows"]) for r in rows] == [1, 8, 64]
    r8 = {k: float(v) for k, v in rows[1].items()}
    target, draft, cand = (_drafter_figures(32, 20480), _drafter_figures(8, 4000),
                           _drafter_figures(8, 8))
    assert r8["target_rows"] == 32 and r8["target_us"] == pytest.approx(target, rel=1e-4)
    assert r8["draft_us"] == pytest.approx(draft) and r8["cand_us"] == pytest.approx(cand)
    assert r8["step_draft_us"] == pytest.approx(target + K * draft, rel=1e-4)
    assert r8["step_cand_us"] == pytest.approx(target + K * cand, rel=1e-4)
    floor = floor_us(step_bytes(8, 8, DRAFT_V, 8), BANDWIDTH)  # 8 virtual ranks on one GPU
    assert r8["draft_floor_us"] == pytest.approx(floor, rel=1e-3)
    assert r8["draft_floor_ratio"] == pytest.approx(draft / floor, rel=1e-3)
    assert r8["cand_op_ratio"] == pytest.approx(cand / 2.0, rel=1e-3)
    for caption, columns in draftbench.columns(False):
        header = "  ".join(c.header for c in columns)
        assert caption in printed
        assert any(line.split() == header.split() for line in printed.splitlines()), header
        lines = printed.splitlines()
        at = lines.index(caption)
        assert [line.split()[0] for line in lines[at + 2:at + 5]] == ["1", "8", "64"]
    assert "nccl" not in (tmp_path / "b-drafter.csv").read_text().lower()
    meta = json.loads((tmp_path / "b-drafter.json").read_text())
    assert meta["mode"] == "emulated" and meta["draft_vocab"] == DRAFT_V
    assert meta["cand_width"] == 8 and meta["draft_tokens"] == K


def test_drafter_every_column_states_its_unit():
    for stock in (False, True):
        for _, columns in draftbench.columns(stock):
            for c in columns:
                if c.key.endswith("_us"):
                    assert "µs" in c.header, c
                elif c.digits:
                    assert "(x)" in c.header, c


def test_drafter_on_real_ranks_adds_nccl_per_gather_and_step(tmp_path, monkeypatch, capsys):
    runner = _fake_drafter(monkeypatch, report.RANKS, tp=2)
    assert _bench(tmp_path, "--drafter", "--tp", "2", "--draft-tokens", "2") == 0
    printed = capsys.readouterr().out
    assert runner.timed == _expected_shapes([1, 8, 64], 2, k=2)
    rows = _csv(tmp_path / "b-drafter.csv")
    assert list(rows[0]) == draftbench.fields(True)
    r1 = {k: float(v) for k, v in rows[0].items()}
    ours = r1["target_us"] + 2 * r1["draft_us"]
    # NCCL's fake figure is 20 + rows: the target's 1 x (1 + 2) rows, each draft's 1
    assert r1["target_nccl_us"] == 23.0 and r1["step_draft_nccl_us"] == 23.0 + 2 * 21.0
    assert r1["step_draft_nccl_ratio"] == pytest.approx(65.0 / ours, rel=1e-3)
    assert r1["cand_nccl_ratio"] == pytest.approx(21.0 / r1["cand_us"], rel=1e-3)
    assert "NCCL all-gather + reorder of the same shape" in printed


def test_drafter_torchrun_path_times_the_same_shapes(tmp_path, monkeypatch, capsys):
    """The real RanksRunner under a fake torchrun (one process here, its collectives
    the identity): it builds a DistributedTarget per shard width on the same ranks and
    times our gather and the stock path of exactly the shapes the emulated path gets."""

    ranks = types.SimpleNamespace(group=None, device=torch.device("cpu"), world=2, rank=0,
                                  shared=False)
    timed, stocked = [], []
    monkeypatch.setattr(DistributedTarget, "limit", lambda self, t, u: 16)
    monkeypatch.setattr(DistributedTarget, "lamport", lambda self, rows, config, pdl=None: (
        timed.append((rows, self.shard_width, self.ranks is ranks, self.budget_s))
        or Timing(9.0, 3.0, 1.0, 3.0, 1.0)))
    monkeypatch.setattr(DistributedTarget, "stock", lambda self, rows: (
        stocked.append((rows, self.shard_width)) or Timing(30.0, 20.0, 5.0)))
    chosen = Chosen(DistributedTarget(ranks, V), ranks.device, 2, True, False)
    monkeypatch.setattr(draftbench, "make_target", lambda command, tp, vocab, dtype="bfloat16": chosen)
    from lamport_head import build

    monkeypatch.setattr(build, "TOOLCHAIN", types.SimpleNamespace(arch=lambda d: 90,
                                                                pdl=lambda a: True))
    monkeypatch.setattr(rankbench, "copy_bandwidth_gbs", lambda device: BANDWIDTH)
    monkeypatch.setattr(rankbench, "median_eager", lambda *a: (2.0, 1.0))
    monkeypatch.setattr(rankbench, "agree", lambda *a: None)
    monkeypatch.setattr(rankbench, "all_max", lambda value, *a: value)
    monkeypatch.setattr(rankbench, "all_min", lambda value, *a: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert _bench(tmp_path, "--drafter", "--tp", "2", "--budget-s", "0.25") == 0
    shapes = _expected_shapes([1, 8, 64], 2)
    assert [(r, s) for r, s, _, _ in timed] == shapes and stocked == shapes
    assert all(same and budget == 0.25 for _, _, same, budget in timed)
    fake = _fake_drafter(monkeypatch, report.EMULATED, tp=2)  # the emulated path's shapes
    capsys.readouterr()
    assert _bench(tmp_path, "--drafter", "--tp", "2") == 0
    assert fake.timed == shapes


# ---- bench --all-to-all (issue 43 item 5) -------------------------------------------

from lamport_head.all_to_all import even_splits  # noqa: E402
from lamport_head.benches import a2abench  # noqa: E402
from lamport_head.benches.floor import all_to_all_bytes  # noqa: E402
from lamport_head.tuning.harness import ALL_GATHER, ALL_TO_ALL  # noqa: E402
from lamport_head.tuning.support.splits import vllm_splits  # noqa: E402


class FakeCollectiveTarget(FakeTarget):
    """A fake target of one collective (``splits``: the all-to-all's, a function of M)."""

    def __init__(self, tp, collective, splits=None, vocab=V):
        super().__init__(tp, vocab)
        self.collective, self.splits = collective, splits


def _a2a_figures(collective, rows):
    """The fake GPU µs of one collective at ``rows`` (any mode), and its stock's."""
    return (2.0 + rows, 20.0 + rows) if collective == ALL_GATHER else (3.0 + 2 * rows, 25.0 + rows)


class FakeAllToAllRunner(FakeRunner):
    """``FakeRunner`` with the all-to-all bench's measurements; ``timed``: (collective,
    M, shard, splits or None, CTAs) of every collective timed, in order."""

    def __init__(self, mode, tp, interrupt_at=None):
        super().__init__(mode, interrupt_at=interrupt_at)
        self.tp, self.timed = tp, []

    def target_for(self, vocab):
        return FakeCollectiveTarget(self.tp, ALL_GATHER, vocab=vocab)

    def all_to_all_target(self, splits):
        return FakeCollectiveTarget(self.tp, ALL_TO_ALL, splits)

    def gather(self, target, rows, config):
        if rows == self.interrupt_at and target.collective == ALL_TO_ALL:
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends, mid-M
        self.timed.append((target.collective, rows, target.shard_width,
                           target.splits(rows) if target.splits else None, config.ctas))
        gpu, stock = _a2a_figures(target.collective, rows)
        return {"gpu_us": gpu, **({} if self.mode == report.EMULATED else {"stock_gpu_us": stock})}


def _fake_a2a(monkeypatch, mode=report.EMULATED, tp=8, interrupt_at=None):
    return _on_one_h200(monkeypatch, a2abench, FakeAllToAllRunner(mode, tp, interrupt_at),
                        mode, tp)


def test_the_all_to_alls_floor_is_the_bytes_each_rank_sends_and_receives():
    """Rank r reads its [M, V/TP] shard and writes its [splits[r], V]: on one GPU hosting
    every rank that is 2 M V bytes a value whatever the splits; on real ranks the
    busiest rank's."""
    shard = V // 4
    assert all_to_all_bytes([3, 0, 1, 0], V, 1) == (4 * shard + 3 * V) * 2  # rank 0 receives most
    assert all_to_all_bytes([1, 1, 1, 1], V, 1) == (4 * shard + V) * 2 == 2 * 4 * V * 2 // 4
    for splits in ([3, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 4], [2, 1, 1, 0]):
        assert all_to_all_bytes(splits, V, 4) == sum(
            (4 * shard + n * V) * 2 for n in splits) == 2 * 4 * V * 2
    assert all_to_all_bytes([2, 1], V, 2, itemsize=4) == 2 * all_to_all_bytes([2, 1], V, 2)
    assert floor_us(all_to_all_bytes([8] * 8, V, 8), BANDWIDTH) == pytest.approx(
        2 * 64 * V * 2 / (BANDWIDTH * 1e9) * 1e6)
    with pytest.raises(ValueError, match="hosts 1 or every one of the 4 ranks"):
        all_to_all_bytes([1, 1, 1, 1], V, 2)


def test_uneven_splits_are_the_tuners_draw_of_vllms_batch_sharding():
    """``--splits uneven`` is ``vllm_splits`` (draw 0): what first-use tuning times,
    drawn from M and TP alone (its own tests: tests/test_all_to_all_tuning.py)."""
    assert a2abench.splits_for("even", 8)(10) == even_splits(10, 8)
    for tp in (2, 8):
        for m in (1, 10, 64):
            assert a2abench.splits_for("uneven", tp)(m) == vllm_splits(m, tp)


def test_all_to_all_emulated_tables_csv_and_json(tmp_path, monkeypatch, capsys):
    """Per M: the all-gather, then the all-to-all (even splits), each on its own target,
    against its own floor; the all-to-all over the all-gather of the same M; one CSV
    record per M and collective, named; no stock column; a table per collective."""
    runner = _fake_a2a(monkeypatch)
    assert _bench(tmp_path, "--all-to-all") == 0
    printed = capsys.readouterr().out
    shard = V // 8
    assert [x[:4] for x in runner.timed] == [x for m in (1, 8, 64) for x in (
        (ALL_GATHER, m, shard, None), (ALL_TO_ALL, m, shard, even_splits(m, 8)))]
    rows = _csv(tmp_path / "b-all-to-all.csv")
    assert list(rows[0]) == a2abench.fields(report.EMULATED)
    assert [(int(r["rows"]), r["collective"]) for r in rows] == [
        (m, c) for m in (1, 8, 64) for c in ("all-gather", "all-to-all")]
    gather8, a2a8 = ({k: v for k, v in r.items()} for r in rows[2:4])
    assert gather8["splits"] == "" and a2a8["splits"] == "1/1/1/1/1/1/1/1"
    assert float(gather8["step_bytes"]) == step_bytes(8, 8, V, 8)  # the gather's protocol bytes
    assert float(a2a8["step_bytes"]) == 2 * 8 * V * 2  # every rank's bytes sent + received
    for r, c in ((gather8, ALL_GATHER), (a2a8, ALL_TO_ALL)):
        gpu = _a2a_figures(c, 8)[0]
        assert float(r["gpu_us"]) == gpu and r["plan"] == "default" and r["tp"] == "8"
        floor = float(r["step_bytes"]) / (BANDWIDTH * 1e9) * 1e6
        assert float(r["floor_us"]) == pytest.approx(floor, rel=1e-3)
        assert float(r["floor_ratio"]) == pytest.approx(gpu / floor, rel=1e-3)
    assert float(a2a8["vs_all_gather"]) == pytest.approx(19.0 / 10.0)
    assert gather8["vs_all_gather"] == ""  # the all-gather's own record has none
    header = (tmp_path / "b-all-to-all.csv").read_text().splitlines()[0].lower()
    assert "stock" not in header and "nccl" not in header
    lines = printed.splitlines()
    for caption, c, columns in a2abench.tables(report.EMULATED, "even"):
        at = lines.index(caption)
        assert lines[at + 1].split() == "  ".join(x.header for x in columns).split()
        assert [line.split()[0] for line in lines[at + 2:at + 5]] == ["1", "8", "64"]
    assert "all-to-all, [M, V/TP] -> [splits[rank], V] on each rank, splits even" in printed
    assert "stock" not in printed.lower().replace(str(tmp_path).lower(), "")
    meta = json.loads((tmp_path / "b-all-to-all.json").read_text())
    assert meta["mode"] == "emulated" and meta["splits"] == "even" and meta["copy_gbs"] == BANDWIDTH
    assert [(r["rows"], r["collective"]) for r in meta["records"]] == [
        (int(r["rows"]), r["collective"]) for r in rows]


def test_all_to_all_uneven_splits_reach_the_target_the_records_and_the_floor(
        tmp_path, monkeypatch):
    runner = _fake_a2a(monkeypatch, report.RANKS, tp=4)
    assert _bench(tmp_path, "--all-to-all", "--splits", "uneven", "--tp", "4") == 0
    timed = [(m, s) for c, m, _, s, _ in runner.timed if c == ALL_TO_ALL]
    assert timed == [(m, vllm_splits(m, 4)) for m in (1, 8, 64)]
    rows = [r for r in _csv(tmp_path / "b-all-to-all.csv") if r["collective"] == "all-to-all"]
    for r in rows:
        splits = vllm_splits(int(r["rows"]), 4)
        assert r["splits"] == "/".join(map(str, splits))
        # one rank per GPU: the busiest rank's bytes
        assert float(r["step_bytes"]) == all_to_all_bytes(splits, V, 1)
    meta = json.loads((tmp_path / "b-all-to-all.json").read_text())
    assert meta["splits"] == "uneven" and meta["mode"] == "ranks"


def test_all_to_all_on_real_ranks_adds_each_collectives_stock(tmp_path, monkeypatch, capsys):
    _fake_a2a(monkeypatch, report.RANKS, tp=2)
    assert _bench(tmp_path, "--all-to-all", "--tp", "2") == 0
    printed = capsys.readouterr().out
    rows = _csv(tmp_path / "b-all-to-all.csv")
    assert list(rows[0]) == a2abench.fields(report.RANKS)
    for r in rows:
        gpu, stock = _a2a_figures(r["collective"], int(r["rows"]))
        assert float(r["stock_gpu_us"]) == stock
        assert float(r["stock_ratio"]) == pytest.approx(stock / gpu, rel=1e-3)
    assert float(rows[0]["step_bytes"]) == step_bytes(1, 2, V, 1)  # one rank's, real ranks
    assert "and the stock path, NCCL all_to_all_single + permute (vLLM's)" in printed
    assert "and the stock path, NCCL all-gather + reorder (vLLM's)" in printed
    for caption, _, columns in a2abench.tables(report.RANKS, "even"):
        assert caption in printed
        assert any(line.split() == "  ".join(c.header for c in columns).split()
                   for line in printed.splitlines())


def test_all_to_all_processes_sharing_a_gpu_say_so(tmp_path, monkeypatch, capsys):
    _fake_a2a(monkeypatch, report.SHARED, tp=2)
    assert _bench(tmp_path, "--all-to-all", "--tp", "2") == 0
    printed = capsys.readouterr().out
    assert "gloo all_to_all_single + permute (processes sharing a GPU: not performance)" in printed
    rows = _csv(tmp_path / "b-all-to-all.csv")
    assert float(rows[1]["step_bytes"]) == 2 * 1 * V * 2  # every rank on the one GPU


def test_all_to_all_plans_come_from_each_collectives_own_section(tmp_path, monkeypatch):
    """The all-gather's plan is the section measured against NCCL's all-gather; the
    all-to-all's, the one measured against NCCL's all-to-all (same GPU, TP, V)."""
    runner = _fake_a2a(monkeypatch)
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, rows: {8: {ctas: 5, enabled: false}}}\n"
                     "    - {tp: 8, vocab: 163840, emulated: true, stock: nccl-all-to-all,\n"
                     "       rows: {8: {ctas: 7, enabled: false}}}\n")
    assert cli.main(["bench", "--all-to-all", "--rows", "8", "--table", str(table),
                     "--out", str(tmp_path / "b")]) == 0
    assert [(c, ctas) for c, _, _, _, ctas in runner.timed] == [(ALL_GATHER, 5), (ALL_TO_ALL, 7)]
    assert [r["plan"] for r in _csv(tmp_path / "b-all-to-all.csv")] == ["table", "table"]


def test_a_terminated_all_to_all_run_reports_the_row_counts_it_measured(
        tmp_path, monkeypatch, capsys):
    _fake_a2a(monkeypatch, interrupt_at=64)
    previous = signal.getsignal(signal.SIGTERM)
    assert _bench(tmp_path, "--all-to-all") == 130
    assert signal.getsignal(signal.SIGTERM) is previous
    assert "interrupted after 2 of 3 row counts: reporting those" in capsys.readouterr().out
    meta = json.loads((tmp_path / "b-all-to-all.json").read_text())
    assert [(r["rows"], r["collective"]) for r in meta["records"]] == [
        (1, ALL_GATHER), (1, ALL_TO_ALL), (8, ALL_GATHER), (8, ALL_TO_ALL)]


def test_all_to_all_every_column_states_its_unit_and_is_a_csv_column():
    for mode in (report.EMULATED, report.RANKS):
        for _, _, columns in a2abench.tables(mode, "even"):
            for c in columns:
                assert c.key in a2abench.fields(mode)
                if c.key.endswith("_us"):
                    assert "µs" in c.header, c
                elif c.digits:
                    assert "(x)" in c.header, c


def test_all_to_all_arguments_and_help(capsys):
    args = cli.parser().parse_args(["bench", "--all-to-all", "--splits", "uneven"])
    assert args.all_to_all and args.splits == "uneven"
    args = cli.parser().parse_args(["bench"])
    assert not args.all_to_all and args.splits is None
    assert cli.SPLITS == a2abench.SPLITS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--all-to-all" in text and "all_to_all_single + vLLM's permute" in text
    assert "default: even" in text


@pytest.mark.parametrize("argv,message", [
    (("--splits", "uneven"),
     "lamport-head: bench: --splits uneven says how --all-to-all splits M: add --all-to-all"),
    (("--all-to-all", "--drafter"),
     "lamport-head: bench: --all-to-all and --drafter are two benches: run one at a time"),
    (("--all-to-all", "--plot", "b.png"),
     "lamport-head: bench: --plot draws the gather bench's figures"),
    (("--all-to-all", "--splits", "random"),
     "lamport-head bench: argument --splits: invalid choice"),
    (("--all-to-all", "--tp", "3"), "lamport-head: bench: vocab 163840 / tp 3 is not a multiple"),
])
def test_all_to_all_refuses_bad_arguments_on_any_machine(argv, message):
    _refused(argv, message)


def test_all_to_all_torchrun_path_times_both_collectives_on_the_same_ranks(
        tmp_path, monkeypatch, capsys):
    """The real RanksRunner under a fake torchrun (one process here, its collectives the
    identity): the all-gather on the bench's DistributedTarget, the all-to-all on a
    AllToAllTarget of the same ranks, budget, V and dtype whose splits are
    --splits'; both timed with their stock paths."""

    from lamport_head import build
    from lamport_head.tuning.harness import AllToAllTarget

    ranks = types.SimpleNamespace(group=None, device=torch.device("cpu"), world=2, rank=0,
                                  shared=False)
    timed, stocked = [], []

    def lamport(self, rows, config, pdl=None):
        splits = self.splits(rows) if isinstance(self, AllToAllTarget) else None
        timed.append((self.collective, rows, splits, self.ranks is ranks, self.budget_s,
                      self.dtype))
        return Timing(9.0, 3.0, 1.0, 3.0, 1.0)

    monkeypatch.setattr(DistributedTarget, "limit", lambda self, t, u: 16)
    monkeypatch.setattr(DistributedTarget, "lamport", lamport)
    monkeypatch.setattr(DistributedTarget, "stock", lambda self, rows: (
        stocked.append((self.collective, rows)) or Timing(30.0, 20.0, 5.0)))
    chosen = Chosen(DistributedTarget(ranks, V, dtype=torch.float32), ranks.device, 2, True,
                    False)
    monkeypatch.setattr(a2abench, "make_target", lambda command, tp, vocab, dtype="bfloat16": chosen)
    monkeypatch.setattr(build, "TOOLCHAIN", types.SimpleNamespace(arch=lambda d: 90,
                                                                pdl=lambda a: True))
    monkeypatch.setattr(rankbench, "copy_bandwidth_gbs", lambda device: BANDWIDTH)
    monkeypatch.setattr(rankbench, "agree", lambda *a: None)
    monkeypatch.setattr(rankbench, "all_min", lambda value, *a: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert _bench(tmp_path, "--all-to-all", "--tp", "2", "--splits", "uneven", "--budget-s",
                  "0.25", "--dtype", "float32") == 0
    assert timed == [x for m in (1, 8, 64) for x in (
        (ALL_GATHER, m, None, True, 0.25, torch.float32),
        (ALL_TO_ALL, m, vllm_splits(m, 2), True, 0.25, torch.float32))]
    assert stocked == [(c, m) for m in (1, 8, 64) for c in (ALL_GATHER, ALL_TO_ALL)]
    rows = _csv(tmp_path / "b-all-to-all.csv")
    assert all(float(r["stock_ratio"]) == pytest.approx(20.0 / 3.0, rel=1e-3) for r in rows)
    assert float(rows[1]["step_bytes"]) == all_to_all_bytes([0, 1], V, 1, itemsize=4)

