"""Tables and first-use tuning for the all-to-all of vocab shards (issue 43 item 2), on
2-rank gloo groups, no GPU.

- The splits a row count M is verified and timed with (``support.splits.vllm_splits``):
  deterministic, M in all, uneven, ranks of 0 rows at small M, as vLLM's batch sharding.
- First use through the install core at a site whose stock is vLLM's all-to-all, the
  timing a collective cost model (``helpers.CollectiveTarget``), on by default
  (``LAMPORT_HEAD_ALL_TO_ALL=0`` switches it off, issue 49): the
  target is made for the all-to-all against the site's callable, the section written has
  stock ``nccl-all-to-all`` and the rows measured, serving builds the all-to-all
  (``helpers.StandInAllToAll``), a second start switched off serves that
  section and measures nothing, every rank agrees. Switched off with no section,
  nothing is measured or built and every rank keeps the engine's all-to-all.
- First use on the real ``AllToAllTarget`` with the kernel's CPU stand-in
  (tests/cpu_kernel.py: real ipc mailboxes) and the CUDA timing machinery as no-ops
  (``helpers.fake_timing``): every configuration verified bitwise on every rank, the
  engine's all-to-all called with splits summing to M (uneven, an empty rank); a
  stand-in corrupting one rank's bytes fails verification on every rank together and
  nothing is written.
- The tuner's stock stand-in (``StockAllToAll``) is vLLM's ``all_to_all_vocab_shards``.
- ``lamport-head tune --all-to-all`` under torchrun (2 gloo ranks, a cost model):
  its section beside the gather's, its studies keyed apart.
"""

import os
import types

import pytest
import torch
import yaml
from helpers import (CollectiveTarget, StandInAllToAll, capture_log, fake_cuda, fake_timing,
                     forced_build, same_bits)
from spawn import spawn

from lamport_head.table import ALL_TO_ALL_STOCK, NCCL_STOCK, load_table
from lamport_head.tuning.support.splits import vllm_splits

SHARD = 64  # BF16 a rank: V = 128 on 2 ranks
ROWS = list(range(1, 9))  # the step's total M asked for: measured 1, 2, 4, 8
MEASURED = [1, 2, 4, 8]
FACTS = {"driver": "580.1", "cuda": "13.0", "torch": "2.13.0", "cutlass_dsl": "4.8.0",
         "lamport_head": "0.5.0", "kernel": "abcdef123456"}


def _engine_all_to_all(shard, send_splits, num_local_rows):
    """vLLM 0.34's ``all_to_all_vocab_shards`` (its torch.distributed branch) on the
    default group: the engine's own stock at the site."""
    import torch.distributed as dist

    tp = len(send_splits)
    recv = shard.new_empty(tp * num_local_rows, shard.shape[-1])
    dist.all_to_all_single(recv, shard.contiguous(), output_split_sizes=[num_local_rows] * tp,
                           input_split_sizes=send_splits)
    width = recv.shape[-1]
    return (recv.view(tp, num_local_rows, width).permute(1, 0, 2)
            .reshape(num_local_rows, tp * width))


def _exchanged(shards, splits, rank):
    """Rank ``rank``'s rows of every shard, in rank order along the vocab axis, bytes
    as they are (no scrub: what NCCL's all-to-all delivers)."""
    at = [sum(splits[:q]) for q in range(len(splits) + 1)]
    return torch.cat(shards, dim=1)[at[rank]:at[rank + 1]]


def _shards(seed, tp, rows):
    from lamport_head.tuning.support.reference import planted

    return list(planted(tp, rows, SHARD, generator=torch.Generator().manual_seed(seed)))


def test_vllms_splits_are_deterministic_sum_to_m_uneven_with_empty_ranks_at_small_m():
    """Requests of 1-4 rows dealt round-robin: every draw sums to M over TP ranks, the
    same in every call (pinned: a process draws what another does); at M < TP ranks
    have 0 rows; larger M splits unevenly; other draws are other steps."""
    assert vllm_splits(4, 2) == [1, 3] and vllm_splits(8, 8) == [0, 0, 0, 0, 2, 1, 4, 1]
    kinds = set()
    for tp in (2, 3, 4, 8):
        for m in range(1, 129):
            for draw in range(3):
                splits = vllm_splits(m, tp, draw)
                assert splits == vllm_splits(m, tp, draw)
                assert len(splits) == tp and sum(splits) == m and min(splits) >= 0
                if m < tp:
                    assert 0 in splits
                if min(splits) > 0:
                    kinds.add("even" if len(set(splits)) == 1 else "uneven")
                else:
                    kinds.add("empty")
        large = [vllm_splits(m, tp) for m in range(4 * tp, 129)]
        assert sum(len(set(s)) > 1 for s in large) > 0.8 * len(large)  # mostly uneven
        assert len({tuple(vllm_splits(64, tp, d)) for d in range(3)}) > 1
    assert kinds == {"even", "uneven", "empty"}


