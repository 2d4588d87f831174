"""The drafter's logits gather routed too (issue 32 items 1 and 5, vLLM): real vLLM
speculative decoding classes of each release of the window (``helpers.VLLM_RELEASES``) on
CPU, on 2 gloo ranks grouped by vLLM's own ``init_distributed_environment``. Each scenario
loads a tiny real ``LlamaForCausalLM`` target and its real EAGLE drafter (dummy weights,
configs written here) through vLLM's ``CPUModelRunner.load_model`` (the target, then the
EAGLE drafter's ``load_model``: 0.33's V1 ``EagleProposer``, 0.34's V2 ``EagleSpeculator``,
the runner's ``speculator``; the drafter's model, sharing what vLLM shares), called by the
real ``Worker.load_model`` the real plugin loader wrapped; the plugin then installs on the
target and on the drafter.

- ``eagle3``: an EAGLE3 head of its own (draft vocabulary 256: shard 128, the target's
  512): its own gather, rows 1 .. max_num_seqs, through the real
  ``Eagle3LlamaForCausalLM.compute_logits`` (draft-to-target id mapping included).
  vLLM keeps an EAGLE3 head apart only when the checkpoint carried lm_head weights
  (``process_eagle_weight`` sets ``has_own_lm_head`` while loading them); dummy weights
  load none, so the class attribute is set here as such a checkpoint would.
- ``eagle``: an EAGLE head without an lm_head: vLLM hands it the target's, so the
  target's gather serves it (no second mailbox).
- ``eagle3_fails``: the drafter's gather fails to build on rank 1 only (its compile):
  the drafter stays stock on both ranks (agreed), the target stays routed (its gather
  was built and agreed before; the drafter's is another, separately agreed).
- ``argmax``: ``use_local_argmax_reduction``: greedy drafts take ``get_top_tokens``
  (candidates, not logits), so no logits gather is built for the drafter; its (value,
  index) pairs take a candidate gather (issue 32 item 2: packed width 8, V = 16),
  through the real ``Eagle3LlamaForCausalLM.get_top_tokens``, bitwise vLLM's.

Stand-ins, only where this machine has no GPU (``helpers.fake_cuda``): HeadGather's
CUDA pieces, its kernel a CPU launch that all-gathers the shard over vLLM's gloo group
and writes the result where the kernel would; each launch is recorded with its rows and
shard width, so the test sees which gathers went through the Lamport path.
"""

import json

import pytest
from engine_cpu import HOST_ISAS
from helpers import (as_vllm_rank, same_bits, spawn_vllm_ranks, vllm_classes, vllm_drafter,
                     vllm_ranks, vllm_worker)
from tables import sections

VOCAB, HIDDEN, DRAFT_VOCAB = 1000, 64, 256  # target: 1024 padded, 512 a rank; EAGLE3: 128
MAX_NUM_SEQS, K = 4, 2  # target rows 1..12, a draft step's 1..4; 2 draft tokens
# served: the table's enabled rows, a gap between two of them filled from the row above
TARGET_SERVED, DRAFT_SERVED = [1, 2, 4, 5, 6, 7, 8], [1, 2, 4]
ROWS = [1, 2, 3, 4, 5]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": VOCAB, "max_position_embeddings": 128,
         "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# One section per vocabulary: the target's (1024) and the EAGLE3 head's (256). Row 8 is
# enabled in both: the target's rows reach 12, the drafter's stop at max_num_seqs = 4.
TABLE = sections((1024, DRAFT_VOCAB, 16), "        8: {ctas: 8, enabled: true}\n",
                 fp32_vocabs=(1024, DRAFT_VOCAB))  # 16: the candidate pairs' gather (packed
