"""Batch-sharded sampling on vLLM 0.34's own ``GPUModelRunner.sample`` (its CPU runner
subclasses it), on 2 gloo ranks made by vLLM's own init: the real plugin loader wraps
the real ``Worker.load_model``, which loads a small real ``LlamaForCausalLM`` (dummy
weights) with ``enable_batch_sharded_sampling``; the plugin then installs the Lamport
all-to-all for the rows the table enables (the product's ``AllToAll`` over real ipc
mailboxes of memfd memory, its kernel the CPU stand-in of tests/cpu_kernel.py: no
GPU), and ``sample``'s ``all_to_all_vocab_shards`` goes through it.

What it shows, for even, uneven and empty splits (a rank with no rows) of 1..6
requests: the logits ``sample`` hands its sampler are bitwise those of vLLM's own
``all_to_all_vocab_shards``, with -0.0, NaN and +-Inf among them; the kernel launched
for the served row counts only, once per call, with that step's splits; the routed global called directly on
planted shards (every special word, the sentinel included) returns the reference
all-to-all (``reference_all_to_all``: vLLM's, sentinel words as 0). With batch sharding
off nothing is routed. Rank 0's summary names the all-to-all path.

First-use tuning of the all-to-all has a switch of its own (issue 49 item 3). With
first-use tuning on and a table holding the gather's section only: by default it
measures the all-to-all (its timing a cost model, ``helpers.CollectiveTarget``) against
vLLM's own ``all_to_all_vocab_shards``, writes its section, and ``sample`` takes the
product's ``AllToAll`` bitwise; with ``LAMPORT_HEAD_ALL_TO_ALL=0`` nothing of it is
measured, built or routed (no kernel, no tuner imported), ``sample`` takes vLLM's own,
and the summary says why and how to turn it on.

Stood in, only where this machine lacks what vLLM's CPU path needs (no Triton backend
here: vLLM's ``triton`` is its placeholder):
- ``triton.next_power_of_2`` on vLLM's Triton placeholder (``BatchSharder.__init__``
  sizes its kernel blocks with it): the same function, in Python.
- ``batch_shard._build_shard_plan_kernel``, the Triton kernel inside
  ``BatchSharder.shard_sampler_inputs``: ``_ShardPlan``, the same stores per program
  in torch (vLLM's own host code around it runs: owners, send splits, metadata).
- the runner's ``sampler`` (Triton sampling kernels): it records the logits it is
  handed, which is what the test compares.
- ``model_runner.gather_sampler_output`` (Triton pack kernels): returns what the
  sampler returned (the sampled tokens are not what the all-to-all decides).
Everything between (the owner-sorted hidden states, the real model's
``compute_logits_local``, the all-to-all, the vocab slice) is vLLM's.
"""

import json
import re

import pytest
from engine_cpu import HOST_ISAS
from helpers import (as_vllm_rank, forced_build, same_bits, spawn_vllm_ranks, vllm_classes,
                     vllm_ranks, vllm_worker)
from tables import sections

from lamport_head.table import ALL_TO_ALL_STOCK

MAX_NUM_SEQS = 6  # vLLM's config: M = 1..6 logits rows a step (one per request)
SERVED = [1, 2, 4, 5]  # the table's enabled all-to-all rows (3 disabled, 6 not measured)
REQUESTS = [1, 2, 3, 4, 5, 6]  # splits [1, 0] (rank 1 empty), [1, 1], [2, 1], ... [3, 3]
VOCAB, HIDDEN = 1000, 64  # padded to 1024 by vLLM: 512 rows of lm_head a rank
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": VOCAB, "max_position_embeddings": 128,
         "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "logit_scale": -1.0}  # vLLM's LogitsProcessor scale: zero logits come out -0.0
