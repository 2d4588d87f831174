"""The candidate gathers on the mailbox (issue 32 item 2, vLLM): real vLLM (each release of
the window: ``helpers.VLLM_RELEASES``) ``LogitsProcessor.get_top_tokens`` /
``get_top_k_tokens`` and ``ParallelLMHead`` on 2 gloo ranks grouped by vLLM's own
``init_distributed_environment``, routed by ``engines.vllm.install_candidate_gather`` (the
install core: table sections keyed by V = TP x packed width, agreement, fail-stop) through a
real ``HeadGather`` whose kernel is the CPU stand-in (``helpers.fake_cuda``): its launch
all-gathers the packed shards on vLLM's gloo group, scrubs sentinel words as the kernel
does, and is counted.

Each scenario compares the routed call with vLLM's unrouted code on the same planted
logits (the processor's ``_apply_head`` stood in per call: -0.0 and +0.0 maxima, ties
within a rank and across ranks, NaN, -Inf, vLLM's padding mask), bitwise:

- ``pairs``: ``get_top_tokens``, and the gathered pairs themselves (-0.0 values, NaN
  payloads, indices past 2**23) against vLLM's all-gather; a processor not routed and
  ``_gather_logits`` keep vLLM's all-gather (no launch);
- ``topk``: ``get_top_k_tokens`` for k in 1, 2, 5, with and without log-probs (values
  BF16, ids int64, log-partition fp32: one gather per packed width);
- ``dead``: the stand-in kernel writes only poison: the routed results are the poison's,
  not vLLM's (the output really is the launch's);
- ``no_section``: no table section for the packed width: stock on every rank, said why;
- ``fails``: the gather's compile fails on rank 1 only: stock on both ranks (agreed).
"""

import pytest
from helpers import as_vllm_rank, spawn_vllm_ranks, vllm_ranks, vllm_worker
from tables import sections

VOCAB, HIDDEN, SHARD = 1000, 16, 512  # padded to 1024: rank 1's shard ends in 24 padding rows
ROWS = (1, 2, 3, 4, 5)
SERVED = [1, 2, 4]  # the table's enabled rows among ROWS
KS = (1, 2, 5)
# Packed widths on 2 ranks (V = 2 x width): 8 (pairs; log-partition; values k <= 4), 16
# (values k = 5; ids k = 2), 40 (ids k = 5). 8 x 2 = 16 .. 40 x 2 = 80.
TABLE = sections((16, 32, 80))
POISON = 0x11


def _rank(rank, world, run, table):
    as_vllm_rank(run, rank, LAMPORT_HEAD_TABLE=table, LAMPORT_HEAD_AUTOTUNE="0",
                 LAMPORT_HEAD_CACHE=str(run / "cache"))
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        return _scenarios(rank, world, run)


