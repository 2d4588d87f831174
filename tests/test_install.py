"""install_logits_gather on a 2-rank gloo group with vLLM-shaped stand-ins: every
check, the MIN agreement (one rank failing construction leaves both stock), the
instance-attribute routing, LAMPORT_HEAD_DISABLE, and `()` on a CPU device."""

import os
import types

import pytest
import torch
import torch.distributed as dist
from helpers import FAKE_BYTE, capture_log, fake_cuda, model
from spawn import spawn
from tables import TWO_RANKS as TABLE
from tables import TWO_RANKS_VOCABS, sections

from lamport_head import install
from lamport_head.engines.vllm import install_logits_gather


def _install_worker(rank, nprocs, table, case, other_table):
    os.environ["LAMPORT_HEAD_TABLE"] = other_table if (case == "table@1" and rank == 1) else table
    if case == "disable@1" and rank == 1:  # the variable reached one rank only
        os.environ["LAMPORT_HEAD_DISABLE"] = "1"
    if case.startswith("budget=") and rank == 1:  # a spin budget set on one rank only
        os.environ["LAMPORT_HEAD_BUDGET_S"] = case.removeprefix("budget=")
    if case == "budget everywhere":
        os.environ["LAMPORT_HEAD_BUDGET_S"] = "0.75"
    fake_cuda(setattr, rank, case)
    seen = capture_log()
    m = model(lm__tp_size=nprocs)
    other = model(lm__tp_size=nprocs)
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    again = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    routed = m.logits_processor._gather_logits(x)
    routed = (sorted(set(routed.view(torch.uint8).flatten().tolist())) if torch.is_tensor(routed)
              else routed)
    g = getattr(m.logits_processor, "head_gather", None)
    return {"served": list(served), "again": list(again), "routed": routed,
            "mode": g and g.mode, "budget_ns": g and g.budget_ns,
            "unrouted": m.logits_processor._gather_logits(torch.zeros(3, 64, dtype=torch.bfloat16)),
            "other": other.logits_processor._gather_logits(torch.zeros(1, 64)), "log": seen}


def _table(tp):
    """TWO_RANKS at ``tp``: its sections whose vocabulary ``tp`` divides (the loader
    rejects the others: V is TP x the shard width)."""
    return sections([v for v in TWO_RANKS_VOCABS if v % tp == 0]).replace("tp: 2", f"tp: {tp}")


def _run(tmp_path, case, nprocs=2, other=None):
    table = tmp_path / "t.yaml"
    table.write_text(_table(nprocs))
    other_table = tmp_path / "other.yaml"
    other_table.write_text(other or "schema: 1\ndevices: {NVIDIA H200: [{tp: 9, rows: {1: "
                                    "{ctas: 1, enabled: on}}}]}\n")
    return spawn(_install_worker, nprocs, tmp_path, str(table), case, str(other_table))


@pytest.mark.parametrize("nprocs", [2, 3])
def test_install_serves_enabled_rows_on_every_rank(tmp_path, nprocs):
    for r in _run(tmp_path, "ok", nprocs):
        assert r["served"] == [1, 2, 4] and r["again"] == [1, 2, 4]
        assert r["routed"] == [FAKE_BYTE]  # the (fake) kernel wrote the output
        assert r["unrouted"] == ["stock", 3]  # rows 3 are disabled: HeadGather takes stock
        assert r["other"] == ["stock", 1]  # another processor keeps its gather
        # what install builds for engines: a give-up stops the context; 10 s unless set
        assert r["mode"] == "serving" and r["budget_ns"] == 10 * 10**9


def test_the_spin_budget_is_the_users_setting_agreed_and_logged(tmp_path):
    for r in _run(tmp_path, "budget everywhere", nprocs=2):
        assert r["served"] == [1, 2, 4] and r["budget_ns"] == 750_000_000
        assert ("spin budget 0.75 s (LAMPORT_HEAD_BUDGET_S), agreed by every rank; a give-up "
                "stops the GPU context") in r["log"][-1]