# the gather's rows (tables.sections: 1-2, 4; unused here, as the summary says) and the
# all-to-all's
TABLE = sections((1024,)) + f"""\
    - tp: 2
      dcp: 1
      vocab: 1024
      stock: {ALL_TO_ALL_STOCK}
      rows:
        1-2: {{ctas: 4, enabled: true}}
        3: {{ctas: 4, enabled: false}}
        4-5: {{ctas: 8, enabled: true}}
"""
SPLITS = {"even": [2, 2], "uneven": [3, 2], "empty": [1, 0], "stock": [2, 1]}
# first-use tuning's rows for the all-to-all (the cost model's Lamport wins at each)
MEASURED = [1, 2, 4, 6]


class _ShardPlan:
    """vLLM's ``_build_shard_plan_kernel`` (batch_shard.py) in torch: ``[grid](*args)``
    does each program's stores, in program order, as the Triton kernel does."""

    def __getitem__(self, grid):
        return self.run

    @staticmethod
    def run(idx_mapping, cu_num_logits, query_start_loc, seq_lens, sorted_logits_indices,
            gathered_src_indices, local_idx_mapping, local_cu_num_logits, local_logits_indices,
            local_expanded_idx_mapping, local_expanded_local_pos, local_seq_lens, owners_ptr,
            num_reqs, local_logits_start, max_num_reqs_per_rank, TP_SIZE, TP_RANK,
            PADDED_NUM_REQS=None, PADDED_NUM_LOGITS_PER_REQ=None, num_warps=None):
        import torch

        reqs = torch.arange(num_reqs)
        counts = (cu_num_logits[1:num_reqs + 1] - cu_num_logits[:num_reqs]).long()
        owners = (reqs % TP_SIZE if owners_ptr is None
                  else owners_ptr[idx_mapping[:num_reqs].long()].long())
        for i in range(num_reqs):
            owner, n = int(owners[i]), int(counts[i])
            lower = owners < owner
            earlier = (owners == owner) & (reqs < i)
            start = int(counts[lower].sum() + counts[earlier].sum())
            first = int(query_start_loc[i + 1]) - n
            indices = torch.arange(first, first + n, dtype=torch.int64)
            sorted_logits_indices[start:start + n] = indices
            local = int(earlier.sum())
            gathered_src_indices[i] = owner * max_num_reqs_per_rank + local
            if i == 0:
                local_cu_num_logits[0] = 0
            if owner == TP_RANK:
                at = start - local_logits_start
                local_idx_mapping[local] = idx_mapping[i]
                local_cu_num_logits[local + 1] = at + n
                local_logits_indices[at:at + n] = indices
                local_expanded_idx_mapping[at:at + n] = idx_mapping[i]
                local_expanded_local_pos[at:at + n] = torch.arange(n)
                local_seq_lens[local] = seq_lens[i]


# ---- what runs on each rank (a spawned process) ------------------------------------

