"""The sweep driver with the timing harness replaced by a deterministic cost model."""

import json
import math
from dataclasses import astuple

import pytest
import torch
import torch.distributed as dist
import yaml
from spawn import spawn

from lamport_head.config import GatherConfig, cta_choices
from lamport_head.table import TableRow, load_table
from lamport_head.tuning import sweep
from lamport_head.tuning import harness
from lamport_head.tuning.harness import Timing
from lamport_head.tuning.writer import measured_rows, merge_section


class CostModel:
    """Lamport cost is smallest at ctas = 4 * rows (capped), threads 256, unroll 4;
    stock costs 10 µs + 1 µs per row. Records every measured configuration."""

    emulated = True
    objective = "gpu_us"

    def __init__(self, limit=64, bad=()):
        self.limit_ctas, self.bad, self.timed = limit, set(bad), []

    def limit(self, threads, unroll):
        return self.limit_ctas

    def lamport(self, rows, config):
        self.timed.append((rows, config.ctas, config.threads, config.unroll))
        if (config.ctas, config.threads, config.unroll) in self.bad:
            return None  # failed verification
        best = min(4 * rows, self.limit_ctas)
        us = (3 + abs(math.log2(config.ctas / best)) + (config.threads != 256)
              + (config.unroll != 4) + rows / 8)
        return Timing(us + 5, us, 4.0, us * 1.01, 0.1)

    def stock(self, rows):
        return Timing(10 + rows + 5, 10 + rows, 9.0)


V = 163840


def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"


def test_grid_finds_the_argmin_and_times_each_config_once(tmp_path):
    target = CostModel(limit=64)
    r = sweep.tune_rows(target, 4, device="gpu x", tp=8, dcp=1, vocab=V, trials=10_000,
                        storage=storage(tmp_path))
    assert (r.entry.ctas, r.entry.config.threads, r.entry.config.unroll) == (16, 256, 4)
    assert r.lamport_us == pytest.approx(3.5) and r.stock_us == 14 and r.entry.enabled
    assert len(target.timed) == len(set(target.timed)) == len(sweep.grid(target))


def test_margin_decides_enabled(tmp_path):
    target = CostModel(limit=64)
    r = sweep.tune_rows(target, 64, device="g", tp=8, dcp=1, vocab=V, trials=10_000, storage=storage(tmp_path),
                        margin=0.0)
    assert r.entry.enabled  # 3 + 8 + penalty(64 vs 256 -> 2) = 13 < 74
    r = sweep.tune_rows(target, 64, device="g2", tp=8, dcp=1, vocab=V, trials=10_000,
                        storage=storage(tmp_path), margin=0.9)
    assert not r.entry.enabled  # must be under 7.4 µs


def test_failed_verification_is_never_chosen(tmp_path):
    target = CostModel(limit=64, bad={(16, 256, 4)})
    r = sweep.tune_rows(target, 4, device="g", tp=8, dcp=1, vocab=V, trials=10_000, storage=storage(tmp_path))
    assert (r.entry.ctas, r.entry.config.threads, r.entry.config.unroll) != (16, 256, 4)


def test_resume_times_nothing_twice(tmp_path):
    first = CostModel()
    r1 = sweep.tune_rows(first, 2, device="g", tp=8, dcp=1, vocab=V, trials=20, storage=storage(tmp_path))
    second = CostModel()
    r2 = sweep.tune_rows(second, 2, device="g", tp=8, dcp=1, vocab=V, trials=30, storage=storage(tmp_path))
    assert len(first.timed) == 20 and len(second.timed) == 10
    assert not set(first.timed) & set(second.timed)
    assert r2.trials == 30 and r2.lamport_us <= r1.lamport_us
    third = CostModel()
    sweep.tune_rows(third, 2, device="g", tp=8, dcp=1, vocab=V, trials=30, storage=storage(tmp_path))
    assert third.timed == []


def test_resume_with_other_threads_reports_only_what_it_timed(tmp_path):
    """Run 2 sweeps threads 128 where run 1 swept 256: same grid size, same indices;
    it must time its own configurations, never report run 1's figures for them."""
    first = CostModel(limit=16)
    sweep.tune_rows(first, 4, device="g", tp=8, dcp=1, vocab=V, trials=100,
                    storage=storage(tmp_path), threads=(256,), unroll=(4,))
    second = CostModel(limit=16)
    r = sweep.tune_rows(second, 4, device="g", tp=8, dcp=1, vocab=V, trials=100,
                        storage=storage(tmp_path), threads=(128,), unroll=(4,))
    chosen = (4, r.entry.ctas, r.entry.config.threads, r.entry.config.unroll)
    assert r.entry.config.threads == 128 and chosen in second.timed
    assert r.lamport_us == pytest.approx(second.lamport(4, r.entry.config).gpu_us)


