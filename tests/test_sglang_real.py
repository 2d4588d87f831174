"""Against the real SGLang 0.5.23 classes on CPU (``SGLANG_USE_CPU_ENGINE=1``), on 2 gloo
ranks that SGLang's own ``init_parallel_runtime(device="cpu")`` groups (after
``publish(server_args, role="scheduler", ranks=SpawnRanks(...))``, as its scheduler
process does). Each rank runs SGLang's ``load_plugins()`` (our entry point
``sglang.srt.plugins`` -> ``lamport_head`` registers the AFTER hooks), then builds a real
``ModelRunner`` of a tiny ``LlamaForCausalLM`` with dummy weights: its real
``load_model`` fires our hook, which installs on the model's real ``ParallelLMHead`` and
``LogitsProcessor``. HeadGather's CUDA pieces are faked as in helpers (``fake_cuda``);
its kernel is a CPU stand-in that moves the shards as the protocol does (over gloo,
every word unchanged but the sentinel, sent as (+0, +0)).

Checked per rank: the plugin route (the hook through ``ModelRunner.load_model``; its rows
from SGLang's ``--max-running-requests`` 2: rows 1-2 of the table's 1, 2, 4) and the
explicit call (``install_sglang_logits_gather`` on a model with SGLang's defaults: the
table's rows); on
fresh data with planted -0.0/NaN/Inf words (``reference.planted``), the routed rows
bitwise SGLang's own ``_logits_gatherer`` output (sentinel words scrubbed, the protocol's
one change) and every other row SGLang's own result, bitwise, through the gatherer, an
explicit launch into a poisoned output, and SGLang's real ``LogitsProcessor._get_logits``;
``ModelRunner.update_model_fields`` with the same model and with a new model object; the
draft worker's runner (``is_draft_worker=True``) of a real ``LlamaForCausalLMEagle`` (the
target's shard width: served by the target's gather) and of a real
``LlamaForCausalLMEagle3`` with its own 512-token head (its own gather, agreed by both
ranks), each bitwise as the target on planted data, and rank 0's summary naming every
routed path; every SGLang name lamport_head/engines/sglang.py relies on, resolved in the
real modules.
Every rank runs twice: on a simulated host CPU with AMX and one without
(tests/engine_cpu.py).

SGLang is installed by ``scripts/install-sglang-cpu.sh`` into its own venv (the README's
test command runs it); the ranks run under that interpreter (tests/sglang_cpu.py).
Without it these tests skip, unless ``LAMPORT_HEAD_REQUIRE_SGLANG=1`` (CI).
"""

import json
import os
import sys

import pytest
from engine_cpu import HOST_ISAS
from sglang_cpu import (log_sections, prepare_rank, require_sglang, run_ranks, scheduler_runtime,
                        stand_in_kernel)
from tables import TWO_RANKS_VOCABS, sections

# 512: the EAGLE3 head's V (DRAFT_VOCAB); measured against SGLang's own gatherer, its
# multimem one-shot all-gather (what SGLang builds with TP > 1: engine.stock_kind)
# 1024 also for FP32 logits: the FP32-head target (issue 42)
TABLE = sections((*TWO_RANKS_VOCABS, 512), stock="multimem-all-gather", fp32_vocabs=(1024,))
SERVED = [1, 2, 4]  # the table's enabled rows: the explicit call's, which passes no rows
REQUESTS = 2  # --max-running-requests: the plugin serves rows 1 .. 2 x 1 row a request
PLUGIN_SERVED = [1, 2]
ROWS = [1, 2, 3, 4, 5]
VOCAB, HIDDEN = 1000, 64  # SGLang pads the vocab to 1024: 512 rows a rank, rank 1's last 24 padding
DEADLINE_S = 240
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
         "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 2}