def _rank(rank, world, run, table, model_dir, case="table"):
    """``case``: "table" (the all-to-all's section in ``table``), or first-use tuning on
    with ``table`` holding the gather's section only and the all-to-all switched off ("off":
    ``LAMPORT_HEAD_ALL_TO_ALL=0``) or as it comes ("default": measured)."""
    env = {"LAMPORT_HEAD_TABLE": table}
    if case != "table":
        env.update(LAMPORT_HEAD_AUTOTUNE="1", LAMPORT_HEAD_CACHE=f"{run}/cache")
    if case == "off":
        env["LAMPORT_HEAD_ALL_TO_ALL"] = "0"
    as_vllm_rank(run, rank, **env)
    import sys

    import torch
    import vllm.plugins
    from vllm.config import (LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu import model_runner as runner_module
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample import batch_shard

    import cpu_kernel

    import lamport_head.install as install
    from lamport_head.all_to_all import AllToAll
    from lamport_head.engines.vllm import vocab_shards
    from lamport_head.tuning.support.reference import planted, reference_all_to_all, scrub

    configure_logging(LoggingConfig())  # what vLLM's worker_main does first in a worker
    CPUModelRunner = vllm_classes()[0]
    build = install._build
    forced_build(install)  # the gather's kernel: StandInGather
    stand_in = install._build
    toolchain = cpu_kernel.use(gpu=f"gpu{rank}")

    builds = []  # every all-to-all install built

    def build_all_to_all(group, device, tp, r, shard, entries, budget_s, dtype, stock):
        """The all-to-all as install builds it: the product's AllToAll over real ipc
        mailboxes, its kernel the CPU stand-in (tests/cpu_kernel.py)."""
        if stock == ALL_TO_ALL_STOCK:
            builds.append(sorted(entries))
            return build(group, device, tp, r, shard, entries, budget_s, dtype, stock=stock)
        return stand_in(group, device, tp, r, shard, entries, budget_s, dtype, stock)

    install._build = build_all_to_all
    targets = []  # the collectives first-use tuning timed: (stock kind, whose stock)
    if case == "default":
        from helpers import CollectiveTarget

        from lamport_head.tuning import firstuse

        def make_target(ranks, vocab, limits=None, stock=None, dtype="bfloat16", *,
                        stock_kind=None):
            targets.append([stock_kind, stock is batch_shard.all_to_all_vocab_shards, vocab])
            return CollectiveTarget(ranks, vocab, "", [])

        firstuse.make_target = make_target
    # the stand-ins the module docstring lists (no Triton backend here)
    if not hasattr(triton, "next_power_of_2"):
        triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    batch_shard._build_shard_plan_kernel = _ShardPlan()
    vllm.plugins.load_general_plugins()  # the real entry point wraps Worker.load_model
    original = batch_shard.all_to_all_vocab_shards  # vLLM's own
    out = {"rank": rank}

    def load(sharded):
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                     dtype="bfloat16", enforce_eager=True, max_model_len=128),
            load_config=LoadConfig(load_format="dummy"),
            parallel_config=ParallelConfig(tensor_parallel_size=world,
                                           enable_batch_sharded_sampling=sharded),
            scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                             max_num_batched_tokens=128, max_model_len=128,
                                             is_encoder_decoder=False))
        with set_current_vllm_config(config):
            if "group" not in out:
                out["group"] = True
                vllm_ranks(world, rank, run)
            runner = CPUModelRunner(config, torch.device("cpu"))
        vllm_worker(config, runner).load_model()  # vLLM's load, then the plugin's installs
        return runner

    # 1. batch sharding off: nothing is routed
    if case == "table":
        print("=== off", flush=True)
        runner = load(False)
        out["off"] = {"sharder": runner.batch_sharder is not None,
                      "global_is_vllms": runner_module.all_to_all_vocab_shards is original,
                      "routed": [list(map(str, k)) for k in vocab_shards.routed()]}

    # 2. batch sharding on: sample's all-to-all through the installed collective
    print("=== on", flush=True)
    runner = load(True)
    model = runner.get_model()
    out["builds"], out["targets"] = builds, targets
    out["launchers"] = len(toolchain.launches)  # the all-to-all kernels built
    out["tuner"] = "lamport_head.tuning.firstuse" in sys.modules
    if case == "off":  # vLLM's own: nothing routed
        out["global_is_vllms"] = runner_module.all_to_all_vocab_shards is original
        out["routed"] = [list(map(str, k)) for k in vocab_shards.routed()]
        torch.distributed.barrier()
        return out
    from vllm.distributed import parallel_state

    # as install built it, for this engine's TP group (vLLM's device group) and device
    key = (parallel_state.get_tp_group().device_group, torch.device("cpu"), 512, torch.bfloat16)
    a2a = vocab_shards._ROUTES[key].func
    out["built"] = type(a2a) is AllToAll
    def calls(since=0):
        """The kernel's launches' (M, splits) since the ``since``-th."""
        return [[o[-1], [b - a for a, b in zip(o, o[1:])]] for o in toolchain.calls[since:]]

    seen = []

    class Sampler:  # records what vLLM hands its sampler (its Triton kernels cannot run)
        compute_nans = False

        def __call__(self, logits, input_batch):
            seen.append(logits.clone())
            return "sampled"

        def get_logprobs_dims(self, idx_mapping_np):
            return None

    runner.sampler = Sampler()
    runner_module.gather_sampler_output = (  # Triton pack kernels: the local output back
        lambda local, metadata, **kwargs: type("Out", (), {"num_sampled": local,
                                                           "num_rejected": None})())
    out["on"] = {"sharder": runner.batch_sharder is not None,
                 "wrapped": getattr(runner_module.all_to_all_vocab_shards,
                                    "_lamport_head_wrapped", False),
                 "routed": [list(map(str, k)) for k in vocab_shards.routed()],
                 "splits": {}, "equal": {}, "specials": {}, "calls": {}}
    weight = model.lm_head.weight.data  # this rank's [512, HIDDEN] shard, dummy values
    weight[3::7] = 0  # zero logits: -0.0 after the scale of -1
    weight[5::11] = weight[9::17] = 0
    weight[5::11, 0] = float("inf")  # +Inf and -Inf in every row, by the sign of its
    weight[9::17, 0] = float("-inf")  # hidden[:, 0]
    weight[6::13] = 0
    weight[6::13, 1] = float("nan")
    g = torch.Generator().manual_seed(3)

    def sample(requests, exchange):
        batch = InputBatch.make_dummy(requests, 2 * requests, runner.input_buffers)
        hidden = torch.randn(2 * requests, HIDDEN, generator=g.manual_seed(requests))
        hidden = hidden.to(torch.bfloat16)
        runner_module.all_to_all_vocab_shards = exchange
        del seen[:]
        runner.sample(hidden, batch, None)
        return seen[0] if seen else None

    routed = runner_module.all_to_all_vocab_shards
    for n in REQUESTS:
        before = len(toolchain.calls)
        got, want = sample(n, routed), sample(n, original)
        runner_module.all_to_all_vocab_shards = routed
        out["on"]["calls"][n] = calls(before)
        out["on"]["splits"][n] = runner.batch_sharder.shard_sampler_inputs(
            InputBatch.make_dummy(n, 2 * n, runner.input_buffers), None)[3].num_logits_per_rank
        if want is None:  # this rank owns no request: no logits, none sampled
            out["on"]["equal"][n] = got is None
            continue
        words = want.contiguous().view(torch.int32)
        out["on"]["equal"][n] = same_bits(got, want)
        out["on"]["specials"][n] = {
            "nan": bool(want.isnan().any()), "inf": bool(want.isposinf().any()),
            "-inf": bool(want.isneginf().any()),
            "-0.0": bool(((want == 0) & want.signbit()).any()),
            "sentinel": bool((words == -0x80000000).any())}

    if case == "default":
        torch.distributed.barrier()
        return out

    # 3. the routed global called directly on planted shards: every special word
    direct = {}
    for name, splits in SPLITS.items():
        m = sum(splits)
        shards = [planted(m, 512, generator=torch.Generator().manual_seed(97 * m + q))
                  for q in range(world)]
        result = routed(shards[rank], splits, splits[rank])
        vllms = original(shards[rank], splits, splits[rank])
        reference = reference_all_to_all(shards, splits)[rank]  # sentinel words as 0
        served = m in SERVED  # the Lamport protocol's one change; vLLM's own keeps them
        direct[name] = {"reference": same_bits(result if served else scrub(result), reference),
                        "vllm": same_bits(result, scrub(vllms) if served else vllms),
                        "rows": list(result.shape)}
    out["direct"] = direct
    out["direct_calls"] = calls()[-3:]
    torch.distributed.barrier()
    return out


