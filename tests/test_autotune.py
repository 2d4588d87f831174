"""First-use tuning at install (lamport_head.tuning.firstuse) on 2-rank gloo groups, CUDA
faked (helpers.fake_cuda) and the timing harness replaced by a collective cost
model: measures once and writes the user table, a second start (fresh processes)
reads it and measures nothing, the off switch, stale provenance, a failure on one
rank (every rank stock, one warning each, nobody hangs: spawn's deadline), ranks
sharing one GPU (written emulated: true, served only on explicit opt-in), a second
model of another vocabulary (its own section, measured beside the first), and the
rows the vLLM plugin asks for."""

import contextlib
import errno
import logging
import os
import stat
import sys
import time
import types

import pytest
import torch
import yaml
from helpers import FAKE_BYTE, CollectiveTarget, capture_log, fake_cuda, model
from spawn import spawn
from tables import sections

from lamport_head.tuning import firstuse
from lamport_head.table import load_table

FACTS = {"driver": "580.1", "cuda": "13.0", "torch": "2.13.0", "cutlass_dsl": "4.8.0",
         "lamport_head": "0.1.0", "kernel": "abcdef123456"}
# The cost model below: Lamport wins up to 16 rows, loses from 32 on.
SERVED = list(range(1, 17))
MEASURED = [1, 2, 4, 8, 16, 32, 64]


def _worker(rank, nprocs, cache, env, shared, fail, facts, shard=64):
    from lamport_head import mailbox, provenance, settings
    from lamport_head.engines.vllm import install_logits_gather

    os.environ.pop("LAMPORT_HEAD_TABLE", None)
    os.environ.update(env, LAMPORT_HEAD_CACHE=cache)
    fake_cuda(setattr, rank, "ok")
    host = f"host{rank}" if fail == "hosts" else "host"  # "hosts": one rank per host
    if env.get("PER_HOST_CACHE"):  # each rank its own host, so its own user table
        host = f"host{rank}"
        os.environ["LAMPORT_HEAD_CACHE"] = os.path.join(cache, host)
    if "UMASK" in env:
        os.umask(int(env["UMASK"], 8))

    def device_key(device):
        caller = sys._getframe(1).f_code.co_filename
        if fail == f"hostkey@{rank}" and caller.endswith("firstuse.py"):
            raise RuntimeError("injected: no device key")  # first-use tuning's host exchange
        return (host, "gpu" if shared else f"gpu{rank}")

    mailbox.device_key = device_key
    provenance.facts = lambda: dict(facts)
    timed, io = [], []
    if fail == f"clock@{rank}":  # this rank's clock runs 1000 s a read ahead: rank 0 decides
        ticks = iter(range(1 << 30))
        firstuse.time = types.SimpleNamespace(
            monotonic=lambda: time.monotonic() + 1000 * next(ticks))
    if env.get("SKEW_CLOCKS"):  # each rank's clock and date its own: rank 0's are written
        provenance.now = lambda: f"2026-12-06T00:00:0{rank}Z"
        firstuse.time = types.SimpleNamespace(monotonic=lambda: time.monotonic() * (1 + rank))
    if env.get("TRACE_IO"):  # the durable write's system calls, in order
        fsync, replace, rename = os.fsync, os.replace, os.rename

        def traced_fsync(fd):
            io.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
            return fsync(fd)

        def traced(name, call):
            def run(src, dst, *a, **k):
                io.append((name, os.path.basename(str(dst))))
                return call(src, dst, *a, **k)
            return run

        os.fsync, os.replace, os.rename = (traced_fsync, traced("replace", replace),
                                           traced("rename", rename))

    def make_target(ranks, vocab, limits=firstuse.FIRST_USE_LIMITS, stock=None,
                    dtype="bfloat16", *, stock_kind="nccl-all-gather"):
        asked.append(dtype)
        if fail == f"prepare@{rank}":
            raise RuntimeError("injected: no target")
        if fail == f"unserve@{rank}":  # the opt-in leaves this rank's environment mid-tuning
            os.environ.pop(settings.SERVE_EMULATED_ENV, None)
        return CollectiveTarget(ranks, vocab, fail, timed)

    if env.get("READ_ONLY_CACHE"):  # the cache's file system is read-only (root too)
        from lamport_head import tablefile

        @contextlib.contextmanager
        def read_only(path):  # what a set-aside and a write take first
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            yield

        tablefile.locked = read_only
    firstuse.make_target = make_target
    seen = capture_log()
    warned = []  # the WARNING lines (and above)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("lamport_head").addHandler(handler)
    asked = []  # the dtypes first-use tuning's targets were made for
    logits = getattr(torch, env.get("HEAD_DTYPE", "bfloat16"))  # the head's logits dtype
    m = model(lm__tp_size=nprocs, lm__weight=torch.zeros(shard, 16, dtype=torch.bfloat16),
              lp__head_dtype=logits)
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    out = m.logits_processor._gather_logits(torch.zeros(1, shard, dtype=logits))
    routed = (sorted(set(out.view(torch.uint8).flatten().tolist())) if torch.is_tensor(out)
              else out)
    second = None
    if env.get("SECOND_MODEL"):  # another install of this start: a model of another V
        other = model(lm__tp_size=nprocs, lm__weight=torch.zeros(96, 16, dtype=torch.bfloat16))
        second = list(install_logits_gather(other, None, nprocs, rank, "cpu").rows)
    return {"served": list(served), "timed": len(timed), "rows": sorted({r for r, _ in timed}),
            "routed": routed, "log": seen, "io": io, "asked": asked, "warned": warned,
            "second": second}


