"""SGLang DSpark drafts' base-logits gathers against the real SGLang 0.5.23 classes on CPU
(issue 48 items 1 and 2), on 2 gloo ranks made as tests/test_sglang_real.py makes them
(SGLang's own scheduler order, ``load_plugins()``, a real target ``ModelRunner`` of a tiny
``LlamaForCausalLM`` served by the plugin).

Each DSpark draft is built by SGLang's own code with dummy weights: a draft
``ModelRunner(is_draft_worker=True)`` whose ``load_model`` fires our hook, then
``attach_shared_modules(embed_tokens=..., lm_head=the target's)`` as SGLang's DSpark
worker calls it, which installs (engines/sglang_dspark.py):

- ``DSparkDraftModel`` (dense): ``compute_base_logits``' ``gather_and_crop_vocab``, NCCL's
  all-gather, routed through a gather of its own (stock ``nccl-all-gather``: the target's
  is SGLang's multimem gatherer) for its rows ``bs x gamma`` (gamma 2, 2 requests: 2
  and 4);
- DeepSeek V4's ``_logits_from_x_post_hc`` (SGLang's own function, on a shell of
  ``DeepseekV4ForCausalLMDSpark``: the real model does not build on CPU) through the same
  head's route, from its own module's global;
- ``DSparkMiniMaxDraftModel`` (vocab-parallel) with ``SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD=0``:
  its ``_base_logits_gatherer`` (a ``MultimemAllGatherer``) routed through the target's
  gather (the same group, shard width and stock); with it on (and
  ``SGLANG_DSPARK_NVLINK_VOCAB_GATHER`` on and off): no base-logits gather, the
  ``VocabGather`` candidate exchange and ``_fc_gatherer`` named as not routed;
- ``LAMPORT_HEAD_DISABLE=1``: a dense draft on a head of its own stays SGLang's.

Per row count, on planted local logits (``reference.planted``: -0.0, NaN, +-Inf, sentinel
words; SGLang's projection ``project_through_lm_head`` answers them) and on SGLang's real
projection of random hidden rows: ``compute_base_logits`` against SGLang's own (the
route taken out), bitwise (served rows with the sentinel words scrubbed, the protocol's
one change); served rows launch the kernel's CPU stand-in and no SGLang all-gather
(the TP group's ``all_gather`` counted), stock rows the reverse; a served row's explicit
launch into a poisoned output equals SGLang's all-gather, scrubbed; FP32 logits stay
SGLang's. Rank 0's summary lines, and every SGLang DSpark name the module relies on,
looked up in the real modules. On a simulated host with AMX and one without
(tests/engine_cpu.py).
"""

import json
import os

import pytest
from engine_cpu import HOST_ISAS
from sglang_cpu import (log_sections, prepare_rank, require_sglang, run_ranks, scheduler_runtime,
                        stand_in_kernel)
from tables import sections

VOCAB, HIDDEN = 1000, 64  # padded to 1024: 512 rows a rank
GAMMA, REQUESTS = 2, 2
DSPARK_ROWS = [2, 4]  # bs x gamma, bs = 1 .. --max-running-requests
TARGET_ROWS = [1, 2]  # the target's plugin rows: 2 requests x 1
ROWS = [1, 2, 3, 4, 5]  # the row counts compute_base_logits is called with here
# vocab 1024 against SGLang's multimem gatherer (the target's stock) and against NCCL
# (gather_and_crop_vocab's): rows 1-2, 4 enabled, 3 not
MULTIMEM_TABLE = sections((1024,), stock="multimem-all-gather")
TABLE = MULTIMEM_TABLE + sections((1024,)).split("  NVIDIA H200:\n", 1)[1]
DEADLINE_S = 240
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
         "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 2}
DSPARK = dict(LLAMA, architectures=["DSparkDraftModel"], model_type="qwen3", head_dim=16,
              block_size=GAMMA, num_target_layers=1, markov_rank=8, markov_head_type="vanilla",
              enable_confidence_head=False,
              dflash_config={"target_layer_ids": [0], "mask_token_id": 3})