def _install_worker(rank, tp, cache, asked=True, facts=FACTS):
    """One server start: the install core at a site whose stock is vLLM's all-to-all,
    first-use tuning on (its timing a cost model), the all-to-all's first-use tuning
    left on (the default) or switched off (``LAMPORT_HEAD_ALL_TO_ALL=0``), then a call of a served M and one
    past the rows through the routed site."""
    from lamport_head import install, mailbox, provenance
    from lamport_head.outcome import Ranks
    from lamport_head.tuning import firstuse

    os.environ.pop("LAMPORT_HEAD_TABLE", None)
    os.environ.update(LAMPORT_HEAD_AUTOTUNE="1", LAMPORT_HEAD_CACHE=cache)
    if asked:  # the default
        os.environ.pop("LAMPORT_HEAD_ALL_TO_ALL", None)
    else:
        os.environ["LAMPORT_HEAD_ALL_TO_ALL"] = "0"
    fake_cuda(setattr, rank, "ok")
    forced_build(install)  # serving's all-to-all: StandInAllToAll (its own collective)
    builds, build = [], install._build
    install._build = lambda *a, **k: (builds.append(k.get("stock")), build(*a, **k))[1]
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")  # a GPU a rank
    provenance.facts = lambda: dict(facts)
    timed, made, engine_calls = [], [], []

    def engine(shard, send_splits, num_local_rows):
        engine_calls.append([shard.shape[0], list(send_splits), num_local_rows])
        return _engine_all_to_all(shard, send_splits, num_local_rows)

    def make_target(ranks, vocab, limits=firstuse.FIRST_USE_LIMITS, stock=None,
                    dtype="bfloat16", *, stock_kind=NCCL_STOCK):
        made.append([stock_kind, stock is engine, dtype, vocab])
        return CollectiveTarget(ranks, vocab, "", timed)

    firstuse.make_target = make_target
    log = capture_log()
    processor = types.SimpleNamespace(all_to_all=engine)
    site = install.GatherSite(processor, "all_to_all", torch.zeros(SHARD, 16, dtype=torch.bfloat16),
                              tp, "the test's sampler", stock=ALL_TO_ALL_STOCK)
    outcome = install.install(site, Ranks(None, tp, rank, "cpu"), ROWS, measure=firstuse.measure)
    from lamport_head.tuning.support.reference import reference_all_to_all

    served = {}
    for m in (max(ROWS), max(ROWS) + 1):  # served; past the rows: the engine's own
        splits = vllm_splits(m, tp)
        shards = _shards(m, tp, m)
        got = processor.all_to_all(shards[rank], splits, splits[rank])
        # served: the protocol's bytes (sentinel words arrive as 0); else NCCL's, as sent
        want = (reference_all_to_all(shards, splits)[rank] if m in ROWS
                else _exchanged(shards, splits, rank))
        served[m] = same_bits(got, want)
    gather = getattr(processor, "head_gather", None)
    return {"rows": list(outcome.rows), "asked": made, "timed": sorted({m for m, _ in timed}),
            "class": type(gather).__name__, "served": served,
            "calls": None if gather is None else [list(c) for c in gather.calls],
            "engine": engine_calls, "measured": [x for x in log if "first-use tuning" in x],
            "reason": outcome.reason and outcome.reason.label, "message": outcome.message,
            "builds": builds, "log": log}


def _table(cache):
    path = cache / "head_gather.yaml"
    return path, yaml.safe_load(path.read_text())