def _start(tmp_path, env=None, shared=False, fail="", facts=FACTS, cache=None, shard=64,
           timeout_s=None):
    """One server start: 2 fresh rank processes installing on the same user table, a
    model whose lm_head shard is ``shard`` rows a rank (V = 2 x shard; 128 by default).
    ``timeout_s``: the gloo group's collective timeout (a rank left alone in a
    collective fails the start instead of waiting for spawn's deadline)."""
    cache = cache or str(tmp_path / "cache")
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run.mkdir()
    env = {"LAMPORT_HEAD_AUTOTUNE": "1", **(env or {})}
    return spawn(_worker, 2, run, cache, env, shared, fail, facts, shard, timeout_s=timeout_s)


def _user_table(tmp_path):
    path = tmp_path / "cache" / "head_gather.yaml"
    return path, (yaml.safe_load(path.read_text()) if path.exists() else None)


def test_first_install_measures_writes_and_serves_a_second_start_measures_nothing(tmp_path):
    first = _start(tmp_path)
    for r in first:
        assert r["served"] == SERVED and r["routed"] == [FAKE_BYTE]
        assert r["rows"] == MEASURED  # the representative rows of 1-64, each timed
        assert r["timed"] == len(MEASURED) * len(firstuse.FIRST_USE_LIMITS.ctas)
        assert any("first-use tuning on NVIDIA H200 (tp=2, dcp=1, missing): measured rows "
                   "[1, 2, 4, 8, 16, 32, 64]" in line for line in r["log"])
        assert not any("stays stock" in line for line in r["log"])
    path, data = _user_table(tmp_path)
    (section,) = data["devices"]["NVIDIA H200"]
    assert section["tp"] == 2 and section["dcp"] == 1 and section["emulated"] is False
    assert section["vocab"] == 128  # the model's V: 2 ranks x 64 rows of lm_head
    assert list(section["rows"]) == MEASURED  # measured rows only; serving fills the gaps
    assert section["rows"][8] == {"ctas": 64, "enabled": True, "threads": 256, "unroll": 4,
                                  "lamport_us": 7.0, "stock_us": 11.0}
    assert not section["rows"][32]["enabled"]
    prov = section["provenance"]
    assert {k: prov[k] for k in FACTS} == FACTS and prov["gpu"] == "NVIDIA H200"
    assert prov["command"] == firstuse.COMMAND and "date" in prov and "commit" in prov
    assert load_table(path).section("NVIDIA H200", 2, 1) is not None  # the loader takes it

    second = _start(tmp_path)
    for r in second:
        assert r["served"] == SERVED and r["timed"] == 0 and r["routed"] == [FAKE_BYTE]
        assert not any("first-use tuning" in line for line in r["log"])
    assert _user_table(tmp_path)[1] == data  # untouched


def test_a_second_vocabulary_measures_its_own_section_beside_the_first(tmp_path):
    """Issue 32 item 3: a section measured at one V is not served to a model of another
    V (the bytes a row moves scale with V). A second model on the same machine (V =
    192) finds no section for its V, measures, and writes its section beside the first
    model's (kept as it was); later starts of either model measure nothing."""
    _start(tmp_path)  # the first model: V = 128
    (first,) = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert first["vocab"] == 128
    second = _start(tmp_path, shard=96)  # another model: V = 2 x 96 = 192
    for r in second:
        assert r["served"] == SERVED and r["rows"] == MEASURED and r["routed"] == [FAKE_BYTE]
        line = next(x for x in r["log"] if "first-use tuning on NVIDIA H200" in x)
        assert "(tp=2, dcp=1, missing): measured rows" in line
        assert line.endswith("; vocab=192, bfloat16 (the tables hold sections for vocab 128 only)")
    path, data = _user_table(tmp_path)
    sections = data["devices"]["NVIDIA H200"]
    assert [s["vocab"] for s in sections] == [128, 192]
    assert sections[0] == first  # the first model's section is untouched
    assert list(sections[1]["rows"]) == MEASURED
    table = load_table(path)
    assert table.section("NVIDIA H200", 2, 1, vocab=192).raw == sections[1]
    for shard in (64, 96):  # each model reads its own section: nothing measured
        for r in _start(tmp_path, shard=shard):
            assert r["served"] == SERVED and r["timed"] == 0 and r["routed"] == [FAKE_BYTE]
            assert not any("first-use tuning" in x for x in r["log"])
    assert _user_table(tmp_path)[1] == data