# ---- the tests ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=HOST_ISAS)
def ranks(request, tmp_path_factory, vllm_release):
    """The ranks' results and logs, on a host whose CPU has AMX and on one without
    (tests/engine_cpu.py), on the installed release (0.34: 0.33 has no such path)."""
    if vllm_release == "0.33.0":
        pytest.skip("vLLM 0.33 has no all_to_all_vocab_shards (its batch-sharded sampling "
                    "calls all_to_all_logits, not routed: tests/test_vllm_exchange.py)")
    tmp = tmp_path_factory.mktemp("vllm_sharded")
    table = tmp / "table.yaml"
    table.write_text(TABLE)
    model_dir = tmp / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    return spawn_vllm_ranks(_rank, 2, tmp, str(tmp), str(table), str(model_dir),
                            host_isa=request.param)


@pytest.fixture(scope="module", params=["off", "default"])
def first_use(request, tmp_path_factory, vllm_release):
    """The ranks' results and logs with first-use tuning on and a table holding the
    gather's section only, the all-to-all switched off ("off") or as it comes
    ("default"): ``(case, results, logs, the user table's text or None)``."""
    if vllm_release == "0.33.0":
        pytest.skip("vLLM 0.33 has no all_to_all_vocab_shards")
    tmp = tmp_path_factory.mktemp(f"vllm_sharded_{request.param}")
    table = tmp / "table.yaml"
    table.write_text(sections((1024,)))
    model_dir = tmp / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    results, logs = spawn_vllm_ranks(_rank, 2, tmp, str(tmp), str(table), str(model_dir),
                                     request.param)
    user = tmp / "cache" / "head_gather.yaml"
    return request.param, results, logs, user.read_text() if user.exists() else None