def _scenarios(rank, world, run):
    import ctypes
    import types

    import torch
    import torch.distributed as dist
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from helpers import capture_log, fake_cuda, same_bits
    from lamport_head.engines import vllm as engine
    from lamport_head.engines.vllm import candidates as seam  # its routes, for the raw checks
    from lamport_head.outcome import Ranks
    from lamport_head.tuning.support.reference import scrub

    group = vllm_ranks(world, rank, run).cpu_group
    cpu = torch.device("cpu")
    launches, dead = [], [False]

    def launch(shard, out, peers, r, ctas, budget, status, stream):
        """The kernel's stand-in: the output poisoned, then the all-gather the kernel
        does (sentinel words scrubbed) written over it, unless ``dead``."""
        launches.append(list(shard.shape))
        nbytes = shard.shape[0] * world * shard.shape[1] * 2
        ctypes.memset(out, POISON, nbytes)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        full = scrub(torch.cat(parts, dim=1)).contiguous()
        if not dead[0]:
            ctypes.memmove(out, full.data_ptr(), nbytes)

    fake_cuda(setattr, rank, "ok", launch=launch)
    import lamport_head.mailbox as mailbox

    mailbox.device_key = lambda device: ("host", f"gpu{rank}")  # one GPU per rank
    seen = capture_log()
    g = torch.Generator().manual_seed(23)

    head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=torch.bfloat16)
    processors = [LogitsProcessor(VOCAB) for _ in range(5)]

    def planted(m):
        """This rank's [m, SHARD] logits (the same seed on both ranks, then made rank's):
        row 0 ties across ranks at +Inf-free maxima, row 1 a -0.0 max, row 2 a NaN,
        row 3 a tie within the rank, the rest random; -Inf and signed zeros sprinkled."""
        x = torch.randn(world, m, SHARD, generator=g).to(torch.bfloat16) - 4
        x[:, :, 7::31] = float("-inf")
        x[:, :, 5::37] = -0.0
        x[:, :, 6::41] = 0.0
        x[:, 0, 100] = 3.5  # a tie across the ranks (and within: the same column)
        x[:, 0, 300] = 3.5
        if m > 1:
            x[:, 1, :] = -x[:, 1, :].abs() - 1
            x[0, 1, 9] = -0.0  # rank 0's max is -0.0, rank 1's +0.0
            x[1, 1, 9] = 0.0
        if m > 2:
            x[1, 2, 17] = float("nan")
        if m > 3:
            x[:, 3, 40] = x[:, 3, 41] = 9.0  # ties within each rank
        return x[rank].clone()

    def stood_in(lp, logits):
        lp._apply_head = lambda lm_head, hidden, bias: logits.clone()  # vLLM masks in place

    def compare(lp, m, call):
        """(routed result, vLLM's unrouted result) for the same planted logits."""
        logits = planted(m)
        hidden = torch.zeros(m, HIDDEN, dtype=torch.bfloat16)
        stood_in(lp, logits)
        routed = call(lp, hidden, True)
        stood_in(lp, logits)
        return routed, call(lp, hidden, False)

    def top(lp, hidden, routed):
        method = lp.get_top_tokens if routed else LogitsProcessor.get_top_tokens.__get__(lp)
        return (method(head, hidden),)

    def top_k(k, log_probs):
        def call(lp, hidden, routed):
            method = (lp.get_top_k_tokens if routed
                      else LogitsProcessor.get_top_k_tokens.__get__(lp))
            return method(head, hidden, k, return_log_probs=log_probs)
        return call

    def run(lp, call):
        out = {}
        for m in ROWS:
            del launches[:]
            routed, stock = compare(lp, m, call)
            out[m] = [all(same_bits(a, b) for a, b in zip(routed, stock)), launches[:]]
        return out

    result = {"rank": rank}
    # pairs: get_top_tokens on processor 0; processor 1 is not routed
    lp, other = processors[0], processors[1]
    c = engine.install_candidate_gather([lp], Ranks(group, world, rank, cpu), ROWS,
                                        engine.pair_payloads(), path="drafter get_top_tokens")
    result["pairs"] = {"candidates": _said(c), "top": run(lp, top),
                       "other": run(other, top)}
    # the gathered pairs themselves, through vLLM's module global while the route is on
    routes = vars(lp).get(seam._ROUTES, {})
    pairs = torch.tensor([[-0.0, 2.0**23 + 1 + rank], [float("nan"), 16777215.0],
                          [float("-inf"), 5.0], [0.0, -0.0]]).view(torch.int32)
    pairs[1, 0] = 0x7FC01234 + rank  # a NaN payload
    pairs = pairs.view(torch.float32)
    from vllm.model_executor.layers import logits_processor as module

    seam._ACTIVE.routes = routes
    del launches[:]
    try:
        got = module.tensor_model_parallel_all_gather(pairs, dim=-1)
    finally:
        seam._ACTIVE.routes = None
    result["pairs"]["raw"] = [same_bits(got, tensor_model_parallel_all_gather(pairs, dim=-1)),
                              launches[:]]
    # _gather_logits (vLLM's logits gather, not routed here) inside no candidate method
    del launches[:]
    logits = planted(4)
    result["pairs"]["logits"] = [same_bits(LogitsProcessor._gather_logits(lp, logits),
                                           tensor_model_parallel_all_gather(logits)),
                                 launches[:]]
    # the same pairs past 2**23: the head's shard indices moved (vLLM's float path)
    far = types.SimpleNamespace(num_org_vocab_padding=0,
                                org_vocab_start_index=rank * (2**23 + 3) + 2**22)
    real, head.shard_indices = head.shard_indices, far
    result["pairs"]["far"] = run(lp, top)
    head.shard_indices = real

    # topk: one processor per (k, log-probs), its payloads' gathers built by install
    lp = processors[2]
    result["topk"] = {}
    for k in KS:
        for log_probs in (False, True):
            payloads = engine.top_k_payloads(k, torch.bfloat16, log_probs)
            c = engine.install_candidate_gather([lp], Ranks(group, world, rank, cpu), ROWS,
                                                payloads, path="get_top_k_tokens")
            result["topk"][f"{k} {log_probs}"] = {"candidates": _said(c),
                                                  "run": run(lp, top_k(k, log_probs))}
    # dead: the launch writes only poison (on the pairs' route of processor 0)
    dead[0] = True
    result["dead"] = run(processors[0], top)
    seam._ACTIVE.routes = vars(processors[0]).get(seam._ROUTES, {})
    try:
        got = module.tensor_model_parallel_all_gather(pairs, dim=-1)
    finally:
        seam._ACTIVE.routes = None
    result["dead_raw"] = got.view(torch.int32)[0].tolist()
    dead[0] = False

    # no_section: the table holds no section of V = 2 x 24 (fp32 k = 6 values: width 24)
    lp = processors[3]
    c = engine.install_candidate_gather([lp], Ranks(group, world, rank, cpu), ROWS,
                                        ((6, torch.float32),), path="get_top_k_tokens")
    result["no_section"] = {"candidates": _said(c), "routed": seam._ROUTES in vars(lp)}
    # fails: the compile of the pairs' gather fails on rank 1 only
    fake_cuda(setattr, rank, "prepare@1", launch=launch)
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")
    lp = processors[4]
    c = engine.install_candidate_gather([lp], Ranks(group, world, rank, cpu), ROWS,
                                        engine.pair_payloads(), path="drafter get_top_tokens")
    result["fails"] = {"candidates": _said(c), "routed": seam._ROUTES in vars(lp),
                       "top": run(lp, top)}
    result["log"] = seen[:]
    dist.barrier(group=group)
    return result


