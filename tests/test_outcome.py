"""Outcomes travel as values (issue 39 item 4): install returns an ``Outcome`` (rows
served, or a ``Reason`` reason from a closed set with its message), and rank 0's
summary is built from outcomes, never from log records. Checked two ways: no adapter
module reads a log record (the source, parsed), and on 2 gloo ranks through the real
install path, rewording every log message of the ``lamport_head`` logger changes no
summary and no outcome, for a served install and each stock reason reachable there."""

import ast
import logging
import os
import pathlib
import types

import pytest
from helpers import fake_cuda, model
from spawn import spawn
from tables import TWO_RANKS as TABLE

from lamport_head.outcome import Outcome, Ranks, Reason

RUNTIME = pathlib.Path(__file__).resolve().parents[1] / "lamport_head"


def test_an_outcome_serves_or_names_a_closed_reason():
    assert Outcome.serving((4, 1, 2)).rows == (1, 2, 4) and Outcome.serving((1,)).served
    stock = Outcome.kept(Reason.NO_ROWS, "why")
    assert not stock.served and stock.reason is Reason.NO_ROWS and stock.message == "why"
    with pytest.raises(ValueError):
        Outcome((1,), Reason.NO_ROWS, "both")
    with pytest.raises(ValueError):
        Outcome(())
    with pytest.raises(TypeError):
        Outcome((), "no-rows", "a string is not a reason")
    assert len({s.label for s in Reason}) == len(Reason)  # stable names, one each
    assert Outcome.serving((1, 2, 8)).within((1, 2, 3)).rows == (1, 2)
    assert Outcome.serving((8,)).within((1, 2)).reason is Reason.ROWS_OUTSIDE
    assert Ranks("g", 2, 0, "cpu").timing_group == "g"
    assert Ranks("g", 2, 0, "cpu", device_group="d").timing_group == "d"


def test_no_adapter_reads_a_log_record():
    """The runtime (the adapters and the install core) never reads what a logger
    emitted: no record's message, no handler or filter of its own that keeps records
    (vLLM's log bridge forwards each record to vLLM's handlers and reads nothing of it)."""
    for path in sorted(RUNTIME.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("getMessage", "records", "msg", "args"), (
                    f"{path.name}:{node.lineno} reads a log record ({node.attr})")
            if isinstance(node, ast.Name):
                assert node.id not in ("collect_log", "capture_log"), (
                    f"{path.name}:{node.lineno} collects log lines ({node.id})")
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "attr", getattr(b, "id", None)) for b in node.bases}
                if "Handler" in bases or "Filter" in bases:
                    emits = [n for n in node.body if isinstance(n, ast.FunctionDef)]
                    assert [f.name for f in emits] == ["emit"], f"{path.name}: {node.name}"
                    used = {a.attr for a in ast.walk(emits[0]) if isinstance(a, ast.Attribute)}
                    assert not used & {"getMessage", "msg", "args"}, node.name


class _Reword(logging.Filter):
    """Every record of the logger says something else (its level kept)."""

    def filter(self, record):
        record.msg, record.args = f"reworded #{id(record) % 97}: nothing to parse here", ()
        return True


def _summary_worker(rank, nprocs, table, case, reword):
    """The vLLM hook's path after a worker loads (``route._install_after_load``) on a
    stand-in worker and vLLM's TP group of this gloo group; returns the target's outcome
    and rank 0's summary as built (the value handed to the logger)."""
    import sys

    from lamport_head.engines.vllm import route

    os.environ["LAMPORT_HEAD_TABLE"] = table
    if case == "disable@1" and rank == 1:
        os.environ["LAMPORT_HEAD_DISABLE"] = "1"
    fake_cuda(setattr, rank, case)
    ours = logging.getLogger("lamport_head")
    ours.setLevel(logging.INFO)
    if reword:
        ours.addFilter(_Reword())
    said = []
    original = route.summary
    route.summary = lambda *a, **kw: said.append(original(*a, **kw)) or said[-1]
    import torch.distributed as dist

    group = types.SimpleNamespace(world_size=nprocs, rank_in_group=rank, cpu_group=None,
                                  device_group=dist.group.WORLD)
    ps = types.SimpleNamespace(get_tp_group=lambda: group,
                               get_dcp_group=lambda: types.SimpleNamespace(world_size=1))
    for name in ("vllm", "vllm.distributed"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.distributed"].parallel_state = ps
    sys.modules["vllm.distributed.parallel_state"] = ps
    # the release's module-level names are vLLM 0.34's (no vLLM here); the live worker's
    # are read as the real check reads them
    route.releases.check = lambda worker=None, group=None: route.releases.Release(
        "0.34.0", True, () if hasattr(worker.model_runner, "get_model")
        else ("Worker.model_runner.get_model",))
    m = model(lm__tp_size=nprocs) if case != "no-processor" else types.SimpleNamespace()
    if case == "fp32":
        m.logits_processor.head_dtype = "float32"
    runner = types.SimpleNamespace(get_model=lambda: m)
    if case == "runner@1" and rank == 1:
        runner = types.SimpleNamespace()  # this rank's live worker lacks a relied-upon name
    worker = types.SimpleNamespace(model_runner=runner, device="cpu", vllm_config=None)
    outcome = route._install_after_load(worker)
    return {"rows": list(outcome.rows), "reason": outcome.reason and outcome.reason.label,
            "message": outcome.message, "summary": said}


@pytest.mark.parametrize("case,reason", [
    ("ok", None), ("disable@1", "disabled"), ("prepare@1", "build-failed"),
    ("no-processor", "no-processor"), ("fp32", "site"), ("runner@1", "engine"),
])
def test_rewording_every_log_message_changes_no_summary(tmp_path, case, reason):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    plain = spawn(_summary_worker, 2, tmp_path / "plain", str(table), case, False) if (
        (tmp_path / "plain").mkdir() is None) else None
    reworded = spawn(_summary_worker, 2, tmp_path / "reworded", str(table), case, True) if (
        (tmp_path / "reworded").mkdir() is None) else None
    assert plain == reworded
    for r in plain:
        assert r["reason"] == reason and bool(r["rows"]) == (reason is None)
    assert len(plain[0]["summary"]) == 1 and plain[1]["summary"] == []  # rank 0 says it
    line = plain[0]["summary"][0]
    assert line.startswith("vLLM 0.34.0, ")
    if reason is not None:
        assert f"({reason}: {plain[0]['message']})" in line
    else:
        assert f"Lamport logits gather for rows {plain[0]['rows']}" in line