@pytest.mark.parametrize("value,why", [
    ("5", "different HEAD_GATHER plans"),  # set on one rank only: never two budgets
    ("soon", "rank 1: LAMPORT_HEAD_BUDGET_S='soon': expected seconds in (0, 3600]"),
    ("0", "rank 1: LAMPORT_HEAD_BUDGET_S='0': expected seconds in (0, 3600]"),
])
def test_a_spin_budget_one_rank_reads_otherwise_takes_every_rank_to_stock(tmp_path, value, why):
    for r in _run(tmp_path, f"budget={value}", nprocs=2):
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        assert why.removeprefix("rank 1: ") in r["log"][-1], r["log"]


@pytest.mark.parametrize("case,cause", [
    ("prepare@1", "RuntimeError: compile failed"),
    ("alloc@2", "MemoryError: injected: mailbox allocation refused"),
    ("connect@0", "RuntimeError: cannot map a peer"),
])
def test_one_rank_failing_any_step_leaves_every_rank_stock(tmp_path, case, cause):
    """Item: a failure on one rank during install hangs no peer (the spawn deadline
    fails a hang) and takes every rank to stock, the failing rank naming its cause."""
    results = _run(tmp_path, case, nprocs=3)
    failing = int(case.split("@")[1])
    for rank, r in enumerate(results):
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        warnings = [line for line in r["log"] if "stays stock" in line]
        assert len(warnings) == 2  # one per install attempt (the worker tries twice)
        if rank == failing:
            assert cause in warnings[-1]
        else:
            assert "another rank failed" in warnings[-1]


def test_a_rank_whose_table_is_broken_takes_every_rank_to_stock(tmp_path):
    """Rank 1's LAMPORT_HEAD_TABLE cannot be read: refused in one line naming it and
    what to fix (issue 40: the layers below serve), so rank 1 resolves another plan than
    rank 0 and the agreement takes every rank to stock."""
    results = _run(tmp_path, "table@1", nprocs=2)
    for r in results:
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        assert "resolved different HEAD_GATHER plans" in r["log"][-1]
        assert r["log"][-1].endswith("[plans-differ]")
    lines = [x for x in results[1]["log"] if "bare 'on'" in x]  # one per install (two calls)
    assert len(lines) == 2 and all("unset LAMPORT_HEAD_TABLE" in x for x in lines)
    assert not any("bare 'on'" in x for x in results[0]["log"])


def test_disable_on_one_rank_takes_every_rank_to_stock(tmp_path):
    results = _run(tmp_path, "disable@1", nprocs=2)
    for r in results:
        assert r["served"] == [] and r["routed"] == ["stock", 1]
    assert "disabled by LAMPORT_HEAD_DISABLE" in results[0]["log"][-1]


def test_ranks_with_different_plans_stay_stock(tmp_path):
    other = TABLE.replace("ctas: 8", "ctas: 9")
    results = _run(tmp_path, "table@1", nprocs=2, other=other)
    for r in results:
        assert r["served"] == []
        assert "different HEAD_GATHER plans" in r["log"][-1]


@pytest.mark.parametrize("overrides", [
    {"lm__weight": torch.zeros(64, 16, dtype=torch.float16)},
    {"lm__weight": torch.zeros(64, dtype=torch.bfloat16)},
    {"lm__weight": None},
    {"lp__logits_as_input": True},
    {"lp__head_dtype": torch.float16},  # FP16 logits: no gather serves them
    {"lp__head_dtype": "float32"},  # not a torch dtype: vLLM never says so; refused
    {"lp__head_dtype": torch.float32,  # FP32 logits: shard % 4 != 0
     "lm__weight": torch.zeros(62, 16, dtype=torch.bfloat16)},
    {"lm__weight": torch.zeros(64, 16, dtype=torch.int8)},  # a quantized head
    {"lm__tp_size": 4},
    {"lp__use_all_gather": False},
    {"lm__weight": torch.zeros(60, 16, dtype=torch.bfloat16)},  # shard % 8 != 0
])
def test_checks_leave_stock_without_collectives(overrides, monkeypatch):
    built = []
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build", lambda *a, **k: built.append(a))
    m = model(**overrides)
    assert install_logits_gather(m, None, 2, 0, "cpu").rows == ()
    assert built == [] and not hasattr(m.logits_processor, "head_gather")