def test_study_key_separates_vocab_and_kernel(tmp_path):
    runs = [dict(vocab=V, kernel="k1"), dict(vocab=V, kernel="k1"), dict(vocab=129280, kernel="k1"),
            dict(vocab=V, kernel="k2")]
    timed = []
    for keys in runs:
        target = CostModel(limit=16)
        sweep.tune_rows(target, 2, device="g", tp=8, dcp=1, trials=100, storage=storage(tmp_path),
                        threads=(256,), unroll=(4,), **keys)
        timed.append(len(target.timed))
    assert timed == [8, 0, 8, 8]  # only the identical run resumes


def test_trials_store_configuration_values(tmp_path):
    import optuna

    sweep.tune_rows(CostModel(limit=4), 1, device="g", tp=8, dcp=1, vocab=V, trials=100,
                    storage=storage(tmp_path), threads=(128,), unroll=(2,))
    (summary,) = optuna.get_all_study_summaries(storage(tmp_path))
    assert f"vocab{V}" in summary.study_name and "kernel-" in summary.study_name
    study = optuna.load_study(study_name=summary.study_name, storage=storage(tmp_path))
    got = sorted((t.params["config"], t.user_attrs["ctas"], t.user_attrs["threads"],
                  t.user_attrs["unroll"]) for t in study.trials)
    assert got == [(f"ctas={c},threads=128,unroll=2", c, 128, 2) for c in (1, 2, 3, 4)]


def test_tpe_beyond_the_grid_never_repeats(tmp_path):
    target = CostModel(limit=1024)
    sweep.tune_rows(target, 8, device="g", tp=8, dcp=1, vocab=V, trials=25, storage=storage(tmp_path))
    assert len(target.timed) == len(set(target.timed)) <= 25


def test_measured_rows_one_entry_each_and_yaml_round_trip(tmp_path):
    target = CostModel(limit=12)
    results = [sweep.tune_rows(target, m, device="g", tp=8, dcp=1, vocab=V, trials=10_000,
                               storage=storage(tmp_path)) for m in (2, 4, 8, 16)]
    rows = measured_rows(results)
    # 4..16 share ctas=12 (capped) and the decision, yet each row is its own entry:
    # a range "4-16" would claim rows 5..7 and 9..15 were measured.
    assert list(rows) == [2, 4, 8, 16]
    assert rows[4]["stock_us"] == 14 and rows[16]["stock_us"] == 26  # each row its own figures
    path = tmp_path / "head_gather.yaml"
    path.write_text(yaml.safe_dump({"schema": 1, "devices": {"Other GPU": [
        {"tp": 2, "dcp": 1, "rows": {1: {"ctas": 1, "enabled": True}}}]}}))
    prov = {"gpu": "GPU X", "command": "lamport-head tune --tp 8 --emulate", "date": "2026-12-02"}
    merge_section(path, "GPU X", 8, 1, rows, prov, emulated=True)
    merge_section(path, "GPU X", 8, 1, rows, prov, emulated=True)  # replaces, never duplicates
    t = load_table(path)
    assert t.entries("Other GPU", 2, 1)[1].ctas == 1  # untouched
    assert t.entries("GPU X", 8, 1) == {}  # emulated: never served
    entries = t.entries("GPU X", 8, 1, emulated=True)
    assert entries[2].ctas == 8 and entries[16].enabled and not entries[16].filled
    assert entries[12] == TableRow(GatherConfig(12, 256, 4), True, filled=True)  # from row 16
    assert 1 not in entries and 17 not in entries  # outside the measured rows: stock
    assert len(t.sections) == 2
    assert not list(tmp_path.glob(".head_gather.yaml.*"))  # no temporary left behind


def test_merge_into_a_table_it_cannot_read_sets_it_aside(tmp_path, caplog):
    """Issue 40: `lamport-head tune` repairs a table it cannot read whole (it used to
    refuse to merge, for ever): the file is set aside beside itself, one warning names
    both paths, and the new section is written into a fresh table."""
    path = tmp_path / "t.yaml"
    path.write_text("schema: 3\n")
    with caplog.at_level("WARNING", logger="lamport_head"):
        merge_section(path, "G", 2, 1, {1: {"ctas": 1, "enabled": True}}, {})
    (aside,) = tmp_path.glob("t.yaml.broken-*")
    assert aside.read_text() == "schema: 3\n"
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(path) in line and str(aside) in line
    assert [s.tp for s in load_table(path).sections] == [2]