EAGLE = dict(LLAMA, architectures=["LlamaForCausalLMEagle"])
DRAFT_VOCAB = 512  # the EAGLE3 head's own vocabulary: 256 rows a rank, not the target's 512
EAGLE3 = dict(LLAMA, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
LLAMA_FP32 = dict(LLAMA, enable_lm_head_fp32=True)  # SGLang's use_fp32_lm_head, per model


# ---- what runs on each rank (a spawned process, under SGLang's interpreter) ----------

def _rank(rank, tp, run, table):
    told = prepare_rank(rank, tp, run)
    os.environ.update(LAMPORT_HEAD_TABLE=table, LAMPORT_HEAD_CACHE=f"{run}/cache",
                      LAMPORT_HEAD_AUTOTUNE="0",
                      SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=f"file://{run}/init")
    out = _scenarios(rank, tp, run)
    out["amx_told"] = told
    return out


def _names(runner, lp, engine):
    """Every SGLang name engine relies on, looked up in the real modules: {name: found}."""
    import importlib
    import importlib.util
    import inspect
    from importlib.metadata import entry_points

    def attr_path(dotted):  # "package.module.Class.method"
        module, cls, method = dotted.rsplit(".", 2)
        return getattr(getattr(importlib.import_module(module), cls), method)

    found = {}

    def check(name, test):
        try:
            found[name] = bool(test())
        except Exception as exc:  # a moved name: its test fails naming it
            found[name] = f"{type(exc).__name__}: {exc}"

    check(engine.LOAD_MODEL, lambda: callable(attr_path(engine.LOAD_MODEL)))
    check(engine.UPDATE_MODEL, lambda: list(inspect.signature(
        inspect.unwrap(attr_path(engine.UPDATE_MODEL))).parameters)[:5]
        == ["self", "new_model", "model_path", "load_format", "load_config"])
    context = importlib.import_module(engine.CONTEXT)
    check(f"{engine.CONTEXT}.get_schedule().{engine.REQUESTS}",
          lambda: hasattr(context.get_schedule(), engine.REQUESTS))
    check(f"{engine.CONTEXT}.{engine.DRAFT_TOKENS}()",
          lambda: getattr(context, engine.DRAFT_TOKENS)() is None)  # no speculative decoding
    check(f"{engine.CONTEXT}.get_parallel().attn_dcp_size",
          lambda: context.get_parallel().attn_dcp_size == 1)
    check(f"ModelRunner.{engine.PER_REQUEST}(num_draft_tokens=)",
          lambda: getattr(runner, engine.PER_REQUEST)(num_draft_tokens=None) == 1)
    check(f"ModelRunner.{engine.DRAFT_WORKER}",
          lambda: getattr(runner, engine.DRAFT_WORKER) is False)
    check(f"{engine.CONTEXT}.{engine.SPEC}().{engine.TOPK}",
          lambda: hasattr(getattr(context, engine.SPEC)(), engine.TOPK))

    def eagle_worker():  # the draft runner SGLang's EAGLE worker builds, in the draft's TP
        import ast  # its module imports setproctitle, not installed here: read its source

        path = importlib.util.find_spec("sglang.srt.speculative.eagle_worker_v2").origin
        tree = ast.parse(open(path).read())
        worker = next(n for n in tree.body
                      if isinstance(n, ast.ClassDef) and n.name == "EagleDraftWorker")
        init = next(n for n in worker.body
                    if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        source = ast.unparse(init).replace(" ", "")
        return f"{engine.DRAFT_WORKER}=True" in source and "draft_tp_context(" in source

    check("EagleDraftWorker: TpModelWorker(is_draft_worker=True) in draft_tp_context",
          eagle_worker)
    check("ModelRunner.forward", lambda: callable(type(runner).forward))

    def multimem():  # the gatherer SGLang builds and the switch stock_kind reads
        from sglang.srt.distributed.device_communicators import triton_symm_mem_ag

        cls = getattr(triton_symm_mem_ag, engine.MULTIMEM_GATHERER)
        built = getattr(lp._logits_gatherer, "keywords", {}).get("stock", lp._logits_gatherer)
        # as SGLang builds it at load (its buffer comes at the first call: on a CPU,
        # that call turns it to NCCL for good), and as SGLang disables it
        fresh, off = cls(max_tokens=8, enabled=True), cls(max_tokens=8, enabled=False)
        return (type(built) is cls and engine.stock_kind(fresh) == "multimem-all-gather"
                and off._state is None and engine.stock_kind(off) == "nccl-all-gather")

    check(f"triton_symm_mem_ag.{engine.MULTIMEM_GATHERER}._state (stock_kind)", multimem)
    for attr in engine._REQUIRED + tuple(a for a, _ in engine._VARIANTS):
        check(f"LogitsProcessor.{attr}", lambda attr=attr: hasattr(lp, attr))
    check("LlamaForCausalLM.lm_head.tp_size", lambda: runner.model.lm_head.tp_size == 2)
    check("LlamaForCausalLM.lm_head.weight", lambda: runner.model.lm_head.weight.dim() == 2)

    def tp_group():
        from sglang.srt.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return (g.cpu_group is not None and g.device_group is not None and g.world_size == 2
                and g.rank_in_group in (0, 1))

    check("sglang.srt.distributed.parallel_state.get_tp_group()", tp_group)

    def hooks():
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        return callable(HookRegistry.register) and HookType.AFTER is not None

    check("sglang.srt.plugins.hook_registry.HookRegistry/HookType.AFTER", hooks)

    def group():
        from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

        return GENERAL_PLUGINS_GROUP == "sglang.srt.plugins" and any(
            ep.value == "lamport_head.engines.sglang:register"
            for ep in entry_points(group=GENERAL_PLUGINS_GROUP) if ep.name == "lamport_head")

    check("entry point sglang.srt.plugins: lamport_head", group)
    return found


def _scenarios(rank, tp, run):
    import functools

    import torch
    import torch.distributed as dist
    from helpers import fake_cuda, same_bits

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.device_communicators.triton_symm_mem_ag import (
        MultimemAllGatherer,
    )
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        load_model_with_memory_saver,
    )
    from sglang.srt.plugins import load_plugins

    from lamport_head.tuning.support import reference
    from lamport_head.engines import sglang as engine
    from lamport_head.kernels.protocol import SENTINEL_I32

    out = {"rank": rank}

    def mark(name):
        print(f"=== {name}", flush=True)

    # SGLang's plugin loader (twice: idempotent) and our entry point called again
    original = {"load": ModelRunner.load_model, "update": ModelRunner.update_model_fields}
    load_plugins()
    load_plugins()
    engine.register()
    out["hooked"] = {name: (getattr(ModelRunner, attr) is not original[name]
                            and getattr(ModelRunner, attr).__wrapped__ is original[name])
                     for name, attr in (("load", "load_model"), ("update", "update_model_fields"))}

    # the scheduler process's order: publish, logging, the parallel runtime, the runner
    args, config, cpu_group = scheduler_runtime(rank, tp, run, f"{run}/llama",
                                                max_running_requests=REQUESTS)

    # HeadGather on CPU (helpers.fake_cuda), its kernel a stand-in that moves the bytes as
    # the protocol does: every word unchanged but the sentinel, sent as (+0, +0)
    launches = []
    kernel = stand_in_kernel(tp, cpu_group, launches)
    fake_cuda(setattr, rank, "ok", launch=kernel)

    mark("plugin")
    runner = ModelRunner(model_config=config, mem_fraction_static=0.5, gpu_id=rank,
                         nccl_port=0, server_args=args)
    model, lp = runner.model, runner.model.logits_processor
    g = getattr(lp, "head_gather", None)
    stock = getattr(lp._logits_gatherer, "keywords", {}).get("stock")
    out["plugin"] = {
        "model": type(model).__name__, "served": None if g is None else sorted(g.rows),
        "routed": (isinstance(lp._logits_gatherer, functools.partial)
                   and lp._logits_gatherer.func is g and isinstance(stock, MultimemAllGatherer)),
        "polled": [x is g for x in runner.__dict__.get(engine.POLLED, [])],
        "shard": list(model.lm_head.weight.shape)}
    if g is None:  # nothing more can be checked: the tests fail on "served"
        dist.barrier(group=cpu_group)
        return out

    def planted(m, salt, dtype=torch.bfloat16):
        gen = torch.Generator().manual_seed(10007 * salt + 101 * m + rank)
        return reference.planted(m, g.shard_width, generator=gen, dtype=dtype)

    def gathers(proc, salt, dtype=torch.bfloat16):
        """Per row count: the routed gatherer on planted ``dtype`` data, an explicit
        launch into a poisoned output (served rows), a call of the other dtype, each
        against SGLang's own gatherer on the same data."""
        kept = proc._logits_gatherer.keywords["stock"]
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        result = {}
        for m in ROWS:
            x = planted(m, salt, dtype)
            want = kept(x)  # SGLang's own _logits_gatherer (its gloo all-gather here)
            before = len(launches)
            got = proc._logits_gatherer(x)
            row = {"kernel": len(launches) - before,
                   "sentinels": int((x.view(torch.int32) == SENTINEL_I32).sum()),
                   "stock": same_bits(got, want),
                   "scrubbed": same_bits(got, reference.scrub(want))}
            if m in g.rows:
                halves = g.width * x.element_size() // 2  # NaN in either dtype
                poisoned = torch.full((m, halves), 0x7FBF, dtype=torch.int16).view(dtype)
                g.launch(x, poisoned, g.plan[m].ctas)
                row["poisoned_launch"] = same_bits(poisoned, reference.scrub(want))
            y = x.to(other)
            row["other_stock"] = same_bits(proc._logits_gatherer(y), kept(y))
            row["dtype"] = str(got.dtype)
            result[str(m)] = row
        return result

    def processor(mdl, salt, vocab=VOCAB):
        """SGLang's real _get_logits (lm_head matmul, gather, vocab slice, FP32 cast) per
        row count, against the same with SGLang's own gatherer."""
        proc = mdl.logits_processor
        routed, kept = proc._logits_gatherer, proc._logits_gatherer.keywords["stock"]
        meta = LogitsMetadata(forward_mode=ForwardMode.DECODE)
        result = {}
        for m in ROWS:
            gen = torch.Generator().manual_seed(7919 * salt + m)
            hidden = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16)
            before = len(launches)
            got = proc._get_logits(hidden, mdl.lm_head, meta, use_logits_buffer=False)
            ran = len(launches) - before
            proc._logits_gatherer = kept
            try:
                want = proc._get_logits(hidden, mdl.lm_head, meta, use_logits_buffer=False)
            finally:
                proc._logits_gatherer = routed
            result[str(m)] = {"kernel": ran, "equal": same_bits(got, want),
                              "shape": list(got.shape), "dtype": str(got.dtype),
                              "vocab": vocab}
        return result

    out["plugin"]["gather"] = gathers(lp, 1)
    out["plugin"]["processor"] = processor(model, 1)
    out["names"] = _names(runner, lp, engine)

    mark("again")  # the explicit call on a runner already served: nothing rebuilt
    out["again"] = {"served": list(engine.install_sglang_logits_gather(runner).rows),
                    "same": lp.head_gather is g,
                    "polled": len(runner.__dict__.get(engine.POLLED, []))}

    mark("update_same")  # SGLang 0.5.23's weight update hands back the same model
    runner.update_model_fields(model, model_path=f"{run}/llama", load_format="dummy",
                               load_config=runner.load_config)
    out["update_same"] = {"same": lp.head_gather is g, "stock_kept": (
        lp._logits_gatherer.keywords.get("stock") is stock)}

    def load():
        return load_model_with_memory_saver(
            model_config=runner.model_config, load_config=runner.load_config, device="cpu",
            gpu_id=rank, memory_saver_adapter=runner.memory_saver_adapter,
            is_draft_worker=False).model

    mark("update_new")  # a new model object: routed through the gather built at load
    new = load()
    runner.update_model_fields(new, model_path=f"{run}/llama", load_format="dummy",
                               load_config=runner.load_config)
    new_lp = new.logits_processor
    out["update_new"] = {"new_object": runner.model is new and new is not model,
                         "same_gather": getattr(new_lp, "head_gather", None) is g}
    if out["update_new"]["same_gather"]:
        out["update_new"].update(gather=gathers(new_lp, 2), processor=processor(new, 2))

    mark("explicit")  # the explicit call on a bare model, SGLang's TP group by default
    bare = load()
    served = engine.install_sglang_logits_gather(bare).rows
    bare_lp = bare.logits_processor
    eg = getattr(bare_lp, "head_gather", None)
    out["explicit"] = {"served": list(served), "own_gather": eg is not None and eg is not g}
    if eg is not None:
        g_saved, g = g, eg
        out["explicit"]["gather"] = gathers(bare_lp, 3)
        out["explicit"]["processor"] = processor(bare, 3)
        g = g_saved

    mark("fp32")  # an FP32 lm_head (the model config's enable_lm_head_fp32): FP32 logits
    config32 = ModelConfig.from_server_args(args, model_path=f"{run}/llama32")
    fp32 = load_model_with_memory_saver(
        model_config=config32, load_config=runner.load_config, device="cpu", gpu_id=rank,
        memory_saver_adapter=runner.memory_saver_adapter, is_draft_worker=False).model
    fp32_lp = fp32.logits_processor
    outcome = engine.install_sglang_logits_gather(fp32)
    fg = getattr(fp32_lp, "head_gather", None)
    out["fp32"] = {"flag": fp32_lp.use_fp32_lm_head, "served": list(outcome.rows),
                   "dtype": outcome.dtype, "own_gather": fg is not None and fg is not g,
                   "gather_dtype": str(getattr(fg, "dtype", None))}
    if fg is not None:
        g_saved, g = g, fg
        out["fp32"]["gather"] = gathers(fp32_lp, 6, torch.float32)
        out["fp32"]["processor"] = processor(fp32, 6)
        g = g_saved

    mark("draft")  # the EAGLE draft worker's runner: its head has the target's shard width
    draft_config = ModelConfig.from_server_args(args, model_path=f"{run}/eagle",
                                                is_draft_model=True)
    draft = ModelRunner(model_config=draft_config, mem_fraction_static=0.5, gpu_id=rank,
                        nccl_port=0, server_args=args, is_draft_worker=True)
    dlp = draft.model.logits_processor
    dg = getattr(dlp, "head_gather", None)
    dstock = getattr(dlp._logits_gatherer, "keywords", {}).get("stock")
    out["draft"] = {"model": type(draft.model).__name__, "shared": dg is g,
                    "routed": (isinstance(dlp._logits_gatherer, functools.partial)
                               and dlp._logits_gatherer.func is g
                               and isinstance(dstock, MultimemAllGatherer) and dstock is not stock),
                    "polled": [x is g for x in draft.__dict__.get(engine.POLLED, [])],
                    "shard": list(draft.model.lm_head.weight.shape)}
    if dg is g:
        out["draft"].update(gather=gathers(dlp, 4), processor=processor(draft.model, 4))

    mark("draft3")  # an EAGLE3 draft head of its own vocabulary: its own gather
    draft3_config = ModelConfig.from_server_args(args, model_path=f"{run}/eagle3",
                                                 is_draft_model=True)
    draft3 = ModelRunner(model_config=draft3_config, mem_fraction_static=0.5, gpu_id=rank,
                         nccl_port=0, server_args=args, is_draft_worker=True)
    d3lp = draft3.model.logits_processor
    d3g = getattr(d3lp, "head_gather", None)
    out["draft3"] = {"model": type(draft3.model).__name__,
                     "served": None if d3g is None else sorted(d3g.rows),
                     "own_gather": d3g is not None and d3g is not g,
                     "routed": (isinstance(d3lp._logits_gatherer, functools.partial)
                                and d3lp._logits_gatherer.func is d3g and isinstance(
                                    d3lp._logits_gatherer.keywords.get("stock"),
                                    MultimemAllGatherer)),
                     "polled": [x is d3g for x in draft3.__dict__.get(engine.POLLED, [])],
                     "shard": list(draft3.model.lm_head.weight.shape)}
    if d3g is not None:
        g_saved, g = g, d3g
        out["draft3"].update(gather=gathers(d3lp, 5), processor=processor(draft3.model, 5,
                                                                          DRAFT_VOCAB))
        g = g_saved
    mark("end")
    dist.barrier(group=cpu_group)
    return out