MINIMAX = dict(DSPARK, architectures=["DSparkMiniMaxDraftModel"], hidden_act="silu",
               dense_intermediate_size=128, moe_layer_freq=[0], use_gemma_norm=False,
               qk_norm_type="per_head", sparse_attention_config=None,
               dflash_config={"target_layer_ids": [0], "mask_token_id": 3,
                              "num_target_layers": 1})
TP_SHARD, NVLINK = "SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD", "SGLANG_DSPARK_NVLINK_VOCAB_GATHER"
# each draft in turn: (name, config dir, SGLang's and our switches, head: the target's or
# a fresh model's)
DRAFTS = (("dense", "dspark", {}, "target"),
          ("multimem", "minimax", {TP_SHARD: "0"}, "target"),
          ("local_nvlink", "minimax", {TP_SHARD: "1", NVLINK: "1"}, "target"),
          ("local_nccl", "minimax", {TP_SHARD: "1", NVLINK: "0"}, "target"),
          ("disabled", "dspark", {"LAMPORT_HEAD_DISABLE": "1"}, "fresh"),
          # no section against NCCL's all-gather at this V: first-use tuning is asked
          ("first_use", "dspark", {"LAMPORT_HEAD_AUTOTUNE": "1",
                                   "LAMPORT_HEAD_TABLE": "{run}/multimem.yaml"}, "fresh"))


# ---- what runs on each rank (a spawned process, under SGLang's interpreter) ----------

def _rank(rank, tp, run, table):
    told = prepare_rank(rank, tp, run)
    os.environ.update(LAMPORT_HEAD_TABLE=table, LAMPORT_HEAD_CACHE=f"{run}/cache",
                      LAMPORT_HEAD_AUTOTUNE="0",
                      SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=f"file://{run}/init")
    out = _scenarios(rank, tp, run)
    out["amx_told"] = told
    return out