class RankCost(CostModel):
    """Each rank sees a different cost; the trial value must be the max over ranks."""

    def __init__(self, rank):
        super().__init__(limit=16)
        self.rank = rank

    def lamport(self, rows, config):
        t = super().lamport(rows, config)
        if t is None:
            return None
        # rank 1 is slow at exactly the config rank 0 likes best
        extra = 5.0 if (self.rank == 1 and config.ctas == 4) else 0.0
        local = torch.tensor([t.gpu_us + extra], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return Timing(t.eager_us, local.item(), t.host_us)


def _agree_worker(rank, world, db):
    target = RankCost(rank)
    r = sweep.tune_rows(target, 1, device="g", tp=world, dcp=1, vocab=V, trials=40, storage=db,
                        comm=sweep.DistComm(None))
    return {"ctas": r.entry.ctas, "us": r.lamport_us, "timed": target.timed}


def test_ranks_agree_on_one_choice(tmp_path):
    a, b = spawn(_agree_worker, 2, tmp_path, storage(tmp_path))
    assert a == b  # same result, and the same configurations measured in the same order
    assert a["ctas"] != 4  # the max over ranks ruled out rank 0's favourite


def fake_gpu(monkeypatch, name="NVIDIA H200", limit=16):
    """The CLI on a machine that claims one GPU ``name``; targets are cost models."""
    import lamport_head.tuning.harness as harness

    class FakeTarget(CostModel):
        def __init__(self, device, tp, vocab, dtype="bfloat16"):
            super().__init__(limit=limit)
            self.tp, self.shard_width, self.dtype = tp, vocab // tp, dtype

    monkeypatch.setattr(harness, "EmulatedTarget", FakeTarget)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


def test_tune_command_end_to_end_with_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """`lamport-head tune --emulate` through the CLI: studies, summary, table, plot."""
    from lamport_head import cli

    fake_gpu(monkeypatch)
    out, png = tmp_path / "t.yaml", tmp_path / "t.png"
    argv = ["tune", "--emulate", "--tp", "8", "--rows", "1,2,4", "--trials", "6", "--quiet",
            "--out", str(out), "--plot", str(png)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "rows  ctas" in text and "emulated: TP virtual ranks" in text
    section = load_table(out).section("NVIDIA H200", 8, 1, emulated=True)
    assert section is not None and section.provenance["command"].startswith("lamport-head tune")
    assert set(section.rows) >= {1, 2, 4}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "t.optuna.db").exists()
    # a re-run resumes: nothing left to time for the same trial count
    assert cli.main(argv) == 0


def test_tune_dtype_float32_measures_for_fp32_and_writes_a_float32_section_beside_bf16(
        tmp_path, monkeypatch, capsys):
    """`lamport-head tune --dtype float32`: the target is made for FP32 logits, its
    studies are keyed apart from BF16's (a BF16 study never resumes for FP32), and the
    section is written ``dtype: float32`` beside the BF16 one; `show` prints each
    section's dtype."""
    from lamport_head import cli

    fake_gpu(monkeypatch)
    made = []
    real = harness.EmulatedTarget
    monkeypatch.setattr(harness, "EmulatedTarget",
                        lambda *a, **k: made.append(k.get("dtype")) or real(*a, **k))
    out = tmp_path / "t.yaml"
    base = ["tune", "--emulate", "--tp", "8", "--rows", "1,2", "--trials", "4", "--quiet",
            "--out", str(out)]
    assert cli.main(base) == 0 and cli.main(base + ["--dtype", "float32"]) == 0
    assert made == ["bfloat16", "float32"]
    table = load_table(out)
    bf16 = table.section("NVIDIA H200", 8, 1, emulated=True, dtype="bfloat16")
    fp32 = table.section("NVIDIA H200", 8, 1, emulated=True, dtype=torch.float32)
    assert (bf16.dtype, fp32.dtype) == ("bfloat16", "float32") and bf16 is not fp32
    assert "wrote" in capsys.readouterr().out
    assert cli.main(["show", "--table", str(out), "--device", "NVIDIA H200", "--emulated"]) == 0
    shown = capsys.readouterr().out
    assert "  bfloat16 logits; served only to a head of that dtype" in shown
    assert "  float32 logits; served only to a head of that dtype" in shown
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(
        f"sqlite:///{tmp_path / 't.optuna.db'}")]
    assert sum("|float32|" in n for n in names) == 2 and len(names) == 4