def test_an_fp32_head_measures_its_own_section_beside_the_bf16_one(tmp_path):
    """Issue 42: a section is measured for one logits dtype. A model of the same V whose
    lm_head runs in FP32 (vLLM's head_dtype float32) finds the BF16 section not serving
    it, measures at float32 (the targets are made for it), and writes a ``dtype:
    float32`` section beside the BF16 one, which stays as it was; later starts of
    either head measure nothing and each serves its own section."""
    _start(tmp_path)  # the BF16 head: V = 128
    (bf16,) = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert bf16["dtype"] == "bfloat16"
    fp32 = {"HEAD_DTYPE": "float32"}
    for r in _start(tmp_path, env=fp32):
        assert r["served"] == SERVED and r["rows"] == MEASURED and r["routed"] == [FAKE_BYTE]
        assert r["asked"] == ["float32"]
        line = next(x for x in r["log"] if "first-use tuning on NVIDIA H200" in x)
        assert line.endswith("; vocab=128, float32 (the tables hold sections for this vocab "
                             "and stock measured for bfloat16 logits only)")
    path, data = _user_table(tmp_path)
    sections = data["devices"]["NVIDIA H200"]
    assert [s["dtype"] for s in sections] == ["bfloat16", "float32"]
    assert sections[0] == bf16 and sections[1]["vocab"] == 128
    table = load_table(path)
    assert table.section("NVIDIA H200", 2, 1, dtype="float32").raw == sections[1]
    for env in ({}, fp32):
        for r in _start(tmp_path, env=env):
            assert r["served"] == SERVED and r["timed"] == 0 and r["routed"] == [FAKE_BYTE]
    assert _user_table(tmp_path)[1] == data


def test_a_section_without_vocab_serves_only_the_tuners_default_vocabulary(tmp_path):
    """A table written before sections carried ``vocab``: its section is taken as V =
    163840 (the tuner's default). A model of that V is served from it, measuring
    nothing; a model of another V measures its own section."""
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n    - tp: 2\n      rows:\n"
                      "        1-4: {ctas: 8, enabled: true}\n")
    env = {"LAMPORT_HEAD_TABLE": str(legacy)}
    for r in _start(tmp_path, env=env, shard=163840 // 2):
        assert r["served"] == [1, 2, 3, 4] and r["timed"] == 0 and r["routed"] == [FAKE_BYTE]
    assert _user_table(tmp_path)[1] is None
    for r in _start(tmp_path, env=env):  # V = 128
        assert r["served"] == SERVED and r["rows"] == MEASURED
        assert any(x.endswith("; vocab=128, bfloat16 (the tables hold sections for vocab 163840 "
                              "only)")
                   for x in r["log"]), r["log"]
    assert [s["vocab"] for s in _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]] == [128]


def test_off_switch_measures_nothing_and_serves_stock(tmp_path):
    for r in _start(tmp_path, env={"LAMPORT_HEAD_AUTOTUNE": "0"}):
        assert r["served"] == [] and r["timed"] == 0 and r["routed"] == ["stock", 1]
        assert "no enabled HEAD_GATHER rows for NVIDIA H200" in r["log"][-1]
    assert _user_table(tmp_path)[1] is None


def test_stale_provenance_is_measured_again_and_served_as_is_when_off(tmp_path):
    _start(tmp_path)
    newer = dict(FACTS, driver="590.2", lamport_head="0.2.0")
    off = _start(tmp_path, env={"LAMPORT_HEAD_AUTOTUNE": "0"}, facts=newer)
    assert all(r["served"] == SERVED and r["timed"] == 0 for r in off)
    again = _start(tmp_path, facts=newer)
    for r in again:
        assert r["served"] == SERVED and r["rows"] == MEASURED
        assert any("(tp=2, dcp=1, stale: driver, lamport_head)" in line for line in r["log"])
    # issue 40 item 4: the other environment's section is kept beside this one's
    provs = [s["provenance"] for s in _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]]
    assert [(p["driver"], p["lamport_head"]) for p in provs] == [("580.1", "0.1.0"),
                                                                 ("590.2", "0.2.0")]
    assert all(r["timed"] == 0 for r in _start(tmp_path, facts=newer))


@pytest.mark.parametrize("fail, cause", [
    ("prepare@1", "RuntimeError: injected: no target"),
    ("stock@1", "RuntimeError: injected: stock path failed"),
    ("hostkey@1", "failed to name its host: rank 1: RuntimeError: injected: no device key"),
])
def test_a_failure_on_one_rank_leaves_every_rank_stock_with_one_warning(tmp_path, fail, cause):
    """Issue 40 item 6 adds ``hostkey@1``: the host exchange before the write (every rank
    raises, rank 1's cause named) leaves every rank stock, never "failed on this rank
    alone" (it used to raise unmarked: the worker stopped)."""
    results = _start(tmp_path, fail=fail)
    for rank, r in enumerate(results):
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        warnings = [line for line in r["log"] if "stays stock" in line]
        assert len(warnings) == 1 and "first-use tuning failed" in warnings[0]
        assert (cause if rank == 1 or fail == "hostkey@1"
                else "PeerFailed: lamport-head: another rank failed") in warnings[0]
        assert not any("on this rank alone" in line for line in r["log"])
    if fail == "stock@1":
        assert results[0]["rows"] == [1, 2]  # it failed measuring, after rows 1 and 2
    assert _user_table(tmp_path)[1] is None