# width 8 on 2 ranks); FP32 heads (issue 42): sections of the target's and EAGLE3's V
SCENARIOS = {  # name: (method, draft config dir, use_local_argmax_reduction, fail the drafter,
    # the target's head_dtype override: vLLM's --hf-overrides '{"head_dtype": ...}', or None)
    "eagle3": ("eagle3", "eagle3", False, False, None),
    "eagle": ("eagle", "eagle", False, False, None),
    "eagle3_fp32": ("eagle3", "eagle3", False, False, "float32"),
    "eagle_fp32": ("eagle", "eagle", False, False, "float32"),
    "eagle3_fails": ("eagle3", "eagle3", False, True, None),
    "argmax": ("eagle3", "eagle3", True, False, None),  # last: the MTP case takes its target
}


# ---- what runs on each rank (a spawned process) ------------------------------------

def _rank(rank, world, run, cache, table, models):
    as_vllm_rank(run, rank, LAMPORT_HEAD_TABLE=table, LAMPORT_HEAD_CACHE=cache,
                 LAMPORT_HEAD_AUTOTUNE="0")
    import ctypes

    import torch
    import torch.distributed as dist
    import vllm.plugins
    from vllm.config import (LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig, set_current_vllm_config)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    from helpers import fake_cuda
    from lamport_head import build, mailbox
    from lamport_head.engines import vllm as engine

    configure_logging(LoggingConfig())  # what vLLM's worker_main does first in a worker
    CPUModelRunner, Eagle, _ = vllm_classes()
    Eagle3LlamaForCausalLM.has_own_lm_head = True  # as a checkpoint with lm_head weights

    launches, fail = [], [False]
    group = []

    def launch(logits, out, peers, r, ctas, budget, status, stream):
        """The kernel's stand-in: the all-gather it does, on vLLM's gloo group."""
        launches.append([logits.shape[0], logits.shape[1]])
        parts = [torch.empty_like(logits.view(torch.int32)) for _ in range(world)]
        dist.all_gather(parts, logits.contiguous().view(torch.int32), group=group[0])
        full = torch.cat(parts, dim=1).contiguous()
        ctypes.memmove(out, full.data_ptr(), full.numel() * full.element_size())

    fake_cuda(setattr, rank, "ok", launch=launch)
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")  # one GPU per rank
    kernels = build.TOOLCHAIN
    compiled = kernels.compiled

    def compile_or_fail(tp, words, *args, **kwargs):  # the drafter's compile, rank 1 only
        if fail[0] and rank == 1 and words == DRAFT_VOCAB // world // 2:  # its BF16 words
            raise RuntimeError("injected: the drafter's gather does not compile on rank 1")
        return compiled(tp, words, *args, **kwargs)

    kernels.compiled = compile_or_fail
    vllm.plugins.load_general_plugins()  # the real entry point wraps Worker.load_model

    def load(method, draft_dir, argmax, head):
        target = ModelConfig(model=models["target"], skip_tokenizer_init=True, dtype="bfloat16",
                             enforce_eager=True, max_model_len=128,
                             hf_overrides={"head_dtype": head} if head else {})
        parallel = ParallelConfig(tensor_parallel_size=world)
        spec = SpeculativeConfig(model=models[draft_dir], method=method, num_speculative_tokens=K,
                                 use_local_argmax_reduction=argmax, target_model_config=target,
                                 target_parallel_config=parallel)
        config = VllmConfig(
            model_config=target, load_config=LoadConfig(load_format="dummy"),
            parallel_config=parallel, speculative_config=spec,
            scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                             max_num_batched_tokens=128, max_model_len=128,
                                             is_encoder_decoder=False))
        with set_current_vllm_config(config):
            if not group:
                group.append(vllm_ranks(world, rank, run).cpu_group)
            runner = CPUModelRunner(config, torch.device("cpu"))
        vllm_worker(config, runner).load_model()  # vLLM's: the target, the drafter; then
        # the plugin's installs
        drafter = vllm_drafter(runner)
        return (runner.get_model(), runner.get_draft_model(),
                [type(drafter).__name__, isinstance(drafter, Eagle)])

    g = torch.Generator().manual_seed(11)

    def planted(m, width, dtype=torch.bfloat16):
        """A shard of fresh logits with -0.0, NaN, +Inf and -Inf planted (no word is the
        mailbox sentinel: the real kernel moves that one pair as (+0, +0); an FP32 -0.0
        is that word, so FP32 plants none there: the stand-in does not scrub)."""
        x = torch.randn(m, width, generator=g).to(dtype)
        for row in range(m):
            x[row, 4 * row + 1] = -0.0 if dtype == torch.bfloat16 else 1e-42  # FP32: a denormal
            x[row, 4 * row + 2] = float("nan")
            x[row, 4 * row + 5] = float("inf")
            x[row, 4 * row + 7] = float("-inf")
        return x

    def stock_logits(model, lp, hidden):
        """The model's compute_logits on vLLM's own gather (the routed attribute off)."""
        routed = vars(lp).pop("_gather_logits", None)
        try:
            return model.compute_logits(hidden)
        finally:
            if routed is not None:
                lp._gather_logits = routed

    def check(model, lp, width, dtype=torch.bfloat16):
        """For each row count: the gather on planted ``dtype`` data (the logits' dtype) and
        the model's compute_logits, each bitwise vLLM's stock; and the (rows, shard) the
        stand-in kernel launched."""
        equal = {}
        del launches[:]
        for m in ROWS:
            x = planted(m, width, dtype)
            gathered = same_bits(lp._gather_logits(x), LogitsProcessor._gather_logits(lp, x))
            hidden = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16)
            logits = same_bits(model.compute_logits(hidden), stock_logits(model, lp, hidden))
            equal[m] = gathered and logits
        return equal, [list(c) for c in launches]

    def check_top(model, lp):
        """The drafter's get_top_tokens, routed and with vLLM's own method (the routed
        instance attribute off), bitwise; the stand-in kernel's launches."""
        equal = {}
        del launches[:]
        for m in ROWS:
            hidden = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16)
            routed = model.get_top_tokens(hidden)
            wrapper = vars(lp).pop("get_top_tokens")
            try:
                equal[m] = same_bits(routed, model.get_top_tokens(hidden))
            finally:
                lp.get_top_tokens = wrapper
        return equal, [list(c) for c in launches]

    out = {"rank": rank, "eagle_class": Eagle.__name__}
    for name, (method, draft_dir, argmax, failing, head) in SCENARIOS.items():
        print(f"=== {name}", flush=True)
        fail[0] = failing
        model, draft, proposer = load(method, draft_dir, argmax, head)
        tlp, _, _ = engine.find_gather_target(model)
        dlp, dhead, where = engine.find_drafter_target(draft)
        tgather, dgather = getattr(tlp, "head_gather", None), getattr(dlp, "head_gather", None)
        out[name] = {
            "proposer": proposer, "drafter": type(draft).__name__, "where": where,
            "head_shared": draft.lm_head is model.lm_head,
            "draft_shard": list(dhead.weight.shape),
            "target_served": None if tgather is None else sorted(tgather.rows),
            "draft_served": None if dgather is None else sorted(dgather.rows),
            "same_gather": dgather is not None and dgather is tgather,
            "head_dtypes": [str(tlp.head_dtype), str(dlp.head_dtype)],
            "gather_dtypes": [str(getattr(x, "dtype", None)) for x in (tgather, dgather)],
        }
        dtype = torch.float32 if head == "float32" else torch.bfloat16
        out[name]["draft"] = check(draft, dlp, dhead.weight.shape[0], dtype)
        if argmax:
            out[name]["top"] = check_top(draft, dlp)
        out[name]["target"] = check(model, tlp, model.lm_head.weight.shape[0], dtype)
    # An MTP drafter's nesting (DeepSeekMTP: the processor at model.logits_processor, each
    # MTP layer's shared_head.head the target's lm_head once vLLM shares it), real vLLM
    # layers, on the last scenario's target: found, and served by the target's gather.
    print("=== mtp", flush=True)
    from torch import nn

    class Predictor(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"1": nn.Module()})
            self.layers["1"].shared_head = nn.Module()
            self.layers["1"].shared_head.head = model.lm_head  # as _maybe_share_lm_head does
            self.logits_processor = LogitsProcessor(VOCAB)

    class MTPShaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Predictor()

        def compute_logits(self, hidden, spec_step_idx=0):
            return self.model.logits_processor(self.model.layers["1"].shared_head.head, hidden)

    with set_current_vllm_config(VllmConfig()):
        mtp = MTPShaped()
    from lamport_head.outcome import Ranks

    drafter = engine.install_drafter_gather(mtp, model, Ranks(group[0], world, rank,
                                                              torch.device("cpu")),
                                            rows=tuple(range(1, MAX_NUM_SEQS + 1)),
                                            paths=((f"drafter compute_logits x {K}",), ()))
    said = [drafter.name, list(drafter.served), drafter.outcome.shared, drafter.vocab,
            list(drafter.through), list(drafter.around), drafter.outcome.message]
    out["mtp"] = {"where": engine.find_drafter_target(mtp)[2], "drafter": said,
                  "check": check(mtp, mtp.model.logits_processor, 512)}
    print("=== end", flush=True)
    dist.barrier(group=group[0])
    return json.loads(json.dumps(out))