def _launch(run, table):
    """In SGLang's interpreter: the 2 ranks, with the deadline of tests/spawn.py."""
    from pathlib import Path

    from spawn import spawn

    spawn(_rank, 2, Path(run), run, table, group=False, deadline_s=DEADLINE_S)


# ---- the tests (in the suite's interpreter) ------------------------------------------

@pytest.fixture(scope="module", params=HOST_ISAS)
def ranks(request, tmp_path_factory):
    """Every test below, on a host whose CPU has AMX and on one without
    (tests/engine_cpu.py): SGLang's ISA choice never decides whether the bed builds."""
    require_sglang()
    run = tmp_path_factory.mktemp("sglang_real")
    for name, config in (("llama", LLAMA), ("eagle", EAGLE), ("eagle3", EAGLE3),
                         ("llama32", LLAMA_FP32)):
        (run / name).mkdir()
        (run / name / "config.json").write_text(json.dumps(config))
    table = run / "table.yaml"
    table.write_text(TABLE)  # vocab 1024: the target and EAGLE heads; 512: the EAGLE3 head
    results, logs = run_ranks("test_sglang_real", run, table, request.param, DEADLINE_S)
    return request.param, results, logs


def _assert_rows(gather, what, served, dtype="torch.bfloat16"):
    """Served rows: the stand-in kernel ran once and gave SGLang's bytes, sentinels
    scrubbed (and sentinels were planted, so that differs from SGLang's own); the other
    rows: SGLang's own bytes, no kernel. The other dtype: SGLang's own, always."""
    assert sorted(gather) == [str(m) for m in ROWS], what
    for m, row in gather.items():
        assert row["sentinels"] > 0, (what, m)  # planted: scrubbed != stock
        assert row["other_stock"] and row["dtype"] == dtype, (what, m)
        if int(m) in served:
            assert row["kernel"] == 1 and row["scrubbed"] and not row["stock"], (what, m, row)
            assert row["poisoned_launch"], (what, m)
        else:
            assert row["kernel"] == 0 and row["stock"] and not row["scrubbed"], (what, m, row)