def test_ranks_that_can_have_no_mailbox_measure_nothing_and_write_nothing(tmp_path):
    """Ranks on several hosts (nothing forced) can have no mailbox: every trial would
    fail alike and an all-stock section would read as measured for good. Every rank
    raises before the first trial instead: stock, one warning, no table."""
    for r in _start(tmp_path, fail="hosts"):
        assert r["served"] == [] and r["routed"] == ["stock", 1] and r["timed"] == 0
        warnings = [line for line in r["log"] if "stays stock" in line]
        assert len(warnings) == 1 and "span 2 hosts" in warnings[0], r["log"]
    assert _user_table(tmp_path)[1] is None


def test_ranks_sharing_one_gpu_write_emulated_and_serve_it_only_on_opt_in(tmp_path):
    first = _start(tmp_path, shared=True)
    for r in first:
        assert r["served"] == [] and r["rows"] == MEASURED
        assert "emulated: true, never served" in r["log"][-1]
    (section,) = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert section["emulated"] is True and "not performance" in section["provenance"]["note"]
    # A later start reads the emulated section: measures nothing, serves only on opt-in.
    later = _start(tmp_path, shared=True)
    assert all(r["served"] == [] and r["timed"] == 0 for r in later)
    opted = _start(tmp_path, shared=True,
                   env={"LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED": "1"})
    for r in opted:
        assert r["served"] == SERVED and r["timed"] == 0 and r["routed"] == [FAKE_BYTE]
        assert any("serving an emulated section" in line for line in r["log"])
    # Real ranks (distinct GPUs) never serve it: they measure their own section.
    real = _start(tmp_path, env={"LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED": "1"})
    assert all(r["served"] == SERVED and r["rows"] == MEASURED for r in real)


def test_first_install_on_shared_gpu_serves_what_won_on_opt_in(tmp_path):
    for r in _start(tmp_path, shared=True, env={"LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED": "1"}):
        assert r["served"] == SERVED and r["rows"] == MEASURED and r["routed"] == [FAKE_BYTE]


def test_serving_what_was_measured_follows_the_agreed_view_not_a_fresh_read(tmp_path):
    """The opt-in to serve an emulated section is agreed with the plan; after tuning,
    install used to read the environment again, so a rank whose variable changed
    meanwhile stayed stock while its peers built the gather (a collective)."""
    env = {"LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED": "1"}
    for r in _start(tmp_path, shared=True, env=env, fail="unserve@1"):
        assert r["served"] == SERVED and r["rows"] == MEASURED and r["routed"] == [FAKE_BYTE]


def test_rows_to_measure_are_powers_of_two_and_the_cap():
    assert firstuse.rows_to_measure(range(1, 65)) == MEASURED
    assert firstuse.rows_to_measure(range(1, 49)) == [1, 2, 4, 8, 16, 32, 48]
    assert firstuse.rows_to_measure([3]) == [3]


def test_first_use_measures_the_batches_each_rows_default_plan_takes():
    """``row_unroll``: the unroll of each row count's default plan (register 4 while
    its peer fragments take few rounds of the co-resident CTAs, staged 8 beyond), so
    first use measures the kernel serving would build without a table; the limits are
    asked of the target (collective on real ranks), register kernel first."""
    asked = []

    class Target:
        def limit(self, threads, unroll):
            asked.append((threads, unroll))
            return {4: 10, 8: 7}[unroll]

    tp, shard = 5, 8 * 2560  # 4 peers x 2560 fragments per row; 10 CTAs x 256 x 4 a round
    few, many = 1, 64  # 0.25 and 16 rounds
    assert firstuse.row_unroll(Target(), few, tp, shard, (256,)) == (4,)
    assert asked == [(256, 4), (256, 4)]
    assert firstuse.row_unroll(Target(), many, tp, shard, (256,)) == (8,)
    assert firstuse.row_unroll(Target(), many, tp, shard, (256, 512)) == (8,)
    assert firstuse.FIRST_USE_LIMITS.unroll is None  # the per-row choice is the default


def test_rows_from_the_vllm_config():
    from lamport_head.engines.vllm import rows_from_vllm
    from lamport_head.table import MAX_ROWS

    def config(seqs, k=None):
        spec = None if k is None else types.SimpleNamespace(num_speculative_tokens=k)
        return types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=seqs),
                                     speculative_config=spec)

    assert rows_from_vllm(config(16)) == tuple(range(1, 17))
    assert rows_from_vllm(config(16, 3)) == tuple(range(1, 65))  # 16 x (1 + 3)
    assert max(rows_from_vllm(config(1024, 2))) == MAX_ROWS
    assert rows_from_vllm(None) is None
    assert rows_from_vllm(config(None)) is None