def _said(c):
    """A ``Candidates`` as JSON: ``[path, [[width, rows], ...], why]``."""
    return [c.path, [[w, list(rows)] for w, rows in c.served],
            f"{c.kept.reason.label}: {c.kept.message}" if c.kept else ""]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, vllm_release):
    tmp = tmp_path_factory.mktemp("vllm_candidates")
    (tmp / "table.yaml").write_text(TABLE)
    results, logs = spawn_vllm_ranks(_rank, 2, tmp, tmp, str(tmp / "table.yaml"))
    return results, logs


def _served(run):
    return {int(m): v for m, v in run.items()}


def _check(run, width):
    """Every row bitwise vLLM's; served rows launched once at ``width``, others none."""
    for m, (equal, launched) in _served(run).items():
        assert equal, m
        assert launched == ([[m, width]] if m in SERVED else []), (m, launched)


def test_get_top_tokens_routed_bitwise(ranks):
    results, _ = ranks
    for r in results:
        s = r["pairs"]
        assert s["candidates"] == ["drafter get_top_tokens", [[8, SERVED]], ""]
        _check(s["top"], 8)
        _check(s["far"], 8)
        for m, (equal, launched) in _served(s["other"]).items():  # not routed: vLLM's
            assert equal and launched == [], m
        assert s["raw"] == [True, [[4, 8]]]  # -0.0, NaN payloads, 2**23 + 1: bitwise
        assert s["logits"] == [True, []]  # _gather_logits keeps vLLM's all-gather