def _assert_processor(processor, what, served):
    assert sorted(processor) == [str(m) for m in ROWS], what
    for m, row in processor.items():
        assert row["equal"], (what, m)
        assert row["shape"] == [int(m), row["vocab"]] and row["dtype"] == "torch.float32", \
            (what, m)
        assert row["kernel"] == (1 if int(m) in served else 0), (what, m, row)


def test_plugin_hooks_sglangs_model_runner_once(ranks):
    isa, results, _ = ranks
    for r in results:
        assert r["hooked"] == {"load": True, "update": True}
        assert r["amx_told"] is (isa == "amx-seen")  # the simulated host reached SGLang


def test_plugin_route_through_a_real_load_model(ranks):
    for r in ranks[1]:
        p = r["plugin"]
        # rows_from_sglang: SGLang's max running requests x its rows per decode request
        assert p["model"] == "LlamaForCausalLM" and p["served"] == PLUGIN_SERVED
        assert p["routed"] and p["polled"] == [True]
        assert p["shard"] == [512, HIDDEN]  # V=1000 padded to 1024, 512 rows a rank
        _assert_rows(p["gather"], "plugin", PLUGIN_SERVED)
        _assert_processor(p["processor"], "plugin", PLUGIN_SERVED)


def test_explicit_call(ranks):
    for r in ranks[1]:
        assert r["again"] == {"served": PLUGIN_SERVED, "same": True, "polled": 1}
        e = r["explicit"]  # rows=None: every enabled row of the table
        assert e["served"] == SERVED and e["own_gather"]
        _assert_rows(e["gather"], "explicit", SERVED)
        _assert_processor(e["processor"], "explicit", SERVED)