def _names(draft, dspark):
    """Every SGLang DSpark name engines/sglang_dspark.py relies on, in the real modules:
    {name: found}."""
    import ast
    import importlib
    import importlib.util
    import inspect

    from sglang.srt.environ import envs

    found = {}

    def check(name, test):
        try:
            found[name] = bool(test())
        except Exception as exc:  # a moved name: its test fails naming it
            found[name] = f"{type(exc).__name__}: {exc}"

    models = importlib.import_module("sglang.srt.models.dspark")
    v4 = importlib.import_module("sglang.srt.models.deepseek_v4_dspark")
    minimax = importlib.import_module("sglang.srt.models.dspark_minimax")
    mixin = models.DSparkDraftMixin
    for attr in (dspark.BASE_LOGITS, dspark.ATTACH):
        check(f"DSparkDraftMixin.{attr}", lambda attr=attr: callable(getattr(mixin, attr)))
    check(f"DSparkDraftMixin.{dspark.BASE_GATHERER} (None unless vocab-parallel)",
          lambda: getattr(draft, dspark.BASE_GATHERER) is None)
    check(f"DSparkDraftMixin.{dspark.MARKOV}.{dspark.VOCAB_SHARD}",
          lambda: getattr(getattr(draft, dspark.MARKOV), dspark.VOCAB_SHARD) is None)
    check(f"DSparkDraftMixin.{dspark.GAMMA}", lambda: getattr(draft, dspark.GAMMA) == GAMMA)
    check("DSparkDraftMixin.compute_base_logits calls gather_and_crop_vocab and "
          "_base_logits_gatherer", lambda: all(
              n in inspect.getsource(mixin.compute_base_logits)
              for n in (dspark.CROP + "(", dspark.BASE_GATHERER, dspark.VOCAB_SHARD)))
    for module in (models, v4):
        check(f"{module.__name__}.{dspark.CROP}", lambda m=module: callable(
            getattr(getattr(m, dspark.CROP), "__wrapped__", getattr(m, dspark.CROP))))
    check(f"dspark.{dspark.CROP} calls {dspark.ALL_GATHER}(..., dim=-1), crops to "
          f"{dspark.ORG_VOCAB}", lambda: all(n in inspect.getsource(
              getattr(models.gather_and_crop_vocab, "__wrapped__", models.gather_and_crop_vocab))
              for n in (f"{dspark.ALL_GATHER}(local_logits, dim=-1)", dspark.ORG_VOCAB)))
    model_v4 = v4.DeepseekV4ForCausalLMDSpark
    check(f"DeepseekV4ForCausalLMDSpark: {dspark.LOCAL_FLAG}, {dspark.FP32_FLAG}, "
          f"{dspark.CROP} in _logits_from_x_post_hc", lambda: all(
              n in inspect.getsource(model_v4) for n in (
                  f"self.{dspark.LOCAL_FLAG} =", f"self.{dspark.FP32_FLAG} =",
                  f"return {dspark.CROP}(local_logits, self.lm_head)")))
    check(f"dspark_minimax: {dspark.FC_GATHERER}, supports_vocab_parallel_draft_logits",
          lambda: f"self.{dspark.FC_GATHERER} = MultimemAllGatherer(" in inspect.getsource(
              minimax.MiniMaxDraftBackbone)
          and minimax.DSparkMiniMaxDraftModel.supports_vocab_parallel_draft_logits is True)
    check("VanillaMarkov.configure_tp_shard -> VocabShard(start, gather)", lambda: (
        callable(models.VanillaMarkov.configure_tp_shard)
        and set(models.VocabShard.__struct_fields__) == {"start", "gather"}))
    check(f"envs.{dspark.TP_SHARD_ENV}, envs.{dspark.NVLINK_ENV}", lambda: all(
        hasattr(envs, n) for n in (dspark.TP_SHARD_ENV, dspark.NVLINK_ENV)))
    context = importlib.import_module("sglang.srt.runtime_context")
    check(f"runtime_context.get_spec().{dspark.DRAFT_TOKENS}",
          lambda: hasattr(context.get_spec(), dspark.DRAFT_TOKENS))
    check(f"runtime_context.get_parallel().{dspark.DP_ATTENTION}",
          lambda: getattr(context.get_parallel(), dspark.DP_ATTENTION) is False)
    check(f"lm_head.{dspark.ORG_VOCAB}", lambda: int(getattr(draft.lm_head, dspark.ORG_VOCAB))
          == VOCAB)

    def worker():  # the DSpark worker attaches the target's head after the draft runner
        # loads (its module imports setproctitle, not installed here: read its source)
        path = importlib.util.find_spec(
            "sglang.srt.speculative.dspark_components.dspark_worker_v2").origin
        tree = ast.parse(open(path).read())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                   and n.name == "DSparkWorkerV2")
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        source = ast.unparse(init).replace(" ", "")
        built, attached = source.find("build_draft_tp_worker("), source.find(
            f"self.draft_model.{dspark.ATTACH}(")
        return 0 <= built < attached

    check("DSparkWorkerV2.__init__: build_draft_tp_worker, then attach_shared_modules", worker)
    return found


