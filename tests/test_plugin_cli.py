"""The vLLM plugin on a stand-in worker, the installed metadata, and the CLI."""

import importlib.metadata
import subprocess
import sys
import types

import pytest

from lamport_head import cli
from lamport_head.engines import vllm as plugin
from lamport_head.engines.vllm import release, route
from lamport_head.outcome import Outcome, Ranks, Reason


def fake_vllm(monkeypatch, version="0.33.0", drop=None):
    """A stand-in vLLM holding every name ``release.RELIED`` lists (at ``version``),
    but ``drop`` ("module:attribute") when given."""
    calls = []

    class Worker:
        def __init__(self):
            self.device = "cuda:1"
            self.model_runner = types.SimpleNamespace(get_model=lambda: "the model")

        def load_model(self, *, load_dummy_weights=False):
            calls.append(("load", load_dummy_weights))

    group = types.SimpleNamespace(device_group="tp-device-group", cpu_group="tp-cpu-group",
                                  world_size=4, rank_in_group=1)
    ps = types.SimpleNamespace(get_tp_group=lambda: group,
                               get_dcp_group=lambda: types.SimpleNamespace(world_size=2))
    class LogitsProcessor:
        def _gather_logits(self, x):
            return x

        def get_top_tokens(self):
            pass

        def get_top_k_tokens(self):
            pass

    mods = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_worker", "vllm.distributed",
        "vllm.model_executor", "vllm.model_executor.layers",
        "vllm.model_executor.layers.logits_processor",
        "vllm.model_executor.layers.vocab_parallel_embedding")}
    mods["vllm"].__version__ = version
    mods["vllm.v1.worker.gpu_worker"].Worker = Worker
    mods["vllm.distributed"].parallel_state = ps
    mods["vllm.distributed"].tensor_model_parallel_all_gather = lambda x, dim=-1: x
    mods["vllm.distributed.parallel_state"] = ps
    lp = mods["vllm.model_executor.layers.logits_processor"]
    lp.LogitsProcessor = LogitsProcessor
    lp.tensor_model_parallel_all_gather = mods["vllm.distributed"].tensor_model_parallel_all_gather
    LogitsProcessor.__module__ = "vllm.model_executor.layers.logits_processor"  # its home
    mods["vllm.model_executor.layers.vocab_parallel_embedding"].ParallelLMHead = type(
        "ParallelLMHead", (), {})
    if drop is not None:
        module, dotted = drop.split(":")
        owner, _, attr = dotted.rpartition(".")
        holder = mods[module]
        for part in filter(None, owner.split(".")):
            holder = getattr(holder, part)
        delattr(holder, attr)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(release, "_said", set())  # each test's lines, as a fresh process's
    # the ranks' agreement on the release's names: one rank here, its own answer
    monkeypatch.setattr(route, "all_min", lambda value, group: calls.append(
        ("agree", value, group)) or value)
    return Worker, calls


def test_plugin_installs_after_load_once(monkeypatch):
    Worker, calls = fake_vllm(monkeypatch)
    monkeypatch.setattr(route, "_install_target",
                        lambda *a: calls.append(("install", a)) or Outcome.serving((1, 2)))
    plugin.register()
    plugin.register()  # loading twice is harmless
    Worker().load_model(load_dummy_weights=True)
    # agreement on vLLM's CPU group, first-use timing on its device group; no
    # vllm_config: install's default rows
    ranks = Ranks("tp-cpu-group", 4, 1, "cuda:1", 2, "tp-device-group")
    assert calls == [("load", True), ("agree", True, "tp-cpu-group"),
                     ("install", ("the model", ranks, None))]
    worker = Worker()
    worker.vllm_config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=8),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=1))
    worker.load_model()
    assert calls[-1][1][2] == tuple(range(1, 17))  # 8 requests x (1 + 1 draft token)


def test_plugin_lets_an_install_error_stop_the_worker(monkeypatch):
    """install_logits_gather agrees every outcome and never raises; an error out of it
    means this rank could not finish while peers may wait in a collective, so it is
    never swallowed (the rank would enter vLLM's collectives alone): fail-stop."""
    Worker, calls = fake_vllm(monkeypatch)

    def boom(*a, **kw):
        raise RuntimeError("rank left install alone")

    monkeypatch.setattr(route, "_install_target", boom)
    plugin.register()
    with pytest.raises(RuntimeError, match="rank left install alone"):
        Worker().load_model()
    assert calls == [("load", False), ("agree", True, "tp-cpu-group")]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_release_outside_the_window_serves_with_one_warning(monkeypatch, caplog):
    """Every relied-upon name present on an untested release: hooked, one WARNING line
    per process (register runs in every process vLLM starts, and may run twice)."""
    Worker, calls = fake_vllm(monkeypatch, version="0.35.0")
    monkeypatch.setattr(route, "_install_target",
                        lambda *a: calls.append(("install", a)) or Outcome.serving((1,)))
    with caplog.at_level("INFO", logger="lamport_head"):
        plugin.register()
        plugin.register()
        Worker().load_model()
    assert [c[0] for c in calls] == ["load", "agree", "install"]
    assert _warnings(caplog) == [
        "lamport-head: vLLM 0.35.0 is not a release the plugin was tested on (0.33.0, 0.34.0); "
        "every name it relies on is present, so it serves"]