# ---- the tests ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=HOST_ISAS)
def ranks(request, tmp_path_factory, vllm_release):
    """Every test below, on a host whose CPU has AMX and on one without (the pin of
    tests/engine_cpu.py), on the installed release of the window."""
    tmp = tmp_path_factory.mktemp("vllm_drafter")
    table = tmp / "table.yaml"
    table.write_text(TABLE)
    models = {}
    for name, config in (("target", LLAMA), ("eagle", LLAMA),
                         ("eagle3", dict(LLAMA, draft_vocab_size=DRAFT_VOCAB))):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        models[name] = str(tmp / name)
    return spawn_vllm_ranks(_rank, 2, tmp, str(tmp), str(tmp / "cache"), str(table), models,
                            host_isa=request.param)


def _sections(log):
    import re

    parts = re.split(r"^=== (\w+)\n", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _summary(log, name):
    lines = [line for line in _sections(log)[name].splitlines() if "lamport-head summary:" in line]
    assert len(lines) == 1, (name, lines)
    release, _, line = lines[0].split("lamport-head summary: ", 1)[1].partition(", ")
    assert release.startswith("vLLM 0.3"), lines[0]  # the running release named first
    return line


def _launched(rows, width):
    """The stand-in kernel's launches for ``check``: the gather, then compute_logits."""
    return [[m, width] for m in ROWS if m in rows for _ in range(2)]


TARGET = (f"LlamaForCausalLM, tp=2, dcp=1: Lamport logits gather for rows {TARGET_SERVED} on "
          "all 2 TP ranks, through target compute_logits; ")


def test_real_eagle_drafters_are_built(ranks):
    results, _ = ranks
    for r in results:
        # vLLM's EAGLE drafter of this release (helpers.vllm_classes), for every method
        assert {n: r[n]["proposer"] for n in SCENARIOS} == dict.fromkeys(
            SCENARIOS, [r["eagle_class"], True])
        assert r["eagle3"]["drafter"] == "Eagle3LlamaForCausalLM"
        assert r["eagle3"]["draft_shard"] == [DRAFT_VOCAB // 2, HIDDEN]  # its own head
        assert r["eagle3"]["head_shared"] is False
        assert r["eagle"]["drafter"] == "EagleLlamaForCausalLM"
        assert r["eagle"]["head_shared"] is True  # vLLM gave it the target's lm_head


def test_eagle3_head_of_its_own_gets_its_own_gather(ranks):
    results, logs = ranks
    for r in results:
        s = r["eagle3"]
        assert s["where"] == "Eagle3LlamaForCausalLM.logits_processor"
        assert s["target_served"] == TARGET_SERVED  # 1..12 from max_num_seqs x (1 + K)
        assert s["draft_served"] == DRAFT_SERVED and not s["same_gather"]  # 1..max_num_seqs
        equal, launched = s["draft"]
        assert equal == {str(m): True for m in ROWS}  # served rows and the others: stock bits
        assert launched == _launched(DRAFT_SERVED, DRAFT_VOCAB // 2)
        equal, launched = s["target"]
        assert equal == {str(m): True for m in ROWS}
        assert launched == _launched(TARGET_SERVED, 512)
    assert _summary(logs[0], "eagle3") == TARGET + (
        f"drafter Eagle3LlamaForCausalLM: its own Lamport logits gather (vocab {DRAFT_VOCAB}) "
        f"for rows {DRAFT_SERVED}, through drafter compute_logits x {K}")
    assert "lamport-head summary" not in logs[1]  # rank 0's line only


def test_eagle_with_the_targets_head_shares_the_targets_gather(ranks):
    results, logs = ranks
    for r in results:
        s = r["eagle"]
        assert s["target_served"] == TARGET_SERVED and s["same_gather"]
        equal, launched = s["draft"]
        assert equal == {str(m): True for m in ROWS}
        # the target's gather serves the processor's calls at its own rows (draft steps
        # reach 1..4 of them), shard 512
        assert launched == _launched(TARGET_SERVED, 512)
    assert _summary(logs[0], "eagle") == TARGET + (
        "drafter EagleLlamaForCausalLM: the target's Lamport logits gather (its head has the "
        f"target's shard width) for rows {DRAFT_SERVED}, through drafter compute_logits x {K}")
    for log in logs:
        assert ("lamport-head: the drafter EagleLlamaForCausalLM routed at "
                "EagleLlamaForCausalLM.logits_processor through the gather already built"
                in _sections(log)["eagle"])


def test_drafter_failing_on_one_rank_stays_stock_on_every_rank_target_routed(ranks):
    results, logs = ranks
    for r in results:
        s = r["eagle3_fails"]
        assert s["draft_served"] is None  # stock on both ranks: the failure was agreed
        assert s["target_served"] == TARGET_SERVED  # built and agreed before: still routed
        equal, launched = s["draft"]
        assert equal == {str(m): True for m in ROWS} and launched == []
        equal, launched = s["target"]
        assert equal == {str(m): True for m in ROWS}
        assert launched == _launched(TARGET_SERVED, 512)
    line = _summary(logs[0], "eagle3_fails")
    assert line.startswith(TARGET + "drafter Eagle3LlamaForCausalLM: stock logits gather for "
                           f"drafter compute_logits x {K} (")
    assert "does not compile on rank 1" in logs[1]


def test_fp32_heads_route_the_target_and_the_drafters_through_float32_gathers(ranks):
    """Issue 42: with vLLM's ``--hf-overrides '{"head_dtype": "float32"}'`` the target's
    and the drafter's processors project into FP32 (vLLM's own ModelConfig.head_dtype);
    the target is served by a gather built for float32 (its float32 section), the
    EAGLE3 head by its own float32 gather, an EAGLE head of the target's lm_head by the
    target's (same shard width, same dtype); on planted FP32 data and through
    compute_logits every row is bitwise vLLM's own; rank 0's summary names float32."""
    results, logs = ranks
    for r in results:
        for name in ("eagle3_fp32", "eagle_fp32"):
            s = r[name]
            assert s["head_dtypes"] == ["torch.float32", "torch.float32"], name
            assert s["target_served"] == TARGET_SERVED and s["draft_served"] == (
                TARGET_SERVED if name == "eagle_fp32" else DRAFT_SERVED), name
            assert s["gather_dtypes"] == ["torch.float32", "torch.float32"], name
            assert s["same_gather"] is (name == "eagle_fp32")
            for path, width in (("draft", DRAFT_VOCAB // 2 if name == "eagle3_fp32" else 512),
                                ("target", 512)):
                equal, launched = s[path]
                assert equal == {str(m): True for m in ROWS}, (name, path)
                served = (DRAFT_SERVED if path == "draft" and name == "eagle3_fp32"
                          else TARGET_SERVED)
                assert launched == _launched(served, width), (name, path)
    target = TARGET.replace("on all 2 TP ranks, through", "on all 2 TP ranks (float32 logits), "
                            "through")
    assert _summary(logs[0], "eagle3_fp32") == target + (
        f"drafter Eagle3LlamaForCausalLM: its own Lamport logits gather (vocab {DRAFT_VOCAB}) "
        f"for rows {DRAFT_SERVED} (float32 logits), through drafter compute_logits x {K}")
    assert _summary(logs[0], "eagle_fp32") == target + (
        "drafter EagleLlamaForCausalLM: the target's Lamport logits gather (its head has the "
        f"target's shard width) for rows {DRAFT_SERVED} (float32 logits), through drafter "
        f"compute_logits x {K}")


def test_local_argmax_reduction_routes_the_drafters_candidates(ranks):
    results, logs = ranks
    for r in results:
        s = r["argmax"]
        assert s["target_served"] == TARGET_SERVED and s["draft_served"] is None
        assert s["draft"][0] == {str(m): True for m in ROWS} and s["draft"][1] == []
        equal, launched = s["top"]
        assert equal == {str(m): True for m in ROWS}
        assert launched == [[m, 8] for m in ROWS if m in DRAFT_SERVED]
    assert _summary(logs[0], "argmax") == TARGET + (
        f"drafter Eagle3LlamaForCausalLM: no draft step gathers logits; drafter get_top_tokens "
        f"x {K}: Lamport candidate gather for rows {DRAFT_SERVED} (packed width 8)")


def test_summary_names_every_path():
    """Without a drafter the line is the one it was; with one, each path is named."""
    from lamport_head.engines import vllm as engine
    from lamport_head.outcome import Outcome, Reason

    assert engine.summary("vLLM 0.33.0", "M", 2, 1, Outcome.serving((1,))) == (
        "vLLM 0.33.0, M, tp=2, dcp=1: Lamport logits gather for rows [1] on all 2 TP ranks, "
        "through compute_logits")
    d = engine.Drafter("D", Outcome.serving((1,)), 256, ("drafter compute_logits x 1",), ())
    assert engine.summary("vLLM 0.34.0", "M", 2, 1, Outcome.kept(Reason.NO_ROWS, "why"),
                          drafter=d) == (
        "vLLM 0.34.0, M, tp=2, dcp=1: stock logits gather on all 2 TP ranks (no-rows: why); "
        "drafter D: its own Lamport logits gather (vocab 256) for rows [1], through drafter "
        "compute_logits x 1")
    spec = type("Spec", (), {"num_speculative_tokens": 3, "use_local_argmax_reduction": True,
                             "draft_sample_method": "probabilistic"})
    config = type("Config", (), {"speculative_config": spec})
    through, around = engine.drafter_paths(config)
    assert through[0].startswith("drafter compute_logits x 3 (probabilistic")
    assert around[0].startswith("drafter get_top_tokens x 3")


def test_mtp_nesting_is_found_and_shares_the_targets_gather(ranks):
    results, _ = ranks
    for r in results:
        s = r["mtp"]
        assert s["where"] == "MTPShaped.model.logits_processor"
        assert s["drafter"] == ["MTPShaped", DRAFT_SERVED, True, 1024,
                                [f"drafter compute_logits x {K}"], [], ""]
        equal, launched = s["check"]
        assert equal == {str(m): True for m in ROWS}
        assert launched == _launched(TARGET_SERVED, 512)