def _scenarios(rank, tp, run):
    import functools
    import types

    import torch
    import torch.distributed as dist
    from helpers import fake_cuda, same_bits

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import tensor_model_parallel_all_gather
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        load_model_with_memory_saver,
    )
    from sglang.srt.models import deepseek_v4_dspark, dspark as models
    from sglang.srt.plugins import load_plugins

    from lamport_head.collective import together
    from lamport_head.engines import sglang as engine
    from lamport_head.engines import sglang_dspark as dspark
    from lamport_head.kernels.protocol import SENTINEL_I32
    from lamport_head.tuning import firstuse
    from lamport_head.tuning.support import reference

    out = {"rank": rank}

    def mark(name):
        print(f"=== {name}", flush=True)

    load_plugins()
    args, config, cpu_group = scheduler_runtime(rank, tp, run, f"{run}/llama",
                                                max_running_requests=REQUESTS)
    launches = []
    fake_cuda(setattr, rank, "ok", launch=stand_in_kernel(tp, cpu_group, launches))

    # SGLang's all-gathers of the TP group (tensor_model_parallel_all_gather and the
    # multimem gatherer's NCCL path both end here), counted
    tp_group, gathered = get_tp_group(), []
    all_gather = tp_group.all_gather

    def counted(*a, **k):
        gathered.append(1)
        return all_gather(*a, **k)

    tp_group.all_gather = counted

    mark("target")
    target = ModelRunner(model_config=config, mem_fraction_static=0.5, gpu_id=rank,
                         nccl_port=0, server_args=args)
    tg = getattr(target.model.logits_processor, "head_gather", None)
    out["target"] = {"served": None if tg is None else sorted(tg.rows)}

    def fresh_head():
        return load_model_with_memory_saver(
            model_config=target.model_config, load_config=target.load_config, device="cpu",
            gpu_id=rank, memory_saver_adapter=target.memory_saver_adapter,
            is_draft_worker=False).model.lm_head

    def unrouted(model, module):
        """SGLang's own path for ``model``: the route taken out while it runs."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            crop = getattr(module, dspark.CROP)
            base = getattr(model, dspark.BASE_GATHERER, None)
            setattr(module, dspark.CROP, getattr(crop, "__wrapped__", crop))
            if isinstance(base, functools.partial):
                setattr(model, dspark.BASE_GATHERER, base.keywords["stock"])
            try:
                yield
            finally:
                setattr(module, dspark.CROP, crop)
                setattr(model, dspark.BASE_GATHERER, base)

        return scope()

    def base_logits(model, call, module, salt):
        """Per row count: ``call(hidden)`` (SGLang's compute_base_logits path) on planted
        local logits (SGLang's projection in ``module`` answering them) and on SGLang's
        real projection, against SGLang's own on the same inputs."""
        g = dspark.served_gather(model)
        project = module.project_through_lm_head
        result = {}
        for m in ROWS:
            gen = torch.Generator().manual_seed(10007 * salt + 101 * m + rank)
            x = reference.planted(m, 512, generator=gen)
            hidden = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16)

            def run(local, routed=True):
                module.project_through_lm_head = (project if local is None
                                                  else lambda h, head: local)
                try:
                    kernel, sglang = len(launches), len(gathered)
                    if routed:
                        got = call(hidden)
                    else:
                        with unrouted(model, module):
                            got = call(hidden)
                    return got, len(launches) - kernel, len(gathered) - sglang
                finally:
                    module.project_through_lm_head = project

            got, kernel, sglang = run(x)
            want, _, _ = run(x, routed=False)
            row = {"kernel": kernel, "sglang": sglang, "shape": list(got.shape),
                   "sentinels": int((x.view(torch.int32) == SENTINEL_I32).sum()),
                   "stock": same_bits(got, want),
                   "scrubbed": same_bits(got, reference.scrub(want))}
            y = x.float()
            got32, kernel32, _ = run(y)
            row["fp32_stock"] = same_bits(got32, run(y, routed=False)[0]) and kernel32 == 0
            got_p, row["projected_kernel"], _ = run(None)
            want_p = run(None, routed=False)[0]
            row["projected"] = same_bits(got_p, reference.scrub(want_p) if kernel else want_p)
            if g is not None and m in g.rows:
                poisoned = torch.full((m, 1024), 0x7FBF, dtype=torch.int16).view(torch.bfloat16)
                g.launch(x, poisoned, g.plan[m].ctas)
                row["poisoned_launch"] = same_bits(
                    poisoned, reference.scrub(tensor_model_parallel_all_gather(x, dim=-1)))
            result[str(m)] = row
        return result

    asked = []

    def measure(*args, stock=None, stock_kind=None, **kwargs):
        """First-use tuning's measuring, recorded: a call of the stock it is handed (an
        SGLang all-gather, SGLang's bytes) and its kind; then a failure on every rank."""
        x = reference.planted(2, 512, generator=torch.Generator().manual_seed(5 + rank))
        before = len(gathered)
        got = stock(x)
        calls = len(gathered) - before
        asked.append([stock_kind, calls, same_bits(got, tensor_model_parallel_all_gather(x, -1))])
        raise together(RuntimeError("measured elsewhere"))

    firstuse.measure = measure
    heads = {"target": target.model.lm_head}
    for name, path, env, head in DRAFTS:
        mark(name)
        env = {key: value.format(run=run) for key, value in env.items()}
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            draft_config = ModelConfig.from_server_args(args, model_path=f"{run}/{path}",
                                                        is_draft_model=True)
            draft = ModelRunner(model_config=draft_config, mem_fraction_static=0.5,
                                gpu_id=rank, nccl_port=0, server_args=args, is_draft_worker=True)
            model = draft.model
            before = len(launches)
            waiting = (model.lm_head is None and getattr(getattr(model, dspark.ATTACH),
                                                         "_lamport_head_wrapped", False))
            lm_head = heads["target"] if head == "target" else fresh_head()
            # as SGLang's DSpark worker does, after the draft runner loaded
            model.attach_shared_modules(embed_tokens=target.model.model.embed_tokens,
                                        lm_head=lm_head)
            g = dspark.served_gather(model)
            kind = dspark.base_path(model)[0]
            out[name] = {
                "model": type(model).__name__, "waited_for_the_head": waiting,
                "kind": kind, "built_nothing": len(launches) == before,
                "served": None if g is None else sorted(g.rows), "shared": g is not None
                and g is tg, "polled": [x is g for x in draft.__dict__.get(engine.POLLED, [])],
                "dispatching": getattr(getattr(models, dspark.CROP), "_lamport_head_wrapped",
                                       False),
                "rows": list(dspark.rows_from_sglang(model))}
            out[name]["base_logits"] = base_logits(
                model, lambda h, model=model: model.compute_base_logits(h)[0], models,
                salt=len(out))
            if name == "dense":
                out["names"] = _names(model, dspark)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    out["asked"] = asked

    mark("v4")  # DeepSeek V4's own code path, on a shell (the model needs CUDA to build)
    shell = deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark.__new__(
        deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark)
    torch.nn.Module.__init__(shell)
    shell.stages = [types.SimpleNamespace(norm=lambda x: x)]
    shell.lm_head = heads["target"]
    shell.markov_head = types.SimpleNamespace(vocab_shard=None)
    shell._opt_markov_w2_tp_shard, shell._use_fp32_lm_head = False, False
    done = dspark.install_sglang_dspark_gathers(shell, rows=tuple(DSPARK_ROWS))
    out["v4"] = {"routes": [[p, list(o.rows)] for p, o in done.routes],
                 "dispatching": getattr(getattr(deepseek_v4_dspark, dspark.CROP),
                                        "_lamport_head_wrapped", False),
                 "base_logits": base_logits(shell, shell._logits_from_x_post_hc,
                                            deepseek_v4_dspark, salt=99)}
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
    require_sglang()
    run = tmp_path_factory.mktemp("sglang_dspark")
    for name, config in (("llama", LLAMA), ("dspark", DSPARK), ("minimax", MINIMAX)):
        (run / name).mkdir()
        (run / name / "config.json").write_text(json.dumps(config))
    table = run / "table.yaml"
    table.write_text(TABLE)
    (run / "multimem.yaml").write_text(MULTIMEM_TABLE)
    results, logs = run_ranks("test_sglang_dspark_real", run, table, request.param, DEADLINE_S)
    return request.param, results, logs


def _assert_base_logits(rows, what, served, local=False):
    """Served rows: one launch of the kernel's stand-in, no SGLang all-gather, SGLang's
    bytes with the planted sentinel words scrubbed (so not its own), a poisoned launch
    output all written; other rows: SGLang's own bytes through its all-gather (none
    where the base logits stay ``local``), no kernel. FP32 logits: SGLang's own,
    always; SGLang's real projection: the same."""
    width = 512 if local else VOCAB
    assert sorted(rows, key=int) == [str(m) for m in ROWS], what
    for m, row in rows.items():
        assert row["sentinels"] > 0 and row["shape"] == [int(m), width], (what, m, row)
        assert row["fp32_stock"] and row["projected"], (what, m, row)
        if int(m) in served:
            assert row["kernel"] == 1 and row["sglang"] == 0, (what, m, row)
            assert row["scrubbed"] and not row["stock"] and row["poisoned_launch"], (what, m)
            assert row["projected_kernel"] == 1, (what, m)
        else:
            assert row["kernel"] == 0 and row["stock"] and not row["scrubbed"], (what, m, row)
            assert row["projected_kernel"] == 0 and "poisoned_launch" not in row, (what, m)
            assert row["sglang"] == (0 if local else 1), (what, m, row)


def test_a_dense_drafts_gather_and_crop_vocab_takes_its_own_gather(ranks):
    """``DSparkDraftModel``: the hook waits for SGLang to attach the target's head, then
    routes ``gather_and_crop_vocab`` (NCCL's all-gather: not the target's multimem stock,
    so a gather of its own, its NCCL section) for its rows bs x gamma; its runner polls
    the gather; every row bitwise SGLang's own compute_base_logits. The target keeps
    its gather."""
    isa, results, _ = ranks
    for r in results:
        assert r["target"] == {"served": TARGET_ROWS}
        assert r["amx_told"] is (isa == "amx-seen")  # the simulated host reached SGLang
        d = r["dense"]
        assert d["model"] == "DSparkDraftModel" and d["kind"] == "gather_and_crop_vocab"
        assert d["waited_for_the_head"] and d["rows"] == DSPARK_ROWS
        assert d["served"] == DSPARK_ROWS and not d["shared"] and d["polled"] == [True]
        assert d["dispatching"]
        _assert_base_logits(d["base_logits"], "dense", DSPARK_ROWS)


def test_deepseek_v4s_own_gather_and_crop_vocab_is_routed_from_its_module(ranks):
    """DeepSeek V4's DSpark calls ``gather_and_crop_vocab`` from its own module: its
    global is replaced too, and the same head's route (no second gather) serves it."""
    for r in ranks[1]:
        v4 = r["v4"]
        assert v4["dispatching"]
        assert v4["routes"] == [["drafter DeepseekV4ForCausalLMDSpark compute_base_logits's "
                                 "gather_and_crop_vocab (nccl-all-gather)", DSPARK_ROWS]]
        _assert_base_logits(v4["base_logits"], "v4", DSPARK_ROWS)


def test_a_vocab_parallel_drafts_multimem_gatherer_takes_the_targets_gather(ranks):
    """``DSparkMiniMaxDraftModel`` with ``SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD=0``: SGLang
    builds its ``_base_logits_gatherer`` (a ``MultimemAllGatherer``: the target's stock
    kind), routed through the target's gather (the same group, shard width and stock:
    no second mailbox) for the rows that gather serves."""
    for r in ranks[1]:
        d = r["multimem"]
        assert d["model"] == "DSparkMiniMaxDraftModel" and d["kind"] == "_base_logits_gatherer"
        assert d["waited_for_the_head"] and d["served"] == TARGET_ROWS and d["shared"]
        assert d["polled"] == [True]
        _assert_base_logits(d["base_logits"], "multimem", TARGET_ROWS)


@pytest.mark.parametrize("name", ["local_nvlink", "local_nccl"])
def test_a_tp_sharded_markov_head_leaves_the_base_logits_local(ranks, name):
    """``SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD=1`` (``SGLANG_DSPARK_NVLINK_VOCAB_GATHER`` on or
    off: on a CPU SGLang builds its NCCL VocabGather either way): no base-logits gather to
    route (vocab-local logits, no kernel, no all-gather), nothing built; rank 0 says so,
    and names the VocabGather exchanges as not routed."""
    _, results, logs = ranks
    for rank, r in enumerate(results):
        d = r[name]
        assert d["kind"] == "local" and d["served"] is None and d["polled"] == []
        assert d["built_nothing"]
        _assert_base_logits(d["base_logits"], name, [], local=True)
        said = [x for x in log_sections(logs[rank])[name].splitlines() if "lamport-head" in x]
        assert len(said) == (1 if rank == 0 else 0), said  # no install: the summary only
        if rank == 0:
            assert "the base logits stay vocab-local, not gathered" in said[0]
            assert "NcclVocabGather candidate exchange: not routed" in said[0]


def test_lamport_head_disable_keeps_sglangs_gather(ranks):
    """``LAMPORT_HEAD_DISABLE=1`` (on every rank): the dense draft's install stays stock
    on every rank, each saying so; every row SGLang's own."""
    _, results, logs = ranks
    for rank, r in enumerate(results):
        d = r["disabled"]
        assert d["kind"] == "gather_and_crop_vocab" and d["served"] is None
        assert d["polled"] == []
        _assert_base_logits(d["base_logits"], "disabled", [])
        said = log_sections(logs[rank])["disabled"]
        assert "stays stock: disabled by LAMPORT_HEAD_DISABLE [disabled]" in said, said


def test_first_use_tuning_times_sglangs_all_gather_as_the_stock(ranks):
    """No section against NCCL's all-gather at the dense draft's V (only the target's
    multimem one): first-use tuning is handed ``gather_and_crop_vocab``'s all-gather to
    time (a call of it is one SGLang all-gather, SGLang's bytes), with its kind; its
    failure on every rank leaves the draft on SGLang's gather."""
    _, results, logs = ranks
    for rank, r in enumerate(results):
        assert r["asked"] == [["nccl-all-gather", 1, True]], r["asked"]
        d = r["first_use"]
        assert d["served"] is None and d["polled"] == []
        _assert_base_logits(d["base_logits"], "first_use", [])
        said = [x for x in log_sections(logs[rank])["first_use"].splitlines()
                if "lamport-head summary" in x]
        assert said == [] if rank else said[0].endswith(
            "drafter DSparkDraftModel compute_base_logits's gather_and_crop_vocab "
            "(nccl-all-gather): SGLang's gather (tuning-failed: first-use tuning failed: "
            "RuntimeError: measured elsewhere); routed on all 2 TP ranks: target logits "
            "gather"), said


def test_rank_0_names_every_dspark_path(ranks):
    """One summary line per DSpark draft, rank 0's: the target, then every DSpark path of
    a step (served rows and the stock each replaces, SGLang's gather with why, or not
    routed with why), then the routed paths."""
    _, _, logs = ranks
    own = ("SGLang's VocabGather, its own Lamport push on its NVLink plane "
           "(SGLANG_DSPARK_NVLINK_VOCAB_GATHER; NCCL without multicast)")
    head = ("lamport-head summary: SGLang speculative decoding (DSpark), tp=2, dcp=1: target "
            "LlamaForCausalLM: Lamport logits gather for rows [1, 2]; ")
    fc = ("drafter DSparkMiniMaxDraftModel _fc_gatherer: not routed (it gathers fc's hidden "
          "columns of the target's context features, not logits)")
    local = (
        "drafter DSparkMiniMaxDraftModel compute_base_logits: its Markov head is TP-sharded "
        "(SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD): the base logits stay vocab-local, not "
        "gathered; drafter DSparkMiniMaxDraftModel VanillaMarkov's NcclVocabGather candidate "
        "exchange: not routed (each draft step's per-block candidates, rank-stacked [TP x "
        f"rows, 2 x blocks] FP32 (value, index bits), not logits, through {own}); drafter "
        "DSparkMiniMaxDraftModel VanillaMarkov's NcclVocabGather step-logits gather (drafting "
        f"not greedy): not routed (the kept step logits [rows, V/TP] through {own}: no table "
        f"section is measured against it); {fc}; routed on all 2 TP ranks: target logits "
        "gather")
    dense = "drafter DSparkDraftModel compute_base_logits's gather_and_crop_vocab (nccl-all-gather)"
    want = {
        "dense": f"{dense}: Lamport logits gather for rows [2, 4]; routed on all 2 TP ranks: "
                 "target logits gather, drafter base-logits gather",
        "multimem": "drafter DSparkMiniMaxDraftModel compute_base_logits's _base_logits_gatherer "
                    "(multimem-all-gather): Lamport logits gather (the target's: the same shard "
                    f"width and stock) for rows [2]; {fc}; routed on all 2 TP ranks: target "
                    "logits gather, drafter base-logits gather",
        "local_nvlink": local, "local_nccl": local,
        "disabled": f"{dense}: SGLang's gather (disabled: disabled by LAMPORT_HEAD_DISABLE); "
                    "routed on all 2 TP ranks: target logits gather"}
    for rank, log in enumerate(logs):
        sections = log_sections(log)
        for name, tail in want.items():
            lines = [x for x in sections[name].splitlines() if "lamport-head summary" in x]
            assert len(lines) == (1 if rank == 0 else 0), (name, lines)
            if rank == 0:
                assert lines[0].split("] ", 1)[1] == head + tail, (name, lines[0])


def test_sglang_dspark_names_the_integration_relies_on(ranks):
    for r in ranks[1]:
        moved = {name: found for name, found in r["names"].items() if found is not True}
        assert not moved, moved
        assert len(r["names"]) >= 15