def test_first_use_tuning_of_the_all_to_all_writes_its_section_and_serves_it(tmp_path):
    cache = tmp_path / "cache"
    run = tmp_path / "run0"
    run.mkdir()
    first = spawn(_install_worker, 2, run, str(cache))
    for rank, r in enumerate(first):
        assert r["asked"] == [[ALL_TO_ALL_STOCK, True, "bfloat16", 2 * SHARD]]  # the site's own
        assert r["timed"] == MEASURED and r["rows"] == ROWS  # the cost model wins to 16 rows
        assert r["class"] == StandInAllToAll.__name__
        assert r["served"] == {"8": True, "9": True}
        assert r["calls"] == [[8, vllm_splits(8, 2)]]  # M = 9 took the engine's
        assert r["engine"] == [[9, vllm_splits(9, 2), vllm_splits(9, 2)[rank]]]
        assert len(r["measured"]) == 1 and "measured rows [1, 2, 4, 8]" in r["measured"][0]
    assert first[0]["rows"] == first[1]["rows"] and first[0]["calls"] == first[1]["calls"]
    path, data = _table(cache)
    (section,) = data["devices"]["NVIDIA H200"]
    assert (section["stock"], section["vocab"], section["tp"], section["emulated"]) == (
        ALL_TO_ALL_STOCK, 2 * SHARD, 2, False)
    assert list(section["rows"]) == MEASURED and all(e["enabled"] for e in section["rows"].values())
    table = load_table(path)  # served to the all-to-all only, never to a gather
    assert sorted(table.entries("NVIDIA H200", 2, vocab=2 * SHARD, stock=ALL_TO_ALL_STOCK)) == ROWS
    assert table.section("NVIDIA H200", 2, 1, vocab=2 * SHARD, stock=NCCL_STOCK) is None

    run = tmp_path / "run1"
    run.mkdir()
    # a second start, switched off (=0): the section (a table layer's) turns it on, and
    # it measures nothing
    for r in spawn(_install_worker, 2, run, str(cache), False):
        assert r["asked"] == [] and r["timed"] == [] and r["measured"] == []
        assert r["rows"] == ROWS and r["served"] == {"8": True, "9": True}
        assert r["builds"] == [ALL_TO_ALL_STOCK]
    assert _table(cache)[1] == data

    run = tmp_path / "run2"
    run.mkdir()
    # another environment (torch), switched off: the section (stale here) still
    # turns it on, so first-use tuning measures this environment's version beside it
    other = dict(FACTS, torch="2.14.0")
    for r in spawn(_install_worker, 2, run, str(cache), False, other):
        assert r["asked"] == [[ALL_TO_ALL_STOCK, True, "bfloat16", 2 * SHARD]]
        assert r["timed"] == MEASURED and r["rows"] == ROWS
    assert sorted(s["provenance"]["torch"] for s in _table(cache)[1]["devices"]["NVIDIA H200"]) \
        == ["2.13.0", "2.14.0"]


def test_the_all_to_all_switched_off_stays_stock_where_no_table_holds_its_section(tmp_path):
    """Issue 49 item 3: with first-use tuning on, ``LAMPORT_HEAD_ALL_TO_ALL=0`` and no
    section for its key, every
    rank keeps the engine's all-to-all: no target made, nothing timed or built, nothing
    written, every call the engine's own; the outcome says why and how to turn it on."""
    cache = tmp_path / "cache"
    for rank, r in enumerate(spawn(_install_worker, 2, tmp_path, str(cache), False)):
        assert r["rows"] == [] and r["reason"] == "switched-off"
        assert r["message"] == (
            "first-use tuning of the all-to-all is switched off (LAMPORT_HEAD_ALL_TO_ALL=0) and "
            f"no table holds a section for NVIDIA H200, tp=2, dcp=1, vocab={2 * SHARD}, "
            f"stock={ALL_TO_ALL_STOCK}, dtype=bfloat16; to turn it on, unset "
            "LAMPORT_HEAD_ALL_TO_ALL on every rank (first-use tuning then measures it) or "
            "tune it into a table (`lamport-head tune --all-to-all` under torchrun)")
        assert r["asked"] == [] and r["timed"] == [] and r["builds"] == []
        assert r["class"] == "NoneType" and r["calls"] is None
        assert not any("measured rows" in x for x in r["log"])
        assert r["engine"] == [[m, vllm_splits(m, 2), vllm_splits(m, 2)[rank]] for m in (8, 9)]
        assert [x for x in r["log"] if "[switched-off]" in x] == [
            f"lamport-head: stock all-to-all: {r['message']} [switched-off]"]
    assert not (cache / "head_gather.yaml").exists()