def test_tune_writes_the_user_layer_by_default(monkeypatch, capsys):
    from lamport_head import cli
    from lamport_head.table import user_path

    fake_gpu(monkeypatch, "GPU Q", limit=4)
    assert not user_path().exists()
    assert cli.main(["tune", "--emulate", "--tp", "2", "--rows", "1,4", "--trials", "4",
                     "--quiet"]) == 0
    assert user_path().exists() and user_path().with_name("head_gather.optuna.db").exists()
    layered = load_table()  # serving's view now holds the tuned section
    assert layered.section("GPU Q", 2, 1, emulated=True).source == str(user_path())
    capsys.readouterr()
    assert cli.main(["show", "--device", "GPU Q", "--tp", "2", "--emulated"]) == 0
    out = capsys.readouterr().out
    assert f"from {user_path()}" in out and "filled (not measured) from rows 4" in out


def test_tune_and_bench_choose_their_target_in_one_place(monkeypatch, capsys):
    """tuning.targets.make_target: one process emulates (tune asks for --emulate above
    TP 1); under torchrun the ranks' own target, tune's --tp checked against them, the
    note printed by the root where they share a GPU."""
    import types

    import lamport_head.tuning.support.procs as procs
    import lamport_head.tuning.harness as harness
    from lamport_head.tuning.targets import make_target

    fake_gpu(monkeypatch)
    with pytest.raises(SystemExit, match="^lamport-head tune: one process sees one rank; use "
                       "--emulate for TP virtual ranks on one GPU, or torchrun --nproc-per-node TP$"):
        make_target("tune", 2, V, emulate=False)
    solo = make_target("bench", 2, V)  # bench emulates without being asked
    assert (solo.world, solo.root, solo.emulated, solo.target.tp) == (1, True, True, 2)
    assert make_target("tune", 1, V, emulate=False).target.tp == 1

    ranks = types.SimpleNamespace(world=2, device="cuda:0", shared=True, is_root=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(procs, "init_ranks", lambda: ranks)
    monkeypatch.setattr(harness, "DistributedTarget", lambda r, vocab, dtype="bfloat16": ("ranks", r, vocab))
    with pytest.raises(SystemExit, match="^lamport-head tune: --tp 4 but torchrun started 2 ranks$"):
        make_target("tune", 4, V, emulate=False)
    chosen = make_target("tune", 2, V, emulate=False, shared_note="; written emulated")
    assert (chosen.target, chosen.device, chosen.world, chosen.root, chosen.emulated) == (
        ("ranks", ranks, V), "cuda:0", 2, True, True)
    assert capsys.readouterr().out == f"lamport-head tune: {procs.SHARED_NOTE}; written emulated\n"
    ranks.is_root, ranks.shared = False, False
    chosen = make_target("bench", 8, V)  # bench takes the ranks torchrun started
    assert (chosen.root, chosen.emulated) == (False, False) and capsys.readouterr().out == ""


class CollectiveCost(CostModel):
    """A target as real ranks see it: every method issues a gloo collective (limit a
    MIN, lamport and stock a MAX), so a rank that skips a call deadlocks its peers.
    ``fail_rank`` fails verification (None) at ``fail_at`` on that rank alone."""

    def __init__(self, rank, fail_rank=None, fail_at=(16, 256, 4)):
        super().__init__(limit=16 + 8 * rank)  # ranks disagree until they reduce
        self.rank, self.fail_rank, self.fail_at = rank, fail_rank, fail_at

    def _reduce(self, value, op):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.item()

    def limit(self, threads, unroll):
        return int(self._reduce(self.limit_ctas, dist.ReduceOp.MIN))

    def lamport(self, rows, config):
        t = super().lamport(rows, config)
        us = self._reduce(t.gpu_us, dist.ReduceOp.MAX)
        if (self.rank == self.fail_rank
                and (config.ctas, config.threads, config.unroll) == self.fail_at):
            return None  # this rank's verification failed; its peers saw a figure
        return Timing(t.eager_us, us, t.host_us)

    def stock(self, rows):
        t = super().stock(rows)
        return Timing(t.eager_us, self._reduce(t.gpu_us, dist.ReduceOp.MAX), t.host_us)


def _collective_worker(rank, world, db, fail_rank):
    target, seen = CollectiveCost(rank, fail_rank), []
    r = sweep.tune_rows(target, 4, device="g", tp=world, dcp=1, vocab=V, trials=40, storage=db,
                        comm=sweep.DistComm(None), threads=(256,), unroll=(2, 4),
                        on_trial=lambda rows, config, timing: seen.append(
                            [list(astuple(config)), timing and timing.gpu_us]))
    return {"entry": [r.entry.ctas, r.entry.enabled, r.entry.config.threads, r.entry.config.unroll],
            "us": [r.lamport_us, r.stock_us], "trials": r.trials, "seen": seen}


def _broken_study_worker(rank, world, db, when):
    """Rank 0's Optuna fails (its storage, or a tell mid-sweep); every rank must raise
    the same error instead of waiting in a broadcast."""
    if rank == 0 and when == "tell":
        original = sweep._Study.record
        calls = []

        def record(self, *args):
            calls.append(1)
            if len(calls) == 3:
                raise OSError("disk full")
            return original(self, *args)

        sweep._Study.record = record
    if rank == 0 and when == "kernel":  # the CLI path: the study's key reads the kernel's files
        def unreadable(sources=None):
            raise OSError("cannot read the kernel sources")

        sweep.kernel_identity = unreadable
    storage_url = "sqlite:////nonexistent-dir/x.db" if (rank == 0 and when == "open") else db
    try:
        sweep.tune_rows(CollectiveCost(rank, None), 4, device="g", tp=world, dcp=1, vocab=V,
                        trials=40, storage=storage_url, comm=sweep.DistComm(None),
                        threads=(256,), unroll=(2, 4))
        what = "returned"
    except RuntimeError as exc:
        what = str(exc)
    return what


@pytest.mark.parametrize("when", ["open", "tell", "kernel"])
def test_an_optuna_failure_on_the_root_stops_every_rank(tmp_path, when):
    results = spawn(_broken_study_worker, 3, tmp_path, storage(tmp_path), when, timeout_s=60)
    assert all(r == results[0] for r in results), results
    assert results[0].startswith("lamport-head tune: the Optuna study failed on rank 0")
    assert ("disk full" in results[0]) == (when == "tell")
    assert ("OSError: cannot read the kernel sources" in results[0]) == (when == "kernel")


def _empty_grid_worker(rank, world):
    """Every CTA count asked is above the agreed limit (MIN 16 over ranks): the grid
    is empty on every rank. Then one more collective: the ranks are still in step."""
    from lamport_head.collective import all_gather_objects

    try:
        sweep.tune_rows(CollectiveCost(rank), 4, device="g", tp=world, dcp=1, vocab=V, trials=10,
                        storage=None, comm=sweep.DistComm(None), threads=(256,), unroll=(4,),
                        ctas=(32, 64))
        what = "returned"
    except Exception as exc:
        what = f"{type(exc).__name__}: {exc}"
    return all_gather_objects(what)


def test_an_empty_grid_raises_the_same_error_on_every_rank(tmp_path):
    results = spawn(_empty_grid_worker, 2, tmp_path, deadline_s=60)
    assert results[0] == results[1]
    assert results[0][0] == results[0][1] == (
        "ValueError: lamport-head tune: no CTA count fits: limit 16 at threads=256, unroll=4; "
        "the CTA counts tried are [32, 64]")


def _broken_progress_worker(rank, world):
    """Rank 1's per-trial callback (the CLI's progress bar) raises from its first
    trial on; then one more collective: the ranks are still in step."""
    from lamport_head.collective import all_gather_objects

    def progress(rows, config, timing):
        if rank == 1:
            raise BrokenPipeError("stderr closed")

    try:
        result = sweep.tune_rows(CollectiveCost(rank), 4, device="g", tp=world, dcp=1, vocab=V,
                               trials=6, storage=None, comm=sweep.DistComm(None),
                               threads=(256,), unroll=(4,), ctas=(8, 16), on_trial=progress)
        what = [result.entry.ctas, result.entry.enabled, result.timed]
    except Exception as exc:
        what = f"{type(exc).__name__}: {exc}"
    return all_gather_objects(what)


def test_a_failing_progress_callback_on_one_rank_stops_no_rank(tmp_path):
    results = spawn(_broken_progress_worker, 2, tmp_path, deadline_s=60)
    assert results[0] == results[1] and results[0][0] == results[0][1]
    assert isinstance(results[0][0], list), results[0][0]


@pytest.mark.parametrize("world, fail_rank", [(2, None), (3, None), (2, 1), (3, 0)])
def test_every_rank_takes_part_in_every_collective(tmp_path, world, fail_rank):
    results = spawn(_collective_worker, world, tmp_path, storage(tmp_path), fail_rank,
                    timeout_s=60)
    assert all(r == results[0] for r in results)  # same result, same trials, same story
    first = results[0]
    assert len(first["seen"]) == 2 * len(cta_choices(16))  # the whole grid, once
    assert first["trials"] == len(first["seen"]) - (fail_rank is not None)  # completed ones
    if fail_rank is None:
        assert first["entry"] == [16, True, 256, 4]  # the cost model's argmin
    else:
        assert [[16, 256, 4], None] in first["seen"]  # failed on every rank
        assert first["entry"][0] != 16


def test_an_emulated_timeout_while_measured_is_a_failed_trial(monkeypatch):
    """A wait that runs out while a configuration is timed makes the trial fail
    (None), never a figure and never an exception out of the sweep."""
    from lamport_head.status import GatherTimeout
    from lamport_head.tuning.harness import EmulatedTarget

    target = EmulatedTarget.__new__(EmulatedTarget)

    def measure(rows, config):
        raise GatherTimeout(0, (3,), 11)

    monkeypatch.setattr(target, "_measure", measure)
    assert target.lamport(8, GatherConfig(4)) is None


_WALK = """
import json, sys
sys.path.insert(0, {tests!r})
from test_sweep import CostModel, V
from lamport_head.tuning import sweep

target = CostModel(limit=16, bad={{(8, 256, 4)}})
r = sweep.tune_rows(target, 4, device="g", tp=8, dcp=1, vocab=V, trials=10, storage=None,
                    threads=(256,), unroll=(4,), ctas=(4, 8, 16, 32), kernel="k")
print(json.dumps({{"optuna": "optuna" in sys.modules, "timed": target.timed,
                  "result": [r.entry.ctas, r.entry.enabled, r.lamport_us, r.stock_us,
                             r.lamport_gpu_us, r.trials, r.timed]}}))
"""


def test_a_walk_without_storage_never_imports_optuna_and_matches_the_study(tmp_path):
    """First-use tuning (storage None, a grid within its trials) runs in the serving
    process: it must not import Optuna, and it must choose exactly what an Optuna
    study walking the same grid chooses. A subprocess: other tests import Optuna."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-c", _WALK.format(tests=tests)], check=True,
                         capture_output=True, text=True, cwd=tmp_path)
    walked = json.loads(run.stdout.strip().splitlines()[-1])
    assert walked["optuna"] is False
    target = CostModel(limit=16, bad={(8, 256, 4)})
    r = sweep.tune_rows(target, 4, device="g", tp=8, dcp=1, vocab=V, trials=10,
                        storage=storage(tmp_path), threads=(256,), unroll=(4,),
                        ctas=(4, 8, 16, 32), kernel="k")
    assert walked["timed"] == [list(t) for t in target.timed] == [
        [4, 4, 256, 4], [4, 8, 256, 4], [4, 16, 256, 4]]  # the grid, in order, once each
    assert walked["result"] == [r.entry.ctas, r.entry.enabled, r.lamport_us, r.stock_us,
                                r.lamport_gpu_us, r.trials, r.timed]
    assert walked["result"][:2] == [16, True] and walked["result"][5:] == [2, 3]


def _writer_worker(rank, nprocs, path):
    """One TP group's rank 0 writing its own section, many times, all at once."""
    for i in range(15):
        merge_section(path, "NVIDIA H200", 2 ** (rank + 1), 1,  # TPs the vocabulary divides
                      {1: {"ctas": 8 + i, "enabled": True}}, {"note": f"writer {rank}"})
    return rank


def test_writers_of_different_sections_at_once_lose_none(tmp_path):
    """Issue 19 item 6: 4 processes (DP > 1 on one host: several TP groups' rank 0s)
    merging different sections into one user table at once: every section survives."""
    path = str(tmp_path / "cache" / "head_gather.yaml")
    assert spawn(_writer_worker, 4, tmp_path, path, group=False) == [0, 1, 2, 3]
    table = load_table(path)
    assert sorted(s.tp for s in table.sections) == [2, 4, 8, 16]
    assert all(s.rows[1].ctas == 8 + 14 for s in table.sections)  # each writer's last