@pytest.fixture
def solo_group(tmp_path):
    """A one-process gloo group: the plan agreement is a real collective."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'solo'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_no_logits_processor_tp1_cpu_and_disable(monkeypatch, tmp_path, caplog, solo_group):
    assert install_logits_gather(types.SimpleNamespace(), None, 2, 0, "cpu").rows == ()
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    assert install_logits_gather(model(lm__tp_size=1), None, 1, 0, "cpu").rows == ()
    monkeypatch.setattr(install, "_device_name", lambda d: None)
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install_logits_gather(model(), None, 2, 0, "cpu").rows == ()
    assert "not a CUDA device" in caplog.text
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA B300")
    caplog.clear()
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install_logits_gather(model(), None, 2, 0, "cpu").rows == ()
    assert "no enabled HEAD_GATHER rows for NVIDIA B300" in caplog.text
    monkeypatch.setenv("LAMPORT_HEAD_DISABLE", "1")
    assert install_logits_gather(model(), None, 2, 0, "cpu").rows == ()


def test_malformed_table_warns_and_stays_stock(monkeypatch, tmp_path, caplog, solo_group):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\ndevices:\n  NVIDIA H200: [{tp: 2, rows: {1: {ctas: 1, enabled: on}}}]\n")
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(bad))
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    with caplog.at_level("WARNING", logger="lamport_head"):
        assert install_logits_gather(model(), None, 2, 0, "cpu").rows == ()
    assert str(bad) in caplog.text and "bare 'on'" in caplog.text


class OwnGather:
    """A processor whose class has its own gather (vLLM's DeepSeek V4.1 specialized
    decode): kept unless LAMPORT_HEAD_FORCE=1 on every rank."""

    logits_as_input, head_dtype, use_all_gather = False, None, True

    def _gather_logits(self, x):
        return ("own", x.shape[0])


def _vote_worker(rank, nprocs, table, own, force_ranks, nameless_rank):
    os.environ["LAMPORT_HEAD_TABLE"] = table
    os.environ.pop("LAMPORT_HEAD_FORCE", None)
    if rank in force_ranks:  # the variable reached these ranks only
        os.environ["LAMPORT_HEAD_FORCE"] = "1"
    fake_cuda(setattr, rank, "ok")
    if rank == nameless_rank:
        def nameless(device):
            raise RuntimeError("injected: no device name")

        install._device_name = nameless
    seen = capture_log()
    m = model(lm__tp_size=nprocs)
    if own:
        m.logits_processor = OwnGather()
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    routed = m.logits_processor._gather_logits(torch.zeros(1, 64, dtype=torch.bfloat16))
    routed = (sorted(set(routed.view(torch.uint8).flatten().tolist())) if torch.is_tensor(routed)
              else routed)
    step = torch.tensor([1])
    dist.all_reduce(step)  # the program's next collective (vLLM's): every rank in step
    return {"served": list(served), "routed": routed, "in_step": int(step.item()), "log": seen}


def _vote(tmp_path, own=True, force_ranks=(), nameless_rank=-1, nprocs=3):
    table = tmp_path / "t.yaml"
    table.write_text(_table(nprocs))
    return spawn(_vote_worker, nprocs, tmp_path, str(table), own, list(force_ranks),
                 nameless_rank, deadline_s=60)


def test_force_on_some_ranks_only_keeps_every_ranks_own_gather(tmp_path):
    """LAMPORT_HEAD_FORCE on rank 1 only: no rank decides alone before the agreement
    (rank 0 used to return while rank 1 waited in it); every rank keeps the
    processor's own gather and says which ranks had the variable."""
    for r in _vote(tmp_path, force_ranks=[1]):
        assert r["served"] == [] and r["routed"] == ["own", 1] and r["in_step"] == 3
        assert "LAMPORT_HEAD_FORCE=1 reached TP rank(s) [1] but not [0, 2]" in r["log"][-1]
        assert "stays stock" in r["log"][-1] and "has its own _gather_logits" in r["log"][-1]


@pytest.mark.parametrize("force_ranks, served", [((), []), ((0, 1, 2), [1, 2, 4])])
def test_force_on_no_rank_or_every_rank(tmp_path, force_ranks, served):
    for r in _vote(tmp_path, force_ranks=force_ranks):
        assert r["served"] == served and r["in_step"] == 3
        assert r["routed"] == ([FAKE_BYTE] if served else ["own", 1])
        if not served:
            assert r["log"] == [r["log"][0]] and "and keeps it" in r["log"][0]  # one line