def test_update_model_fields(ranks):
    for r in ranks[1]:
        assert r["update_same"] == {"same": True, "stock_kept": True}
        u = r["update_new"]
        assert u["new_object"] and u["same_gather"]
        _assert_rows(u["gather"], "update_new", PLUGIN_SERVED)  # the gather built at load
        _assert_processor(u["processor"], "update_new", PLUGIN_SERVED)


def test_an_fp32_lm_head_is_routed_through_a_float32_gather(ranks):
    """Issue 42: a model whose config asks for an FP32 lm_head (``enable_lm_head_fp32``:
    SGLang's ``use_fp32_lm_head``) gathers FP32 logits. The explicit call routes it
    through its own gather built for float32 (the table's float32 section, not the BF16
    one of the same V): on planted FP32 data (-0.0, NaN payloads, ±Inf, denormals) the
    served rows are SGLang's own bytes with -0.0 sent as +0.0, the poisoned launch
    output included, the other rows and every BF16 call SGLang's own; SGLang's real
    ``_get_logits`` (an FP32 matmul on CPU) equals its own."""
    for r in ranks[1]:
        f = r["fp32"]
        assert f["flag"] is True and f["served"] == SERVED and f["dtype"] == "float32"
        assert f["own_gather"] and f["gather_dtype"] == "torch.float32"
        _assert_rows(f["gather"], "fp32", SERVED, "torch.float32")
        _assert_processor(f["processor"], "fp32", SERVED)