def test_rows_from_vllms_own_scheduler_config(vllm_release):
    """vLLM's SchedulerConfig (the installed release of the window), in a process of its
    own (importing vLLM here would leave vllm.logger in sys.modules for the tests that
    fake vLLM)."""
    import subprocess
    import sys

    code = (
        "import types\n"
        "from vllm.config import SchedulerConfig\n"
        "from lamport_head.engines.vllm import rows_from_vllm\n"
        "sched = SchedulerConfig(max_num_seqs=48, max_model_len=4096, is_encoder_decoder=False)\n"
        "spec = types.SimpleNamespace(num_speculative_tokens=1)  # SpeculativeConfig needs a model\n"
        "cfg = types.SimpleNamespace(scheduler_config=sched, speculative_config=spec)\n"
        "assert rows_from_vllm(cfg) == tuple(range(1, 97)), rows_from_vllm(cfg)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_sweep_that_built_nothing_writes_nothing_and_the_next_start_measures(tmp_path):
    """Issue 19 item 5: every trial failed (a transient connect failure, say): no
    section is written (it would read as a measured all-stock section for good),
    every rank stays stock with one warning saying why, and the next start measures."""
    cache = str(tmp_path / "cache")
    for r in _start(tmp_path, fail="nobuild", cache=cache):
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        warnings = [x for x in r["log"] if "stays stock" in x]
        assert len(warnings) == 1 and "no configuration could be built and verified" in warnings[0]
        assert "nothing written; the next start measures again" in warnings[0]
    assert not os.path.exists(os.path.join(cache, "head_gather.yaml"))
    for r in _start(tmp_path, cache=cache):
        assert r["served"] == SERVED and r["timed"] > 0  # measured this time, and serves


def test_a_row_that_built_nothing_is_not_written(tmp_path):
    cache = str(tmp_path / "cache")
    for r in _start(tmp_path, fail="nobuild64", cache=cache):
        assert r["served"] == SERVED
    rows = yaml.safe_load(open(os.path.join(cache, "head_gather.yaml")))["devices"]
    section = next(iter(rows.values()))[0]
    assert 64 not in section["rows"] and 32 in section["rows"]
    assert "rows [64] could not be built (not written)" in section["provenance"]["note"]


def test_every_host_gets_the_table_and_later_starts_serve_it(tmp_path):
    """Issue 19 item 4: ranks on two hosts (one NVLink domain: symmetric forced), each
    host its own user table: start 1 measures and both hosts' tables get the section;
    starts 2 and 3 read one view everywhere, measure nothing and serve. The hosts' clocks
    and dates differ: the section, its provenance included, is one value (rank 0's)."""
    env = {"PER_HOST_CACHE": "1", "LAMPORT_HEAD_MAILBOX": "symmetric", "SKEW_CLOCKS": "1"}
    cache = tmp_path / "cache"
    for start in range(3):
        for rank, r in enumerate(_start(tmp_path, env=env, cache=str(cache))):
            assert r["served"] == SERVED and r["routed"] == [FAKE_BYTE], r["log"]
            assert (r["timed"] > 0) == (start == 0)  # measured once, then read
            if start == 0:
                line = next(x for x in r["log"] if "first-use tuning on" in x)
                assert f"wrote {cache / f'host{rank}' / 'head_gather.yaml'}" in line
        tables = [yaml.safe_load((cache / f"host{r}" / "head_gather.yaml").read_text())
                  for r in range(2)]
        assert tables[0]["devices"] == tables[1]["devices"]  # one agreed section


# Issue 40: tables that heal. Each start below is 2 fresh gloo ranks through the real
# install path (install_logits_gather), the kernel a CPU stand-in.

def _aside_lines(r):
    return [x for x in r["log"] if "set aside as" in x]


@pytest.mark.parametrize("cut", [0, 1, 10, 0.25, 0.5, "line", -1])
def test_a_cut_user_table_is_set_aside_measured_again_and_the_next_start_serves(tmp_path, cut):
    """Item 1 and 2: the user table cut anywhere (empty, inside the seal line, mid-line, at
    a line boundary, one byte short) reads as torn on every rank: set aside beside
    itself (one WARNING line naming both paths, every rank), measured again and written
    whole; the start after serves and measures nothing. A cut at a line boundary used
    to serve a smaller table with no warning; any other cut, stock for ever."""
    _start(tmp_path)
    path, data = _user_table(tmp_path)
    whole = path.read_bytes()
    if cut == "line":
        at = whole.rindex(b"\n      16:") + 1  # a valid, smaller table: rows 1-8 only
    else:
        at = int(len(whole) * cut) if isinstance(cut, float) else cut % len(whole)
    path.write_bytes(whole[:at])
    healed = _start(tmp_path)
    asides = sorted(path.parent.glob("head_gather.yaml.broken-*"))
    assert len(asides) == 1 and asides[0].read_bytes() == whole[:at]
    for r in healed:
        assert r["served"] == SERVED and r["rows"] == MEASURED, r["log"]
        (line,) = _aside_lines(r)
        assert f"user table {path} could not be read" in line and str(asides[0]) in line
        assert "torn" in line or "top level" in line  # an empty or seal-cut file: torn too
        assert not any("stays stock" in x for x in r["log"])
    rewritten = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert [s["rows"].keys() for s in rewritten] == [s["rows"].keys()
                                                     for s in data["devices"]["NVIDIA H200"]]
    for r in _start(tmp_path):
        assert r["served"] == SERVED and r["timed"] == 0 and not _aside_lines(r)
        assert not any("WARNING" in x or "could not" in x for x in r["log"])


def test_a_table_torn_on_one_host_only_is_healed_on_the_next_start(tmp_path):
    """Item 1, hosts with a user table each (one NVLink domain): host 1's copy torn, host
    0's whole. The ranks' views differ, yet it costs one start: host 1's copy is set
    aside (host 0 keeps its own), every rank measures, each host writes a whole table,
    and the start after serves everywhere measuring nothing. (Before: the differing
    views took every rank to stock on every start, with no line saying why.)"""
    env = {"PER_HOST_CACHE": "1", "LAMPORT_HEAD_MAILBOX": "symmetric"}
    cache = tmp_path / "cache"
    _start(tmp_path, env=env, cache=str(cache))
    torn = cache / "host1" / "head_gather.yaml"
    whole = torn.read_bytes()
    torn.write_bytes(whole[:300])
    healed = _start(tmp_path, env=env, cache=str(cache))
    for r in healed:
        assert r["served"] == SERVED and r["rows"] == MEASURED, r["log"]
        assert not any("stays stock" in x for x in r["log"]), r["log"]
    assert _aside_lines(healed[0]) == [] and len(_aside_lines(healed[1])) == 1
    assert len(list((cache / "host1").glob("head_gather.yaml.broken-*"))) == 1
    assert not list((cache / "host0").glob("head_gather.yaml.broken-*"))
    for r in _start(tmp_path, env=env, cache=str(cache)):
        assert r["served"] == SERVED and r["timed"] == 0, r["log"]


def test_an_unreadable_user_table_is_set_aside_too(tmp_path):
    """Item 1: a user table that cannot be read at all (a directory in its place)."""
    path, _ = _user_table(tmp_path)
    path.mkdir(parents=True)
    for r in _start(tmp_path):
        assert r["served"] == SERVED and r["rows"] == MEASURED
        (line,) = _aside_lines(r)
        assert "cannot read the table" in line
    assert path.is_file() and len(list(path.parent.glob("head_gather.yaml.broken-*"))) == 1


def test_one_bad_section_costs_that_section_only(tmp_path):
    """Item 1 (and 5): a hand-edited user table (no seal) with one section the loader
    rejects (ctas 0): the file's other section serves, measuring nothing, with one line
    naming the bad section and what to do; the model whose section it was measures it
    again and the writer drops the bad one."""
    _start(tmp_path)  # V = 128
    _start(tmp_path, shard=96)  # V = 192
    path, _ = _user_table(tmp_path)
    text = path.read_text().split("\n", 1)[1]  # edited by hand: no seal
    head, tail = text.split("vocab: 192", 1)
    path.write_text(head + "vocab: 192" + tail.replace("ctas: 16,", "ctas: 0,", 1))
    for r in _start(tmp_path):
        assert r["served"] == SERVED and r["timed"] == 0, r["log"]
        (line,) = [x for x in r["log"] if "HEAD_GATHER table:" in x]
        assert "ctas must be an int in [1, 1024], got 0" in line and "tp=2" in line
        assert "other sections serve" in line and not _aside_lines(r)
    for r in _start(tmp_path, shard=96):
        assert r["served"] == SERVED and r["rows"] == MEASURED
    assert [s["vocab"] for s in _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]] == [128, 192]
    for shard in (64, 96):
        assert all(r["timed"] == 0 and r["served"] == SERVED
                   for r in _start(tmp_path, shard=shard))


