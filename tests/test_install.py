"""install_logits_gather on a 2-rank gloo group with vLLM-shaped stand-ins: every
check, the MIN agreement (one rank failing construction leaves both stock), the
instance-attribute routing, LAMPORT_HEAD_DISABLE, and `()` on a CPU device."""

import json
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lamport_head import install

TABLE = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 2
      dcp: 1
      rows:
        1-2: {ctas: 4, enabled: true}
        3: {ctas: 4, enabled: false}
        4: {ctas: 8, enabled: true}
"""


class FakeGather:
    def __init__(self, rows):
        self.rows = frozenset(rows)
        self.calls = 0

    def __call__(self, logits, stock):
        self.calls += 1
        return ("lamport", logits.shape[0])


def model(**overrides):
    lp = types.SimpleNamespace(logits_as_input=False, head_dtype=None, use_all_gather=True)
    lp._gather_logits = lambda x: ("stock", x.shape[0])
    head = types.SimpleNamespace(weight=torch.zeros(64, 16, dtype=torch.bfloat16), tp_size=2)
    m = types.SimpleNamespace(logits_processor=lp, lm_head=head)
    for key, value in overrides.items():
        target, attr = key.split("__")
        setattr(m.logits_processor if target == "lp" else m.lm_head, attr, value)
    return m


def _worker(rank, init, out, table, case):
    os.environ["LAMPORT_HEAD_TABLE"] = table
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    install._device_name = lambda device: "NVIDIA H200"
    built = []

    def build(group, device, tp, r, shard, plan):
        if case == "fail_rank1" and r == 1:
            raise RuntimeError("symmetric memory unavailable")
        built.append((shard, {m: p.ctas for m, p in plan.items()}))
        return FakeGather(plan)

    install._build = build
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("lamport_head").addHandler(handler)
    logging.getLogger("lamport_head").setLevel(logging.INFO)
    m = model()
    other = model()
    served = install.install_logits_gather(m, None, 2, rank, "cpu")
    again = install.install_logits_gather(m, None, 2, rank, "cpu")
    result = {"served": list(served), "again": list(again), "built": [[s, {str(k): v for k, v in c.items()}] for s, c in built],
              "routed": m.logits_processor._gather_logits(torch.zeros(1, 64, dtype=torch.bfloat16)),
              "unrouted": m.logits_processor._gather_logits(torch.zeros(3, 64, dtype=torch.bfloat16))
              if served else None,
              "other": other.logits_processor._gather_logits(torch.zeros(1, 64)),
              "log": seen}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _run(tmp_path, case):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    out = tmp_path / "result"
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", str(out), str(table), case), nprocs=2)
    return [json.loads(open(f"{out}.{r}").read()) for r in range(2)]


def test_install_serves_enabled_rows_on_both_ranks(tmp_path):
    for r in _run(tmp_path, "ok"):
        assert r["served"] == [1, 2, 4] and r["again"] == [1, 2, 4]
        assert r["built"] == [[64, {"1": 4, "2": 4, "4": 8}]]
        assert r["routed"] == ["lamport", 1]
        assert r["unrouted"] == ["lamport", 3]  # HeadGather itself sends it to stock
        assert r["other"] == ["stock", 1]  # another processor keeps its gather


def test_one_rank_failing_leaves_both_stock(tmp_path, caplog):
    results = _run(tmp_path, "fail_rank1")
    for r in results:
        assert r["served"] == [] and r["routed"] == ["stock", 1]
        warnings = [line for line in r["log"] if "stays stock" in line]
        assert len(warnings) == 2  # one warning per install attempt (the worker tries twice)
    # the failing rank names its cause; the healthy one says another rank failed
    assert "RuntimeError: symmetric memory unavailable" in results[1]["log"][-1]
    assert "failed on another TP rank" in results[0]["log"][-1]


@pytest.mark.parametrize("overrides", [
    {"lm__weight": torch.zeros(64, 16, dtype=torch.float16)},
    {"lm__weight": torch.zeros(64, dtype=torch.bfloat16)},
    {"lm__weight": None},
    {"lp__logits_as_input": True},
    {"lp__head_dtype": torch.float32},
    {"lm__tp_size": 4},
    {"lp__use_all_gather": False},
    {"lm__weight": torch.zeros(60, 16, dtype=torch.bfloat16)},  # shard % 8 != 0
])
def test_checks_leave_stock_without_collectives(overrides, monkeypatch):
    built = []
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build", lambda *a: built.append(a))
    m = model(**overrides)
    assert install.install_logits_gather(m, None, 2, 0, "cpu") == ()
    assert built == [] and not hasattr(m.logits_processor, "head_gather")


def test_no_logits_processor_tp1_cpu_and_disable(monkeypatch, tmp_path, caplog):
    assert install.install_logits_gather(types.SimpleNamespace(), None, 2, 0, "cpu") == ()
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    assert install.install_logits_gather(model(lm__tp_size=1), None, 1, 0, "cpu") == ()
    monkeypatch.setattr(install, "_device_name", lambda d: None)
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install.install_logits_gather(model(), None, 2, 0, "cpu") == ()
    assert "not a CUDA device" in caplog.text
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA B300")
    caplog.clear()
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install.install_logits_gather(model(), None, 2, 0, "cpu") == ()
    assert "no enabled HEAD_GATHER rows for NVIDIA B300" in caplog.text
    monkeypatch.setenv("LAMPORT_HEAD_DISABLE", "1")
    assert install.install_logits_gather(model(), None, 2, 0, "cpu") == ()


def test_malformed_table_warns_and_stays_stock(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\ndevices:\n  NVIDIA H200: [{tp: 2, rows: {1: {ctas: 1, enabled: on}}}]\n")
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(bad))
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    with caplog.at_level("WARNING", logger="lamport_head"):
        assert install.install_logits_gather(model(), None, 2, 0, "cpu") == ()
    assert str(bad) in caplog.text and "bare 'on'" in caplog.text