def test_eagle_draft_runner_shares_the_targets_gather(ranks):
    """The EAGLE draft worker's runner (is_draft_worker): its head has the target's shard
    width, so the target's gather serves it (no second build), its runner polls it, and
    on planted data every row is bitwise SGLang's own draft gatherer (scrubbed where
    served, poisoned launch output included) and SGLang's _get_logits."""
    for r in ranks[1]:
        d = r["draft"]
        assert d["model"] == "LlamaForCausalLMEagle" and d["shard"] == [512, HIDDEN]
        assert d["shared"] and d["routed"] and d["polled"] == [True]
        _assert_rows(d["gather"], "draft", PLUGIN_SERVED)
        _assert_processor(d["processor"], "draft", PLUGIN_SERVED)


def test_eagle3_draft_runner_gets_its_own_gather(ranks):
    """An EAGLE3 draft head of its own vocabulary (512: 256 a rank): its own install,
    agreed by both ranks, at the draft rows (2 requests x topk 1), bitwise as above."""
    for r in ranks[1]:
        d = r["draft3"]
        assert d["model"] == "LlamaForCausalLMEagle3" and d["shard"] == [256, HIDDEN]
        assert d["served"] == PLUGIN_SERVED and d["own_gather"] and d["routed"]
        assert d["polled"] == [True]
        _assert_rows(d["gather"], "draft3", PLUGIN_SERVED)
        _assert_processor(d["processor"], "draft3", PLUGIN_SERVED)