def _measure_worker(rank, tp, cache, corrupt):
    """First-use tuning's measuring on the real ``AllToAllTarget`` (the kernel: the CPU
    stand-in over real ipc mailboxes; ``corrupt``: rank 1's stand-in flips a bit of the
    last word of its shard before it sends, so the rank receiving that row holds a
    wrong word) against the engine's all-to-all."""
    import cpu_kernel

    from lamport_head import mailbox, provenance
    from lamport_head.collective import raised_together
    from lamport_head.tuning import firstuse

    os.environ.update(LAMPORT_HEAD_CACHE=cache)
    toolchain = cpu_kernel.use()
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")  # a GPU a rank, one host: ipc
    fake_timing()
    provenance.facts = lambda: dict(FACTS)
    if corrupt and rank == 1:
        launch = cpu_kernel.Launch.__call__

        def corrupted(self, shard, *args):
            bad = shard.clone()
            bad.view(torch.int32).view(-1)[-1] ^= 1
            return launch(self, bad, *args)

        cpu_kernel.Launch.__call__ = corrupted
    engine_calls = []

    def engine(shard, send_splits, num_local_rows):
        engine_calls.append([shard.shape[0], list(send_splits), num_local_rows])
        return _engine_all_to_all(shard, send_splits, num_local_rows)

    # no wall-clock stop: every row count measured however slow this machine is
    limits = firstuse.FirstUseLimits(seconds=600.0, ctas=(8, 16), threads=(256,), unroll=(4,),
                                     calls=2, reps=1, replays=1)
    out = {"engine": engine_calls}
    try:
        outcome = firstuse.measure(None, "cpu", tp, rank, 1, SHARD, ROWS, False, "NVIDIA H200",
                                   limits=limits, stock=engine, stock_kind=ALL_TO_ALL_STOCK)
        out["trials"] = [[r.rows, r.trials] for r in outcome.results]
    except Exception as exc:
        out["raised"] = [f"{type(exc).__name__}: {exc}", raised_together(exc)]
    out["offsets"] = [list(o) for launch in toolchain.launches for o in launch.calls]
    return out


def test_the_real_target_verifies_every_configuration_bitwise_against_the_engines_all_to_all(
        tmp_path):
    results = spawn(_measure_worker, 2, tmp_path, str(tmp_path / "cache"), False)
    for rank, r in enumerate(results):
        assert r["trials"] == [[m, 2] for m in MEASURED], r  # every configuration verified
        # the engine's all-to-all timed at every row count, with the splits of that M
        assert sorted({m for m, _, _ in r["engine"]}) == MEASURED
        for m, splits, local in r["engine"]:
            assert sum(splits) == m and local == splits[rank] and splits == vllm_splits(m, 2)
        assert any(0 in s for _, s, _ in r["engine"])  # a rank of 0 rows
        assert any(min(s) > 0 and len(set(s)) > 1 for _, s, _ in r["engine"])  # uneven
        # the kernel's offsets: the splits' prefix sums, an empty rank among them
        assert any(o[1] in (o[0], o[2]) for o in r["offsets"]) and r["offsets"]
    assert results[0]["engine"] == [[m, s, s[0]] for m, s, _ in results[1]["engine"]]
    assert results[0]["offsets"] == results[1]["offsets"]  # the same splits on every rank
    _, data = _table(tmp_path / "cache")
    (section,) = data["devices"]["NVIDIA H200"]
    assert section["stock"] == ALL_TO_ALL_STOCK and list(section["rows"]) == MEASURED


def test_a_corrupted_kernel_fails_verification_on_every_rank_together(tmp_path):
    results = spawn(_measure_worker, 2, tmp_path, str(tmp_path / "cache"), True)
    for r in results:
        message, together = r["raised"]
        assert message.startswith("RuntimeError: no configuration could be built and verified "
                                  "for rows [1, 2, 4, 8]"), message
        assert together  # every rank raised at the same step: install leaves all stock
    assert not (tmp_path / "cache" / "head_gather.yaml").exists()