def _lacks(rank, world):
    import os

    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    from engine_cpu import prepare_process

    prepare_process()
    from lamport_head.engines.vllm import release

    return list(release.lacks(release.exchange_names(release.EXCHANGE_CALLERS)))


def test_the_release_has_the_names_the_all_to_all_relies_on(vllm_release, tmp_path):
    """0.34 has every name the all-to-all's route relies on; 0.33 none of them (its
    batch-sharded sampling calls all_to_all_logits, and it has no DSpark): that path
    stays vLLM's there, before any collective (tests/test_vllm_exchange.py)."""
    from spawn import spawn

    from lamport_head.engines.vllm import release

    (missing,) = spawn(_lacks, 1, tmp_path, group=False)
    if vllm_release == "0.33.0":
        assert missing == [f"{m}:{release.EXCHANGE}" for m in
                           (release.EXCHANGE_HOME, *release.EXCHANGE_CALLERS.values())]
    else:
        assert missing == []


def _sections(log):
    parts = re.split(r"^=== (\w+)\n", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_sharding_off_routes_nothing(ranks):
    for r in ranks[0]:
        assert r["off"] == {"sharder": False, "global_is_vllms": True, "routed": []}


def test_sample_takes_the_installed_all_to_all_bitwise(ranks):
    results, _ = ranks
    for r in results:
        on = r["on"]
        assert r["built"]  # the product's AllToAll, not a stand-in
        assert on["sharder"] and on["wrapped"] and on["routed"] == [["512", "torch.bfloat16"]]
        assert on["splits"] == {str(n): [(n + 1) // 2, n // 2] for n in REQUESTS}
        assert on["equal"] == {str(n): True for n in REQUESTS}
        assert on["calls"] == {str(n): [[n, on["splits"][str(n)]]] if n in SERVED else []
                               for n in REQUESTS}
        for n, found in on["specials"].items():
            assert found == {"nan": True, "inf": True, "-inf": True, "-0.0": True,
                             "sentinel": False}, (n, found)
    assert "1" not in results[1]["on"]["specials"]  # one request: rank 1 owns none


def test_the_routed_global_is_the_reference_all_to_all(ranks):
    for r in ranks[0]:
        rank = r["rank"]
        for name, splits in SPLITS.items():
            assert r["direct"][name] == {"reference": True, "vllm": True,
                                         "rows": [splits[rank], 1024]}, name
        # even, uneven, empty; [2, 1] (M = 3) took vLLM's own
        assert r["direct_calls"] == [[4, [2, 2]], [5, [3, 2]], [1, [1, 0]]]


def test_the_summary_names_the_all_to_all_path(ranks):
    _, logs = ranks
    line = (r"lamport-head summary: vLLM 0\.34\.\d, LlamaForCausalLM, tp=2, dcp=1: "
            r"Lamport logits gather installed for rows \[1, 2, 4\] on all 2 TP ranks, but no "
            r"step takes it: compute_logits_local \(enable_batch_sharded_sampling: an "
            r"all-to-all of vocab-local logits, not a gather\) skips the gather; "
            r"Lamport all-to-all for rows "
            r"\[1, 2, 4, 5\] through GPUModelRunner\.sample's all_to_all_vocab_shards\n")
    for rank, log in enumerate(logs):
        sections = _sections(log)
        assert len(re.findall(line, sections["on"])) == (1 if rank == 0 else 0), sections["on"]
        off = re.findall(r"lamport-head summary: .*\n", sections["off"])
        assert len(off) == (1 if rank == 0 else 0) and "all-to-all" not in "".join(off)


def test_first_use_tuning_measures_the_all_to_all_unless_switched_off(first_use):
    """Issue 49 item 3, on vLLM 0.34's own ``sample``: by default first-use tuning
    measures the all-to-all against vLLM's own, writes its section and sample takes the
    AllToAll bitwise; with LAMPORT_HEAD_ALL_TO_ALL=0 nothing of it is measured, built or
    routed and the summary's clause says why and how to turn it on."""
    case, results, logs, user = first_use
    gather = (r"lamport-head summary: vLLM 0\.34\.\d, LlamaForCausalLM, tp=2, dcp=1: "
              r"Lamport logits gather installed for rows \[1, 2, 4\] on all 2 TP ranks, but no "
              r"step takes it: compute_logits_local \(enable_batch_sharded_sampling: an "
              r"all-to-all of vocab-local logits, not a gather\) skips the gather; ")
    if case == "off":
        clause = ("GPUModelRunner.sample's all_to_all_vocab_shards: stock all-to-all "
                  "(switched-off: first-use tuning of the all-to-all is switched off "
                  "(LAMPORT_HEAD_ALL_TO_ALL=0) and no table holds a section for NVIDIA H200, "
                  f"tp=2, dcp=1, vocab=1024, stock={ALL_TO_ALL_STOCK}, dtype=bfloat16; to turn "
                  "it on, unset LAMPORT_HEAD_ALL_TO_ALL on every rank (first-use tuning then "
                  "measures it) or tune it into a table (`lamport-head tune --all-to-all` "
                  "under torchrun))")
        for r in results:
            assert r["builds"] == [] and r["launchers"] == 0 and r["targets"] == []
            assert not r["tuner"]  # first-use tuning never started: not even imported
            assert r["global_is_vllms"] and r["routed"] == []
        assert user is None  # nothing measured, nothing written
    else:
        clause = (r"Lamport all-to-all for rows [1, 2, 3, 4, 5, 6] through "
                  "GPUModelRunner.sample's all_to_all_vocab_shards")
        for r in results:
            assert r["targets"] == [[ALL_TO_ALL_STOCK, True, 1024]]  # vLLM's own, timed
            assert r["builds"] == [REQUESTS] and r["launchers"] > 0 and r["built"]
            on = r["on"]
            assert on["wrapped"] and on["routed"] == [["512", "torch.bfloat16"]]
            assert on["equal"] == {str(n): True for n in REQUESTS}
            assert on["calls"] == {str(n): [[n, on["splits"][str(n)]]] for n in REQUESTS}
        assert f"stock: {ALL_TO_ALL_STOCK}" in user and "vocab: 1024" in user
        assert all(f"      {m}: {{ctas:" in user for m in MEASURED)
    for rank, log in enumerate(logs):
        lines = re.findall(r"lamport-head summary: .*\n", log)
        assert len(lines) == (1 if rank == 0 else 0), log[-3000:]
        if rank == 0:
            assert re.fullmatch(gather + re.escape(clause) + "\n", lines[0]), lines[0]
