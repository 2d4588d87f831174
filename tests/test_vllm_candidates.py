"""The candidate gathers on the mailbox (issue 32 item 2, vLLM): real vLLM 0.33.0
``LogitsProcessor.get_top_tokens`` / ``get_top_k_tokens`` and ``ParallelLMHead`` on 2
gloo ranks grouped by vLLM's own ``init_distributed_environment``, routed by
``engines.vllm.install_candidate_gather`` (the install core: table sections keyed by
V = TP x packed width, agreement, fail-stop) through a real ``HeadGather`` whose kernel
is the CPU stand-in (``helpers.fake_cuda``): its launch all-gathers the packed shards on
vLLM's gloo group, scrubs sentinel words as the kernel does, and is counted.

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
from helpers import as_vllm_rank, require_vllm, spawn_vllm_ranks
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
    from vllm.distributed import parallel_state as ps
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from helpers import capture_log, fake_cuda, same_bits
    from lamport_head.engines import vllm as engine
    from lamport_head.tuning.support.reference import scrub

    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    backend="gloo", distributed_init_method=f"file://{run}/init")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tp_group().cpu_group
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
    c = engine.install_candidate_gather([lp], group, world, rank, cpu, 1, ROWS,
                                        engine.pair_payloads(), path="drafter get_top_tokens")
    result["pairs"] = {"candidates": list(c), "top": run(lp, top),
                       "other": run(other, top)}
    # the gathered pairs themselves, through vLLM's module global while the route is on
    routes = vars(lp).get(engine._ROUTES, {})
    pairs = torch.tensor([[-0.0, 2.0**23 + 1 + rank], [float("nan"), 16777215.0],
                          [float("-inf"), 5.0], [0.0, -0.0]]).view(torch.int32)
    pairs[1, 0] = 0x7FC01234 + rank  # a NaN payload
    pairs = pairs.view(torch.float32)
    from vllm.model_executor.layers import logits_processor as module

    engine._ACTIVE.routes = routes
    del launches[:]
    try:
        got = module.tensor_model_parallel_all_gather(pairs, dim=-1)
    finally:
        engine._ACTIVE.routes = None
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
            c = engine.install_candidate_gather([lp], group, world, rank, cpu, 1, ROWS,
                                                payloads, path="get_top_k_tokens")
            result["topk"][f"{k} {log_probs}"] = {"candidates": list(c),
                                                  "run": run(lp, top_k(k, log_probs))}
    # dead: the launch writes only poison (on the pairs' route of processor 0)
    dead[0] = True
    result["dead"] = run(processors[0], top)
    engine._ACTIVE.routes = vars(processors[0]).get(engine._ROUTES, {})
    try:
        got = module.tensor_model_parallel_all_gather(pairs, dim=-1)
    finally:
        engine._ACTIVE.routes = None
    result["dead_raw"] = got.view(torch.int32)[0].tolist()
    dead[0] = False

    # no_section: the table holds no section of V = 2 x 24 (fp32 k = 6 values: width 24)
    lp = processors[3]
    c = engine.install_candidate_gather([lp], group, world, rank, cpu, 1, ROWS,
                                        ((6, torch.float32),), path="get_top_k_tokens")
    result["no_section"] = {"candidates": list(c), "routed": engine._ROUTES in vars(lp)}
    # fails: the compile of the pairs' gather fails on rank 1 only
    fake_cuda(setattr, rank, "prepare@1", launch=launch)
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")
    lp = processors[4]
    c = engine.install_candidate_gather([lp], group, world, rank, cpu, 1, ROWS,
                                        engine.pair_payloads(), path="drafter get_top_tokens")
    result["fails"] = {"candidates": list(c), "routed": engine._ROUTES in vars(lp),
                       "top": run(lp, top)}
    result["log"] = seen[:]
    dist.barrier(group=group)
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    require_vllm()
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

    d = engine.Drafter("D", (), False, 256, (), ("drafter get_top_tokens x 2 "
                                                  "(use_local_argmax_reduction: ...)",), "")
    c = engine.Candidates("drafter get_top_tokens x 2", ((8, (1, 2)),), "")
    assert engine.summary("M", 2, 1, (1,), [], drafter=d, candidates=c) == (
        "M, tp=2, dcp=1: Lamport logits gather for rows [1] on all 2 TP ranks, through target "
        "compute_logits; drafter D: no draft step gathers logits; drafter get_top_tokens x 2: "
        "Lamport candidate gather for rows [1, 2] (packed width 8)")
    c = engine.Candidates("drafter get_top_tokens x 2", (), "why")
    assert engine.summary("M", 2, 1, (1,), [], drafter=d, candidates=c).endswith(
        "; drafter get_top_tokens x 2: stock candidate all-gather (why)")
    spec = type("Spec", (), {"num_speculative_tokens": 3, "use_local_argmax_reduction": True})
    assert engine.candidate_path(type("Config", (), {"speculative_config": spec})) == (
        "drafter get_top_tokens x 3")
    assert engine.candidate_path(type("Config", (), {"speculative_config": None})) is None