@pytest.mark.parametrize("own", [False, True])
def test_a_rank_that_cannot_name_its_device_takes_every_rank_to_stock(tmp_path, own):
    """_device_name raising on rank 1: it used to leave install alone (and the plugin
    swallowed that) while its peers waited in the agreement."""
    results = _vote(tmp_path, own=own, force_ranks=(0, 1, 2) if own else (), nameless_rank=1)
    for rank, r in enumerate(results):
        assert r["served"] == [] and r["in_step"] == 3
        assert r["routed"] == (["own", 1] if own else ["stock", 1])
        assert r["log"][-1].startswith("lamport-head: logits gather stays stock: "
                                       + ("" if rank == 1 else "rank 1: "))
        assert "RuntimeError: injected: no device name" in r["log"][-1]


def _serving_worker(rank, nprocs, table):
    """A fresh serving process: the engine adapters and the core imported, the gather
    installed from a table with first-use tuning on; which tuner modules came in."""
    import sys

    os.environ["LAMPORT_HEAD_TABLE"] = table
    os.environ["LAMPORT_HEAD_AUTOTUNE"] = "1"  # on, yet the table covers this GPU
    import lamport_head.engines.sglang  # noqa: F401
    import lamport_head.engines.vllm
    import lamport_head.install  # noqa: F401

    fake_cuda(setattr, rank, "ok")
    m = model(lm__tp_size=nprocs)
    served = lamport_head.engines.vllm.install_logits_gather(m, None, nprocs, rank, "cpu").rows
    tuner = sorted(n for n in sys.modules
                   if n.split(".")[0] == "optuna" or n.startswith(("lamport_head.cli",
                                                                     "lamport_head.tuning")))
    return {"served": list(served), "tuner": tuner}