def test_get_top_k_tokens_routed_bitwise(ranks):
    import torch

    from lamport_head.candidates import packed_width

    results, _ = ranks
    for r in results:
        for k in KS:
            for log_probs in (False, True):
                s = r["topk"][f"{k} {log_probs}"]
                widths = sorted({packed_width(k, torch.bfloat16), packed_width(k, torch.int64)}
                                | ({8} if log_probs else set()))
                assert s["candidates"] == ["get_top_k_tokens", [[w, SERVED] for w in widths],
                                           ""], (k, log_probs)
                # launches per served row: one per payload (values, ids, log-partition)
                for m, (equal, launched) in _served(s["run"]).items():
                    assert equal, (k, log_probs, m)
                    want = ([packed_width(k, torch.bfloat16), packed_width(k, torch.int64)]
                            + ([8] if log_probs else []))
                    assert sorted(w for _, w in launched) == (sorted(want) if m in SERVED
                                                              else []), (k, log_probs, m)


def test_the_output_is_the_launchs(ranks):
    """A launch that writes only poison: the routed pairs are the poison's halves."""
    results, _ = ranks
    poison = POISON | POISON << 8
    for r in results:
        for m, (equal, launched) in _served(r["dead"]).items():
            assert launched == ([[m, 8]] if m in SERVED else []), m
            assert equal is (m not in SERVED), m  # served rows: the poison's tokens
        assert r["dead_raw"] == [poison | poison << 16] * 4  # [4, 4]: row 0, both ranks


def test_no_section_for_the_packed_width_stays_stock(ranks):
    results, _ = ranks
    for r in results:
        path, served, why = r["no_section"]["candidates"]
        assert served == [] and not r["no_section"]["routed"]
        assert "vocab=48" in why, why


def test_a_build_failing_on_one_rank_leaves_every_rank_stock(ranks):
    results, _ = ranks
    for r in results:
        s = r["fails"]
        assert s["candidates"][1] == [] and not s["routed"]
        for m, (equal, launched) in _served(s["top"]).items():
            assert equal and launched == [], m
    assert any("compile failed" in line for line in results[1]["log"])


def test_summary_names_the_candidate_path():
    from lamport_head.engines import vllm as engine

    from lamport_head.outcome import Outcome, Reason

    d = engine.Drafter("D", Outcome.kept(Reason.NOT_GATHERED, "argmax"), 256, (),
                       ("drafter get_top_tokens x 2 (use_local_argmax_reduction: ...)",))
    c = engine.Candidates("drafter get_top_tokens x 2", ((8, Outcome.serving((1, 2))),))
    one = Outcome.serving((1,))
    assert engine.summary("vLLM 0.33.0", "M", 2, 1, one, drafter=d, candidates=[c]) == (
        "vLLM 0.33.0, M, tp=2, dcp=1: Lamport logits gather for rows [1] on all 2 TP ranks, "
        "through target compute_logits; drafter D: no draft step gathers logits; drafter "
        "get_top_tokens x 2: Lamport candidate gather for rows [1, 2] (packed width 8)")
    c = engine.Candidates("drafter get_top_tokens x 2", ((8, Outcome.kept(Reason.NO_ROWS,
                                                                             "why")),))
    assert engine.summary("vLLM 0.33.0", "M", 2, 1, one, drafter=d, candidates=[c]).endswith(
        "; drafter get_top_tokens x 2: stock candidate all-gather (no-rows: why)")
    spec = type("Spec", (), {"num_speculative_tokens": 3, "use_local_argmax_reduction": True})
    assert engine.candidate_path(type("Config", (), {"speculative_config": spec})) == (
        "drafter get_top_tokens x 3")
    assert engine.candidate_path(type("Config", (), {"speculative_config": None})) is None