@pytest.mark.parametrize("bad", ["torn", "missing", "bounds"])
def test_a_broken_lamport_head_table_is_refused_never_moved_and_the_layers_below_serve(
        tmp_path, bad):
    """Item 1: ``LAMPORT_HEAD_TABLE`` (a file a person named) is never set aside: one
    line naming it and what to fix, and the user table below it serves (it used to be
    every rank's vote reason: stock)."""
    _start(tmp_path)
    user, _ = _user_table(tmp_path)
    named = tmp_path / "named.yaml"
    if bad == "torn":
        named.write_bytes(user.read_bytes()[:500])
    elif bad == "bounds":  # tp beyond one NVLink domain, and a non-finite timing
        named.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n    - {tp: 4096, rows: {1: "
                         "{ctas: 8, enabled: true}}}\n    - {tp: 2, vocab: 128, rows: {1: "
                         "{ctas: 8, enabled: true, stock_us: .inf}}}\n")
    before = named.read_bytes() if named.exists() else None
    for r in _start(tmp_path, env={"LAMPORT_HEAD_TABLE": str(named)}):
        assert r["served"] == SERVED and r["timed"] == 0, r["log"]
        lines = [x for x in r["log"] if "HEAD_GATHER table:" in x]
        assert lines and all(str(named) in x and "unset LAMPORT_HEAD_TABLE" in x for x in lines)
        assert len(lines) == (2 if bad == "bounds" else 1)
        assert not _aside_lines(r)
    assert (named.read_bytes() if named.exists() else None) == before
    assert not list(tmp_path.glob("named.yaml.broken-*"))


# Issue 49 item 4: a broken user table costs only itself. Each start below: 2 fresh gloo
# ranks through the real install path, the user table torn (cut) after a first start
# wrote it; NAMED a table LAMPORT_HEAD_TABLE names, holding a section for this key (V =
# 128: rows 1-2 and 4 enabled) and for V = 192 (the second model's).
NAMED = sections((128, 192))


def _torn_user_table(tmp_path):
    """A first start writes the user table; then it is cut (torn). Its path and why a
    reader refuses it."""
    _start(tmp_path)
    path, _ = _user_table(tmp_path)
    path.write_bytes(path.read_bytes()[:300])
    why = ("torn: the writer sealed {} bytes after the seal line, {} are there (cut short "
           "by a crash or a full disk?)")
    return path, why


def _named(tmp_path):
    named = tmp_path / "named.yaml"
    named.write_text(NAMED)
    return str(named)


SET_ASIDE = "lamport-head: the user table {path} could not be read ({path}: {why}); set aside as "
NEXT = {
    "named": "the other layers serve the logits gather (their section for this key)",
    "tune": "first-use tuning measures the logits gather again and writes a fresh table",
    "off": ("no other layer holds a section for the logits gather and first-use tuning is off "
            "(LAMPORT_HEAD_AUTOTUNE=0): it stays stock until `lamport-head tune` writes a "
            "table"),
}


@pytest.mark.parametrize("case", ["named", "tune", "off"])
def test_a_torn_user_table_is_set_aside_and_the_other_layers_keep_serving(tmp_path, case):
    """The torn copy is set aside (every rank agreeing) and every rank serves from the
    other layers alike, never less: with LAMPORT_HEAD_AUTOTUNE=0 a named table's section
    serves its rows on every rank (it used to serve nothing: every layer of the key was
    cleared, and the line said "first-use tuning measures again"). The one warning says
    what happens next: the other layers serve; first-use tuning measures again; or, off
    and with no other layer holding the key, stock until a table is written."""
    path, why = _torn_user_table(tmp_path)
    torn = path.read_bytes()
    env = {"LAMPORT_HEAD_AUTOTUNE": "0" if case in ("named", "off") else "1"}
    if case == "named":
        env["LAMPORT_HEAD_TABLE"] = _named(tmp_path)
    results = _start(tmp_path, env=env)
    (aside,) = path.parent.glob("head_gather.yaml.broken-*")
    assert aside.read_bytes() == torn
    for r in results:
        assert r["served"] == {"named": [1, 2, 4], "tune": SERVED, "off": []}[case], r["log"]
        assert r["rows"] == (MEASURED if case == "tune" else [])  # measured only then
        size = int(torn.split(b" of the ")[1].split(b" bytes")[0])
        line = (SET_ASIDE.format(path=path, why=why.format(size, len(torn.split(b"\n", 1)[1])))
                + f"{aside}; {NEXT[case]}")
        assert r["warned"] == [line], r["warned"]


def test_an_env_named_table_beside_a_torn_user_table_serves_on_every_rank_every_start(
        tmp_path):
    """The issue's case, start after start, with first-use tuning off: a torn user table
    in a read-only cache (it cannot be set aside, so every start meets it) and a table
    named by LAMPORT_HEAD_TABLE. Every start serves the named table's rows on every rank,
    for both models of the start (each install meets the torn copy), with one warning a
    start saying the copy is ignored and what happens next; the copy stays as it was."""
    path, _ = _torn_user_table(tmp_path)
    torn = path.read_bytes()
    env = {"LAMPORT_HEAD_AUTOTUNE": "0", "LAMPORT_HEAD_TABLE": _named(tmp_path),
           "READ_ONLY_CACHE": "1", "SECOND_MODEL": "1"}
    for _ in range(2):
        for r in _start(tmp_path, env=env):
            assert r["served"] == [1, 2, 4] and r["second"] == [1, 2, 4], r["log"]
            assert r["routed"] == [FAKE_BYTE] and r["timed"] == 0
            (line,) = r["warned"]
            assert line.startswith(f"lamport-head: the user table {path} could not be read (")
            assert line.endswith(
                ") nor set aside (OSError: Read-only file system): every rank ignores it, on "
                f"every start until it is fixed or removed; {NEXT['named']}"), line
    assert path.read_bytes() == torn and not list(path.parent.glob("head_gather.yaml.broken-*"))


def test_a_torn_table_in_a_read_only_cache_costs_one_warning_a_start(tmp_path):
    """First-use tuning on and no other layer holding the key: every start measures and
    serves what it measured (it cannot save it), with one warning a start, the torn
    copy's, saying so (first-use tuning's own "could not save" line would be a second)."""
    path, _ = _torn_user_table(tmp_path)
    for _ in range(2):
        for r in _start(tmp_path, env={"READ_ONLY_CACHE": "1"}):
            assert r["served"] == SERVED and r["rows"] == MEASURED, r["log"]
            (line,) = r["warned"]
            assert line.endswith(
                ") nor set aside (OSError: Read-only file system): every rank ignores it, on "
                "every start until it is fixed or removed; first-use tuning measures the "
                "logits gather and serves it on this start, but cannot save it while the cache "
                "is not writable: every start measures again"), line
            assert any("wrote nothing (could not save" in x for x in r["log"])


def test_a_cache_that_cannot_be_written_serves_what_it_measured(tmp_path):
    """Item 3: the measured, agreed rows are served on this start by every rank, with one
    line saying the table could not be saved and why (they used to be thrown away:
    stock); the next start measures again."""
    (tmp_path / "blocked").write_text("")
    cache = str(tmp_path / "blocked" / "cache")  # under a file: no directory can be made
    for _ in range(2):
        for r in _start(tmp_path, cache=cache):
            assert r["served"] == SERVED and r["rows"] == MEASURED and r["routed"] == [FAKE_BYTE]
            (line,) = [x for x in r["log"] if "could not save" in x and "WARNING" not in x
                       and "measured rows" in x and "serves them" in x]
            assert "NotADirectoryError" in line and "the next start measures again" in line
            assert not any("stays stock" in x for x in r["log"])


@pytest.mark.parametrize("umask, mode", [("022", 0o644), ("027", 0o640)])
def test_the_user_table_is_written_durably_and_its_mode_follows_the_umask(tmp_path, umask,
                                                                          mode):
    """Item 3: fsync of the file, of its directory before the rename and after it; the
    mode what the umask gives (mkstemp's 0600 locked other users out)."""
    results = _start(tmp_path, env={"UMASK": umask, "TRACE_IO": "1"})
    path, _ = _user_table(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    writer = results[0]["io"]
    assert writer == [["fsync", "file"], ["fsync", "dir"], ["replace", "head_gather.yaml"],
                      ["fsync", "dir"]], writer
    assert results[1]["io"] == []  # one writer per host


def test_first_use_stops_measuring_on_rank_0s_clock(tmp_path):
    """Item 6: rank 1's clock runs far ahead; rank 0's broadcast decides when to stop,
    so both ranks measure every row count together. A rank stopping by its own clock
    would leave its peer alone in the next row's collectives (the gloo timeout fails
    the start)."""
    for r in _start(tmp_path, fail="clock@1", timeout_s=20):
        assert r["served"] == SERVED and r["rows"] == MEASURED, r["log"]


def test_a_newer_schema_section_is_kept_and_this_version_measures_beside_it(tmp_path):
    """Item 4: a section written by a newer lamport-head (``schema: 2``, a new row knob,
    a new provenance key) is skipped with one line, kept in the file, and this version
    measures its own section beside it once."""
    path, _ = _user_table(tmp_path)
    path.parent.mkdir(parents=True)
    newer = ("schema: 2\ndevices:\n  NVIDIA H200:\n    - tp: 2\n      vocab: 128\n"
             "      provenance: {gpu: NVIDIA H200, fabric: nvl72}\n"
             "      rows:\n        1: {ctas: 8, enabled: true, warp_split: 2}\n")
    path.write_text(newer)
    for r in _start(tmp_path):
        assert r["served"] == SERVED and r["rows"] == MEASURED, r["log"]
        (line,) = [x for x in r["log"] if "HEAD_GATHER table:" in x]
        assert "schema 2, newer than this lamport-head reads (1)" in line
        assert not _aside_lines(r)
    sections = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert [s.get("schema") for s in sections] == [None, 2]
    assert sections[1]["rows"][1]["warp_split"] == 2
    for r in _start(tmp_path):
        assert r["served"] == SERVED and r["timed"] == 0


def test_two_environments_sharing_one_user_table_each_measure_once(tmp_path):
    """Item 4: two environments (another torch and lamport-head) on one host share the
    default user table. Each measures once and keeps its own version of the section
    beside the other's; later starts of either measure nothing (each used to see the
    other's section as stale and re-measure on every start)."""
    other = dict(FACTS, torch="2.14.0", lamport_head="0.4.0")
    for facts in (FACTS, other):
        assert all(r["rows"] == MEASURED for r in _start(tmp_path, facts=facts))
    for facts in (FACTS, other, FACTS, other):
        for r in _start(tmp_path, facts=facts):
            assert r["served"] == SERVED and r["timed"] == 0, r["log"]
    sections = _user_table(tmp_path)[1]["devices"]["NVIDIA H200"]
    assert sorted(s["provenance"]["torch"] for s in sections) == ["2.13.0", "2.14.0"]