def test_sglang_names_the_integration_relies_on(ranks):
    for r in ranks[1]:
        moved = {name: found for name, found in r["names"].items() if found is not True}
        assert not moved, moved
        assert len(r["names"]) >= 20


def test_log_lines_reach_sglangs_handler(ranks):
    """Our lines through SGLang's configured logging: the registration line once, at the
    first hook call; each install once; the draft's line."""
    _, _, logs = ranks
    for rank, log in enumerate(logs):
        sections = log_sections(log)
        mine = [line for line in log.splitlines() if "lamport-head" in line]
        registered = [x for x in mine if "logits gather hooks registered" in x]
        assert len(registered) == 1 and f"TP{rank}" in registered[0], mine
        routed = "Lamport logits gather on NVIDIA H200 (tp=2, dcp=1, bfloat16 logits) for rows {}"
        plugin, explicit = routed.format("(1, 2)"), routed.format("(1, 2, 4)")
        assert sum(plugin in x for x in sections["plugin"].splitlines()) == 1, sections["plugin"]
        assert sum(explicit in x for x in sections["explicit"].splitlines()) == 1
        assert "the new model's gather routed again" in sections["update_new"]
        assert sum("Lamport logits gather on NVIDIA H200 (tp=2, dcp=1, float32 logits) for "
                   "rows (1, 2, 4)" in x for x in sections["fp32"].splitlines()) == 1
        assert "the SGLang drafter LlamaForCausalLMEagle routed" in sections["draft"]
        summary = [x for x in log.splitlines() if "lamport-head summary" in x]
        assert len(summary) == (2 if rank == 0 else 0), summary  # rank 0: one per drafter
        if rank == 0:
            assert summary[0].endswith(
                "target LlamaForCausalLM: Lamport logits gather for rows [1, 2]; drafter "
                "LlamaForCausalLMEagle: the target's Lamport logits gather (its head has the "
                "target's shard width) for rows [1, 2]; routed on all 2 TP ranks: target "
                "logits gather, drafter logits gather"), summary[0]
            assert summary[1].endswith(
                "drafter LlamaForCausalLMEagle3: its own Lamport logits gather (vocab 512) for "
                "rows [1, 2]; routed on all 2 TP ranks: target logits gather, drafter logits "
                "gather"), summary[1]


def test_sglang_interpreter_is_found():
    """The suite finds SGLang's interpreter (its own venv, or this one)."""
    python = require_sglang()
    assert os.path.exists(python) or python == sys.executable