# ---- the plugin finds compute_candidates' caller (a real DFlash2 drafter) -------------
#
# The real ``DFlash2Qwen3ForCausalLM`` (and a real ``Qwen3ForCausalLM`` target), dummy
# weights, configs written here, built on 2 gloo ranks inside the real ``Worker.load_model``
# the real plugin loader wrapped. vLLM 0.33 serves DFlash2 only on Model Runner V2, which
# needs Triton (absent on CPU), and its config validation refuses DFlash2 on V1: so the
# speculative config is set after VllmConfig's validation and a runner stand-in's
# ``load_model`` builds the two real models as V2's would (``get_model``,
# ``get_draft_model``). 0.34 has only V2, whose DFlash2 speculator would build them; the
# same stand-in serves both releases, so what differs between them here is vLLM's model and
# processor code, not the runner's wiring. ``compute_candidates`` runs vLLM's code; only the
# processor's ``_apply_head`` is stood in per call (planted logits), as above.

DFLASH_K, DFLASH_SEQS, DFLASH_STEPS = 5, 2, 2  # candidate rows 1 .. 2 x 2 = 4
DFLASH_TABLE = sections((2 * 16, 2 * 40))  # k = 5: values BF16 width 16, ids int64 width 40
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
         "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
         "head_dim": 8, "num_hidden_layers": 2, "vocab_size": VOCAB,
         "max_position_embeddings": 128, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}


def _dflash2(top_k):
    return dict(QWEN3, architectures=["DFlash2DraftModel"], num_hidden_layers=1, block_size=4,
                dflash_config={"selector_rank": 4, "selector_top_k": top_k,
                               "target_layer_ids": [0, 1], "mask_token_id": VOCAB - 1,
                               "conv_kernel_size": 2, "conv_group_size": 8})


DFLASH_SCENARIOS = {"dflash2": DFLASH_K,  # k = 5: both widths in the table: routed
                    "no_section": 3}  # k = 3: widths 8 and 24, no section: stock


def _planted(g, world, rank, m, shard):
    """This rank's [m, shard] BF16 logits: ties across and within ranks, a -0.0 max on
    one rank against +0.0 on the other, a NaN, -Inf and signed zeros sprinkled."""
    import torch

    x = torch.randn(world, m, shard, generator=g).to(torch.bfloat16) - 4
    x[:, :, 7::31] = float("-inf")
    x[:, :, 5::37] = -0.0
    x[:, :, 6::41] = 0.0
    x[:, 0, 100] = x[:, 0, 300] = 3.5
    if m > 1:
        x[:, 1, :] = -x[:, 1, :].abs() - 1
        x[0, 1, 9], x[1, 1, 9] = -0.0, 0.0
    if m > 2:
        x[1, 2, 17] = float("nan")
    if m > 3:
        x[:, 3, 40] = x[:, 3, 41] = 9.0
    return x[rank].clone()