@pytest.mark.parametrize("version", ["0.33.0", "0.35.0"])
@pytest.mark.parametrize("drop", [name for name in (f"{m}:{a}" for m, a in release.RELIED)])
def test_a_release_missing_a_relied_name_keeps_the_engine_running_on_stock(
        monkeypatch, caplog, version, drop):
    """One name gone: nothing is hooked, the worker loads as vLLM's own, one WARNING
    line names the release and the name."""
    Worker, calls = fake_vllm(monkeypatch, version=version, drop=drop)
    original = getattr(Worker, "load_model", None)
    monkeypatch.setattr(route, "_install_target", lambda *a: calls.append(("install", a)))
    with caplog.at_level("INFO", logger="lamport_head"):
        plugin.register()
        plugin.register()
    assert getattr(Worker, "load_model", None) is original
    if original is not None:
        Worker().load_model()
        assert calls == [("load", False)]
    assert _warnings(caplog) == [
        f"lamport-head: vLLM {version} lacks {drop}, which the plugin relies on: every rank "
        "keeps vLLM's own logits gather (the plugin is written for vLLM 0.33.0, 0.34.0)"]


def test_a_worker_missing_a_relied_name_loads_on_stock(monkeypatch, caplog):
    """A name read off the live worker (its runner's get_model) gone: checked before any
    collective, the same on every rank; stock, one WARNING line, load_model returns."""
    Worker, calls = fake_vllm(monkeypatch)
    monkeypatch.setattr(route, "_install_target", lambda *a: calls.append(("install", a)))
    plugin.register()
    worker = Worker()
    worker.model_runner = types.SimpleNamespace()  # a runner without get_model
    with caplog.at_level("INFO", logger="lamport_head"):
        assert worker.load_model() is None
    assert calls == [("load", False), ("agree", False, "tp-cpu-group")]
    assert _warnings(caplog) == [
        "lamport-head: vLLM 0.33.0 lacks Worker.model_runner.get_model, which the plugin relies "
        "on: every rank keeps vLLM's own logits gather (the plugin is written for vLLM 0.33.0, "
        "0.34.0)"]
    assert route._install_after_load(worker).reason is Reason.ENGINE


def test_register_says_why_it_cannot_hook(monkeypatch, caplog):
    """vLLM present but its worker module failing to import: one WARNING line."""
    fake_vllm(monkeypatch)
    monkeypatch.setattr(release, "check", lambda *a, **k: release.Release("0.33.0", True))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", None)
    with caplog.at_level("INFO", logger="lamport_head"):
        assert plugin.register() is None
    warned = _warnings(caplog)
    assert len(warned) == 1 and "no GPU worker to hook" in warned[0]


