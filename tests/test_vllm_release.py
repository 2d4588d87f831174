"""Any vLLM release: named, and never fatal (issue 39 item 3), on the real vLLM installed
(each release of ``RELEASES`` in its own venv: the README's test command runs this module
on both), 2 gloo ranks made by vLLM's own init, the real plugin loader and the real
``Worker.load_model`` on a stand-in runner (install forced onto a stand-in kernel: no GPU).

- A release outside the window (``vllm.__version__`` bumped) with every relied-upon
  name present serves, bitwise, with one WARNING line per rank naming it untested, and
  rank 0's summary names it.
- The same with one relied-upon name removed (``LogitsProcessor.get_top_k_tokens``, a
  name vLLM's plain decoding never calls), bumped or not: nothing is hooked, the model
  loads and its logits are vLLM's own, bitwise; one WARNING line names the release and
  the name, on every rank.
- A runner lacking ``get_model`` (read off the live worker): the hook checks it before
  any collective, every rank stays stock, ``load_model`` returns, one WARNING line.
"""

import pytest
from helpers import (as_vllm_rank, forced_build, same_bits, spawn_vllm_ranks, vllm_lm,
                     vllm_ranks, vllm_worker)
from tables import TWO_RANKS as TABLE

VOCAB, HIDDEN = 1000, 64
ROWS = (1, 2, 3, 4)
DROPPED = ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.get_top_k_tokens")


def _rank(rank, world, tmp, table, case, version):
    as_vllm_rank(tmp, rank, LAMPORT_HEAD_TABLE=table)
    import logging

    import torch
    import torch.distributed as dist

    import vllm
    import vllm.plugins
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu_worker import Worker

    import lamport_head.install as install
    from lamport_head.engines.vllm import release

    installed = release.version()
    if version is not None:
        vllm.__version__ = version
    if case == "missing":
        del LogitsProcessor.get_top_k_tokens

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append([record.levelname, record.getMessage()])

    ours = logging.getLogger("lamport_head")  # configured here: vLLM's bridge stays off
    ours.addHandler(Keep(logging.INFO))
    ours.setLevel(logging.INFO)

    forced_build(install)  # a stand-in kernel (no GPU): it gathers with its own collective
    gen = torch.Generator().manual_seed(3)

    Lm = vllm_lm(rank, VOCAB, HIDDEN)

    class Runner:
        def __init__(self):
            self.model = None

        def load_model(self, load_dummy_weights=False):
            self.model = Lm()

    if case != "runner":
        Runner.get_model = lambda self: self.model

    with set_current_vllm_config(VllmConfig()):
        vllm_ranks(world, rank, tmp)
        original = Worker.load_model
        vllm.plugins.load_general_plugins()  # the real loader: our register()
        worker = vllm_worker(VllmConfig(), Runner())
        worker.load_model()
        model = worker.model_runner.model
        twin = Lm()
        equal = {}
        for m in ROWS:
            hidden = torch.randn(m, HIDDEN, generator=gen.manual_seed(50 + m)).to(torch.bfloat16)
            equal[m] = same_bits(model.compute_logits(hidden), twin.compute_logits(hidden))
    gather = getattr(model.logits_processor, "head_gather", None)
    dist.barrier()
    return {"installed": installed, "hooked": Worker.load_model is not original,
            "served": None if gather is None else sorted(gather.rows),
            "calls": None if gather is None else gather.calls, "equal": equal,
            "warnings": [m for level, m in said if level == "WARNING"],
            "summary": [m for _, m in said if m.startswith("lamport-head summary: ")]}


def _run(tmp_path, case, version):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    return spawn_vllm_ranks(_rank, 2, tmp_path, str(tmp_path), str(table), case, version)[0]


def test_an_untested_release_with_every_name_serves_with_one_warning(vllm_release, tmp_path):
    results = _run(tmp_path, "untested", "0.99.0")
    for r in results:
        assert r["hooked"] and r["served"] == [1, 2, 4] and r["calls"] == [1, 2, 4]
        assert all(r["equal"].values()), r["equal"]
        assert r["warnings"] == [
            "lamport-head: vLLM 0.99.0 is not a release the plugin was tested on (0.33.0, "
            "0.34.0); every name it relies on is present, so it serves"]
    assert len(results[0]["summary"]) == 1 and results[1]["summary"] == []
    assert results[0]["summary"][0].startswith(
        "lamport-head summary: vLLM 0.99.0, Lm, tp=2, dcp=1: Lamport logits gather for rows "
        "[1, 2, 4] on all 2 TP ranks")


@pytest.mark.parametrize("bumped", [False, True], ids=["this-release", "0.99.0"])
def test_a_release_missing_a_relied_name_keeps_the_engine_on_stock(vllm_release, tmp_path,
                                                                   bumped):
    results = _run(tmp_path, "missing", "0.99.0" if bumped else None)
    for r in results:
        version = "0.99.0" if bumped else r["installed"]
        assert not r["hooked"] and r["served"] is None  # vLLM's Worker, unwrapped
        assert all(r["equal"].values()), r["equal"]  # the model serves vLLM's own logits
        assert r["warnings"] == [
            f"lamport-head: vLLM {version} lacks {DROPPED[0]}:{DROPPED[1]}, which the plugin "
            "relies on: every rank keeps vLLM's own logits gather (the plugin is written for "
            "vLLM 0.33.0, 0.34.0)"]
        assert r["summary"] == []


def test_a_runner_missing_get_model_loads_on_stock(vllm_release, tmp_path):
    results = _run(tmp_path, "runner", None)
    for r in results:
        assert r["hooked"] and r["served"] is None and all(r["equal"].values())
        assert r["warnings"] == [
            f"lamport-head: vLLM {r['installed']} lacks Worker.model_runner.get_model, which "
            "the plugin relies on: every rank keeps vLLM's own logits gather (the plugin is "
            "written for vLLM 0.33.0, 0.34.0)"]
    assert results[0]["summary"][0].startswith(
        f"lamport-head summary: vLLM {results[0]['installed']}, Runner, tp=2, dcp=?: stock "
        "logits gather on all 2 TP ranks (engine: ")