def _dflash_rank(rank, world, run, table, models):
    as_vllm_rank(run, rank, LAMPORT_HEAD_TABLE=table, LAMPORT_HEAD_AUTOTUNE="0",
                 LAMPORT_HEAD_CACHE=str(run / "cache"))
    import ctypes

    import torch
    import torch.distributed as dist
    import vllm.plugins
    from vllm.config import (LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig, set_current_vllm_config)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    from helpers import fake_cuda, same_bits
    from lamport_head import mailbox
    from lamport_head.tuning.support.reference import scrub

    configure_logging(LoggingConfig())
    launches, group = [], []

    def launch(shard, out, peers, r, ctas, budget, status, stream):
        """The kernel's stand-in: the all-gather it does (sentinel words scrubbed)."""
        launches.append(list(shard.shape))
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group[0])
        full = scrub(torch.cat(parts, dim=1)).contiguous()
        ctypes.memmove(out, full.data_ptr(), full.numel() * 2)

    fake_cuda(setattr, rank, "ok", launch=launch)
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")
    vllm.plugins.load_general_plugins()  # the real entry point wraps Worker.load_model

    class Runner:
        """V2's runner's two models (it needs Triton), built in its load_model."""

        def __init__(self, config):
            self.config = config

        def load_model(self, load_dummy_weights=False):
            before = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # as vLLM's loader sets the model dtype
            try:
                self.model = Qwen3ForCausalLM(vllm_config=self.config)
                self.draft = DFlash2Qwen3ForCausalLM(vllm_config=self.config)
            finally:
                torch.set_default_dtype(before)

        def get_model(self):
            return self.model

        def get_draft_model(self):
            return self.draft

    def load(name):
        target = ModelConfig(model=models["target"], skip_tokenizer_init=True, dtype="bfloat16",
                             enforce_eager=True, max_model_len=128)
        parallel = ParallelConfig(tensor_parallel_size=world)
        spec = SpeculativeConfig(model=models[name], method="dflash",
                                 num_speculative_tokens=DFLASH_STEPS, target_model_config=target,
                                 target_parallel_config=parallel)
        config = VllmConfig(model_config=target, load_config=LoadConfig(load_format="dummy"),
                            parallel_config=parallel,
                            scheduler_config=SchedulerConfig(
                                max_num_seqs=DFLASH_SEQS, max_num_batched_tokens=128,
                                max_model_len=128, is_encoder_decoder=False))
        config.speculative_config = spec  # after validation: V1 refuses DFlash2 (see above)
        with set_current_vllm_config(config):
            if not group:
                group.append(vllm_ranks(world, rank, run).cpu_group)
        worker = vllm_worker(config, Runner(config))
        worker.load_model()  # vLLM's; then the plugin's installs
        return worker.model_runner.draft

    g = torch.Generator().manual_seed(29)
    out = {"rank": rank}
    for name, top_k in DFLASH_SCENARIOS.items():
        print(f"=== {name}", flush=True)
        draft = load(name)
        lp = draft.candidate_logits_processor
        shard = draft.lm_head.weight.shape[0]
        runs = {}
        for m in ROWS:
            logits = _planted(g, world, rank, m, shard)
            hidden = torch.zeros(m, HIDDEN, dtype=torch.bfloat16)
            lp._apply_head = lambda lm_head, h, bias: logits.clone()  # vLLM masks in place
            del launches[:]
            routed = draft.compute_candidates(hidden)
            launched = launches[:]
            wrapper = vars(lp).pop("get_top_k_tokens", None)  # vLLM's own method
            try:
                stock = draft.compute_candidates(hidden)
            finally:
                if wrapper is not None:
                    lp.get_top_k_tokens = wrapper
            runs[m] = [all(same_bits(a, b) for a, b in zip(routed, stock)),
                       [list(t.shape) for t in routed], sorted(w for _, w in launched)]
        out[name] = {"k": draft.model.candidate_selector.top_k, "runs": runs,
                     "wrapped": wrapper is not None}
    print("=== end", flush=True)
    dist.barrier(group=group[0])
    return out


@pytest.fixture(scope="module")
def dflash(tmp_path_factory, vllm_release):
    import json

    tmp = tmp_path_factory.mktemp("vllm_dflash2")
    (tmp / "table.yaml").write_text(DFLASH_TABLE)
    models = {}
    for name, config in [("target", QWEN3)] + [(n, _dflash2(k))
                                               for n, k in DFLASH_SCENARIOS.items()]:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        models[name] = str(tmp / name)
    return spawn_vllm_ranks(_dflash_rank, 2, tmp, tmp, str(tmp / "table.yaml"), models)


def _summary_of(log, name):
    import re

    parts = re.split(r"^=== (\w+)\n", log, flags=re.M)
    lines = [line for line in dict(zip(parts[1::2], parts[2::2]))[name].splitlines()
             if "lamport-head summary:" in line]
    assert len(lines) == 1, (name, lines)
    release, _, line = lines[0].split("lamport-head summary: ", 1)[1].partition(", ")
    assert release.startswith("vLLM 0.3"), lines[0]  # the running release named first
    return line