def test_plugin_without_vllm_is_harmless(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert plugin.register() is None


def test_installed_metadata():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(e.name == "lamport_head" and e.value == "lamport_head.engines.vllm:register" for e in eps)
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert any(e.name == "lamport-head" for e in scripts)
    import lamport_head
    from lamport_head.table import packaged_path

    for name in ("HeadGather", "install_logits_gather", "GatherTimeout"):
        assert getattr(lamport_head, name)
    assert lamport_head.table.load_table and packaged_path().exists()
    import lamport_head.kernels
    import lamport_head.tuning.sweep  # noqa: F401


SHOW_TABLE = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 8
      dcp: 1
      provenance: {date: '2026-12-02', gpu: NVIDIA H200, commit: abc}
      rows:
        1-4: {ctas: 8, enabled: true, lamport_us: 4.5, stock_us: 20.1}
        8: {ctas: 32, enabled: false}
"""


def test_show_prints_entries(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text(SHOW_TABLE)
    assert cli.main(["show", "--table", str(p), "--device", "nvidia h200", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "NVIDIA H200  tp=8 dcp=1" in lines
    assert "1-4 8 256 4 yes 4.5 20.1".split() in [x.split() for x in lines]  # not a path's text
    assert f"  from {p}" in lines  # each section names its file
    assert cli.main(["show", "--table", str(p), "--device", "NVIDIA H100"]) == 2
    assert capsys.readouterr().err == ("lamport-head: show: no GPU model in these tables matches "
                                       "--device 'NVIDIA H100'; sections: NVIDIA H200 tp=8 dcp=1\n")


def test_show_names_the_collective_of_an_all_to_all_section(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text(SHOW_TABLE.replace("    - tp: 8\n", "    - tp: 8\n      stock: nccl-all-to-all\n"))
    assert cli.main(["show", "--table", str(p), "--device", "nvidia h200", "--tp", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("  measured against nccl-all-to-all; served only where the route replaces that "
            "all-to-all (rows: a step's total M)") in lines
    assert "  rows above 8: the stock all-to-all (past the largest measured row)" in lines


def test_show_bad_table_is_one_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("schema: 7\ndevices: {}\n")
    assert cli.main(["show", "--table", str(p)]) == 2
    err = capsys.readouterr().err
    assert "schema 7" in err and "Traceback" not in err
    assert err.count("\n") == 1 and "newer than this lamport-head reads" in err


@pytest.mark.parametrize("command", ["tune", "bench", "verify"])
def test_gpu_commands_refuse_cleanly_without_cuda(command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run([sys.executable, "-m", "lamport_head.cli", command],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "no CUDA GPU" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_bad_arguments_are_clear(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--rows", "1,x"])
    assert "comma-separated ints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune", "--margin", "2"])
    assert "margin must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune", "--rows", "1,2048"])
    assert "rows 2048 exceed the limit of 1024 rows: a mailbox for 2048" in capsys.readouterr().err


def test_show_marks_filled_rows(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text(SHOW_TABLE)
    assert cli.main(["show", "--table", str(p), "--device", "NVIDIA H200", "--tp", "8"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.strip() and line.split()[0][0].isdigit()}
    assert list(lines) == ["1-4", "5-7", "8"]
    assert "filled (not measured) from rows 8" in lines["5-7"]
    assert lines["5-7"].split()[1:5] == ["32", "256", "4", "no"]  # row 8's entry, disabled
    assert "filled" not in lines["1-4"] and "filled" not in lines["8"]


def test_one_version_from_package_metadata():
    """pyproject.toml is the one source: the package, the CLI and provenance say it."""
    import lamport_head

    version = importlib.metadata.version("lamport-head")
    assert lamport_head.__version__ == version
    run = subprocess.run([sys.executable, "-m", "lamport_head.cli", "--version"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == f"lamport-head {version}"


# ---- tune's output for an emulated run: no stock, speedup or enabled figure --------

def _results():
    import math

    from lamport_head.config import GatherConfig
    from lamport_head.table import TableRow
    from lamport_head.tuning.sweep import RowResult

    return [RowResult(1, TableRow(GatherConfig(16, 256, 4), False), 6.97, 2.15, 6.97, math.nan),
            RowResult(8, TableRow(GatherConfig(48, 128, 2), True), 25.52, 30.0, 25.52, math.nan)]


def _plot_texts(monkeypatch, records, emulated, tmp_path):
    """Every text the tune plot draws (title, axis labels, legends, ticks), lowercased."""
    import matplotlib.pyplot as plt

    from lamport_head.tuning import plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or close(fig))
    path = tmp_path / "tune.png"
    plot.plot_rows(records, str(path), "NVIDIA H200 tp=8" + (" (emulated)" if emulated else ""),
                   emulated=emulated)
    assert path.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    texts = [fig._suptitle.get_text()]
    for ax in fig.axes:
        texts += [ax.get_xlabel(), ax.get_ylabel(), ax.get_title()]
        legend = ax.get_legend()
        texts += [t.get_text() for t in legend.get_texts()] if legend else []
    return " | ".join(texts).lower()


def test_tune_emulated_summary_table_and_plot_have_no_stock_or_speedup(monkeypatch, tmp_path):
    from lamport_head.tuning import tune

    results = _results()
    printed = tune.summary(results, emulated=True).lower()
    assert printed.splitlines()[0].split() == ["rows", "ctas", "thr", "unr", "gather", "µs"]
    assert printed.splitlines()[1].split() == ["1", "16", "256", "4", "6.97"]
    for word in ("stock", "speedup", "enabled", "cat"):
        assert word not in printed, word
    rows = tune.section_rows(results, emulated=True)
    assert rows[1] == {"ctas": 16, "enabled": False, "threads": 256, "unroll": 4,
                       "lamport_us": 6.97}  # every knob of the entry, no stock_us
    assert rows[8]["enabled"] is False and "stock_us" not in rows[8]  # never served
    texts = _plot_texts(monkeypatch, tune.plot_records(results, True), True, tmp_path)
    assert "gather" in texts and "(emulated)" in texts
    assert "stock" not in texts and "speedup" not in texts, texts


def test_tune_on_real_ranks_keeps_stock_speedup_and_enabled(monkeypatch, tmp_path):
    from lamport_head.tuning import tune

    results = _results()
    printed = tune.summary(results, emulated=False)
    assert printed.splitlines()[0].split()[4:] == ["lamport", "µs", "stock", "µs", "speedup",
                                                   "enabled"]
    rows = tune.section_rows(results, emulated=False)
    assert rows[8]["stock_us"] == 30.0 and rows[8]["enabled"] is True
    texts = _plot_texts(monkeypatch, tune.plot_records(results, False), False, tmp_path)
    assert "speedup over stock" in texts and "stock (eager)" in texts