def test_serving_from_a_table_imports_neither_the_tuner_nor_optuna_nor_the_cli(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    for r in spawn(_serving_worker, 2, tmp_path, str(table)):
        assert r["served"] == [1, 2, 4] and r["tuner"] == []


def _neg_view_worker(rank, nprocs, table):
    """Installed from a table, the stand-in kernel copying its input's storage into every
    rank's fragment of the output (what a gather of equal shards reads); called with a
    negative-bit view, as an engine holding ``-x`` lazily would."""
    import ctypes

    os.environ["LAMPORT_HEAD_TABLE"] = table

    def launch(logits, out, peers, r, ctas, budget, status, stream):
        size = logits.numel() * logits.element_size()
        for k in range(nprocs):
            ctypes.memmove(out + k * size, logits.data_ptr(), size)

    fake_cuda(setattr, rank, "ok", launch=launch)
    m = model(lm__tp_size=nprocs)
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    x = torch.arange(1, 65, dtype=torch.bfloat16).reshape(1, 64)
    out = m.logits_processor._gather_logits(torch._neg_view(x))
    return {"served": list(served), "out": out.tolist(), "want": (-x).repeat(1, nprocs).tolist()}


def test_a_negative_bit_view_is_resolved_before_the_launch(tmp_path):
    """Issue 40 item 7: a ``torch._neg_view`` tensor is contiguous and aligned, yet its
    storage holds x: launched uncopied, the kernel gathered x where the engine holds -x."""
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    for r in spawn(_neg_view_worker, 2, tmp_path, str(table)):
        assert r["served"] == [1, 2, 4] and r["out"] == r["want"]


def test_head_gathers_mode_is_an_explicit_choice():
    """Issue 40 item 7: no default mode (a recoverable default handed a direct user NaN
    after a peer failed unless it called check()); install asks for serving."""
    import inspect

    from lamport_head.head_gather import HeadGather

    assert inspect.signature(HeadGather).parameters["mode"].default is inspect.Parameter.empty
    with pytest.raises(TypeError, match="mode"):
        HeadGather(None, "cpu", 2, 0, 64, [1])


def _protocol_worker(rank, nprocs, table, head):
    """Install on a model whose head gathers ``head`` logits (vLLM's head_dtype), its
    HeadGather on CPU (``fake_cuda``) with a kernel stand-in that moves the shards as the
    protocol does: 32-bit words over gloo, the sentinel word sent as 0, into the
    output the launch was given. Every rank builds every rank's shard from one seed,
    so each checks its own output against ``reference_gather`` of all of them."""
    import ctypes

    from lamport_head import build
    from lamport_head.kernels.protocol import SENTINEL_I32
    from lamport_head.tuning.support.reference import planted, reference_gather

    os.environ["LAMPORT_HEAD_TABLE"] = table

    def kernel(logits, dst, peers, r, ctas, budget, status, stream):
        words = logits.contiguous().view(torch.int32)
        sent = words.masked_fill(words == SENTINEL_I32, 0)
        parts = [torch.empty_like(sent) for _ in range(nprocs)]
        dist.all_gather(parts, sent)
        full = torch.cat(parts, dim=1).contiguous()
        ctypes.memmove(dst, full.data_ptr(), full.numel() * 4)

    fake_cuda(setattr, rank, "ok", launch=kernel)
    compiled, words = build.TOOLCHAIN.compiled, []
    build.TOOLCHAIN.compiled = lambda tp, w, *a, **k: (words.append(w), compiled(tp, w, *a, **k))[1]
    dtype = getattr(torch, head)
    m = model(lm__tp_size=nprocs, lp__head_dtype=dtype)
    outcome = install_logits_gather(m, None, nprocs, rank, "cpu")
    g = m.logits_processor.head_gather
    out = {"served": list(outcome.rows), "dtype": outcome.dtype, "gather": str(g.dtype),
           "words": sorted(set(words)), "equal": {}, "other": {}}
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    for rows in (1, 2, 3, 4):
        shards = [planted(rows, 64, generator=torch.Generator().manual_seed(97 * rows + r),
                          dtype=dtype) for r in range(nprocs)]
        want = reference_gather(shards)
        got = m.logits_processor._gather_logits(shards[rank])
        ok = torch.is_tensor(got) and got.dtype == dtype and torch.equal(
            got.view(torch.int32), want.view(torch.int32))
        if rows in g.rows:  # an explicit launch into a poisoned output (NaN in either dtype)
            poisoned = torch.full((rows, g.width * dtype.itemsize // 2), 0x7FBF,
                                  dtype=torch.int16).view(dtype)
            g.launch(shards[rank], poisoned, g.plan[rows].ctas)
            ok = ok and torch.equal(poisoned.view(torch.int32), want.view(torch.int32))
        out["equal"][rows] = ok
        out["other"][rows] = m.logits_processor._gather_logits(shards[rank].to(other))
    out["sentinels"] = int((torch.cat(shards).view(torch.int32) == SENTINEL_I32).sum())
    return out


@pytest.mark.parametrize("head", ["bfloat16", "float32"])
def test_each_dtype_is_gathered_bitwise_but_for_the_sentinel_word(tmp_path, head):
    """Issue 42: the install serves a head of either dtype from that dtype's section (the
    table holds both at V = 128) through a gather built for it: the kernel is compiled
    for the dtype's words (V/TP x itemsize / 4 a row: 32 BF16, 64 FP32), and on planted
    data (-0.0, NaN payloads, ±Inf, denormals, the sentinel word: BF16 (+0, -0), FP32
    -0.0) every served row, routed or launched into a poisoned output, is bitwise the
    reference: the shards concatenated, the sentinel word as 0 (+0.0). Rows 3 stay
    stock, and a call of the other dtype takes the engine's gather at every row."""
    table = tmp_path / "t.yaml"
    table.write_text(sections((128,), fp32_vocabs=(128,)))
    for r in spawn(_protocol_worker, 2, tmp_path, str(table), head):
        assert r["served"] == [1, 2, 4] and r["dtype"] == head
        assert r["gather"] == f"torch.{head}"
        assert r["words"] == [32 if head == "bfloat16" else 64]
        assert r["sentinels"] > 0  # planted: the scrub is exercised
        assert r["equal"] == {"1": True, "2": True, "3": False, "4": True}  # 3: stock's
        assert r["other"] == {str(m): ["stock", m] for m in (1, 2, 3, 4)}