def _stock_worker(rank, tp):
    """The tuner's stand-in, one buffer set for M = 8, against the engine's all-to-all
    and the plain exchange, over splits of several kinds, one call after another."""
    from lamport_head.tuning.support.stock import StockAllToAll

    stock = StockAllToAll(8, SHARD)
    same = []
    for call, splits in enumerate(([8, 0], [0, 8], [3, 5], [4, 4], vllm_splits(8, 2, 1))):
        shards = _shards(call, tp, 8)
        got = stock(shards[rank], splits, splits[rank]).clone()
        same.append([same_bits(got, _engine_all_to_all(shards[rank], splits, splits[rank])),
                     same_bits(got, _exchanged(shards, splits, rank))])
    try:
        stock(_shards(0, tp, 8)[rank], [8, 0], 9)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"same": same, "refused": refused}


def test_the_tuners_stock_all_to_all_is_vllms(tmp_path):
    for r in spawn(_stock_worker, 2, tmp_path):
        assert r["same"] == [[True, True]] * 5
        assert "at most 8 rows a rank" in r["refused"]


def _tune_worker(rank, world, out):
    """``lamport-head tune --all-to-all``, then the gather's ``tune``, into one table,
    under "torchrun" (this gloo group), the targets a collective cost model."""
    import lamport_head.tuning.support.procs as procs
    from lamport_head import cli
    from lamport_head.tuning import harness
    from lamport_head.tuning.support.procs import Ranks

    os.environ["WORLD_SIZE"] = str(world)
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200"
    ranks = Ranks(torch.device("cpu"), rank, world, False, "gloo")
    procs.init_ranks = lambda: ranks
    made = []
    for kind, name in (("all-to-all", "AllToAllTarget"), ("gather", "DistributedTarget")):
        setattr(harness, name, lambda r, vocab, dtype, kind=kind: (
            made.append(kind), CollectiveTarget(r, vocab, "", []))[1])
    argv = ["tune", "--tp", str(world), "--rows", "1,4", "--trials", "4", "--quiet", "--out", out]
    codes = [cli.main(argv[:1] + ["--all-to-all"] + argv[1:]), cli.main(argv),
             cli.main(argv[:1] + ["--all-to-all"] + argv[1:])]  # again: resumes its own studies
    return {"codes": codes, "made": made}


def test_tune_all_to_all_writes_its_section_beside_the_gathers(tmp_path):
    import optuna

    out = tmp_path / "t.yaml"
    results = spawn(_tune_worker, 2, tmp_path, str(out))
    for r in results:
        assert r == {"codes": [0, 0, 0], "made": ["all-to-all", "gather", "all-to-all"]}
    sections = yaml.safe_load(out.read_text())["devices"]["NVIDIA H200"]
    assert [s["stock"] for s in sections] == [NCCL_STOCK, ALL_TO_ALL_STOCK]
    assert all(list(s["rows"]) == [1, 4] for s in sections)
    assert "--all-to-all" in sections[1]["provenance"]["command"]
    names = [s.study_name for s in optuna.get_all_study_summaries(
        f"sqlite:///{tmp_path / 't.optuna.db'}")]
    assert sum(f"|{ALL_TO_ALL_STOCK}|" in n for n in names) == 2 and len(names) == 4


@pytest.mark.parametrize("argv", [["tune", "--all-to-all", "--emulate"],
                                  ["tune", "--all-to-all", "--auto"]])
def test_tune_all_to_all_refuses_emulated_ranks(argv, monkeypatch, capsys):
    """No emulated all-to-all: --emulate is refused before any GPU is looked for, and
    --auto on one GPU (which emulates) the same way."""
    from lamport_head import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == ("lamport-head: tune: --all-to-all is timed on real ranks "
                                       "only (torchrun): no --emulate\n")


def test_one_process_cannot_time_the_all_to_all():
    """The target's choice (``targets.make_target``): one process has no all-to-all to
    time (no emulated one), whatever the command."""
    from lamport_head.tuning.targets import make_target

    for command, emulate in (("tune", False), ("bench", None)):
        with pytest.raises(SystemExit, match=rf"^lamport-head {command}: the all-to-all is timed "
                           r"on real ranks only \(no emulated all-to-all\): torchrun "
                           r"--nproc-per-node TP$"):
            make_target(command, 2, 2 * SHARD, emulate=emulate, stock=ALL_TO_ALL_STOCK)