def test_plugin_routes_dflash2_compute_candidates(dflash):
    """The plugin finds DFlash2's caller (CANDIDATE_CALLERS), k from its checkpoint's
    selector_top_k, and routes compute_candidates for rows 1 .. max_num_seqs x steps:
    ids and values bitwise vLLM's, one launch per payload on the table's rows."""
    results, logs = dflash
    rows = [m for m in SERVED if m <= DFLASH_SEQS * DFLASH_STEPS]  # 1, 2, 4 of 1 .. 4
    for r in results:
        s = r["dflash2"]
        assert s["k"] == DFLASH_K and s["wrapped"]
        for m, (equal, shapes, launched) in s["runs"].items():
            m = int(m)
            assert equal, m
            assert shapes == [[m, DFLASH_K], [m, DFLASH_K]], m
            assert launched == ([16, 40] if m in rows else []), (m, launched)
    assert _summary_of(logs[0], "dflash2").endswith(
        f"; drafter get_top_k_tokens: Lamport candidate gathers for rows {rows} (packed width "
        f"16), rows {rows} (packed width 40)")


def test_dflash2_without_a_section_stays_stock(dflash):
    results, logs = dflash
    for r in results:
        s = r["no_section"]
        assert s["k"] == 3 and not s["wrapped"]  # no route registered: vLLM's method
        for m, (equal, shapes, launched) in s["runs"].items():
            assert equal and launched == [], m
    line = _summary_of(logs[0], "no_section")
    assert "; drafter get_top_k_tokens: stock candidate all-gather (" in line, line


def test_candidate_callers_match_vllms_sources(vllm_release):
    """Every CANDIDATE_CALLERS entry names a class of its vLLM source file whose
    compute_candidates calls ``self.<processor>.get_top_k_tokens`` with ``self.<k>``
    and return_log_probs as the entry says (read from the installed wheel's source)."""
    import ast
    import importlib.util
    import pathlib

    from lamport_head.engines import vllm as engine

    root = pathlib.Path(importlib.util.find_spec("vllm").origin).parent.parent
    assert {c.model for c in engine.CANDIDATE_CALLERS} == {
        "DFlash2Qwen3ForCausalLM", "LiLiCorrForCausalLM", "DFlash2BeamForCausalLM"}
    for c in engine.CANDIDATE_CALLERS:
        tree = ast.parse((root / c.source).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == c.model)
        method = next(n for n in cls.body
                      if isinstance(n, ast.FunctionDef) and n.name == "compute_candidates")
        calls = [n for n in ast.walk(method) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "get_top_k_tokens"]
        assert len(calls) == 1, c
        call = calls[0]
        assert ast.unparse(call.func.value) == f"self.{c.processor}", c
        assert ast.unparse(call.args[2]) == f"self.{c.k}", c
        flag = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("return_log_probs")
        assert flag == ("True" if c.log_probs else None), c


def test_a_drafter_not_in_the_table_is_unchanged(caplog):
    """No entry: None, no collective (group None would fail one), one debug line."""
    import logging

    import torch

    from lamport_head.engines import vllm as engine
    from lamport_head.outcome import Ranks

    class Other(torch.nn.Module):
        def compute_candidates(self, hidden):
            raise AssertionError("not called")

    draft = Other()
    with caplog.at_level(logging.DEBUG, logger="lamport_head"):
        assert engine.install_drafter_candidates(draft, Ranks(None, 2, 0, "cpu")) is None
    said = [r.getMessage() for r in caplog.records if r.name == "lamport_head"]
    assert said == ["lamport-head: no candidate gather to route: Other is not in "
                    "CANDIDATE_CALLERS (compute_candidates: yes)"]
    assert vars(draft).get("get_top_k_tokens") is None
