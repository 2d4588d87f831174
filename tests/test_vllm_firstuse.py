"""First-use tuning inside the real vLLM load path (each release of the window:
``helpers.VLLM_RELEASES``), on CPU: two server starts, each
2 fresh gloo ranks made by vLLM's ``init_distributed_environment``. On each rank the
real plugin loader wraps the real ``Worker.load_model``, which loads a real small
``LlamaForCausalLM`` (dummy weights, a config written here) through vLLM's
``CPUModelRunner``; the plugin then installs with autotune on (the tests' conftest
turns it off everywhere else) and the rows vLLM's config says (``max_num_seqs``).

Stand-ins, only where this machine has no GPU: the kernel's timing
(``helpers.CollectiveTarget``, a collective cost model in first-use tuning's timing
target), HeadGather's CUDA pieces (``helpers.fake_cuda``: a CPU kernel writing
FAKE_BYTE, a CPU mailbox over gloo) and the runtime facts of the provenance block.

What it shows: the first start measures the rows from vLLM's config (1, the powers of
two and the cap), writes the user table and serves them through the model's real
``compute_logits``; rows vLLM's config does not reach stay vLLM's stock gather,
bitwise; the second start measures nothing, leaves the table as it was and serves.
"""

import json
import re

import pytest
import yaml
from engine_cpu import HOST_ISAS
from helpers import (FAKE_BYTE, CollectiveTarget, as_vllm_rank, fake_cuda, same_bits,
                     spawn_vllm_ranks, vllm_classes, vllm_ranks, vllm_worker)

MAX_NUM_SEQS = 6  # vLLM's config: rows 1..6, measured 1, 2, 4, 6
MEASURED = [1, 2, 4, 6]
VOCAB, HIDDEN = 1000, 64  # padded to 1024 by vLLM: 512 rows of lm_head a rank
FACTS = {"driver": "580.1", "cuda": "13.0", "torch": "2.13.0", "cutlass_dsl": "4.8.0",
         "lamport_head": "0.3.0", "kernel": "abcdef123456"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": VOCAB, "max_position_embeddings": 128,
         "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _rank(rank, world, run, cache, model_dir):
    as_vllm_rank(run, rank, LAMPORT_HEAD_CACHE=cache, LAMPORT_HEAD_AUTOTUNE="1")
    import torch
    import vllm.plugins
    from lamport_head.tuning import firstuse
    from vllm.config import (
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from lamport_head import mailbox, provenance

    configure_logging(LoggingConfig())  # what vLLM's worker_main does first in a worker
    CPUModelRunner = vllm_classes()[0]
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 enforce_eager=True, max_model_len=128),
        load_config=LoadConfig(load_format="dummy"),
        parallel_config=ParallelConfig(tensor_parallel_size=world),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=128,
                                         max_model_len=128, is_encoder_decoder=False))
    with set_current_vllm_config(config):
        vllm_ranks(world, rank, run)
        runner = CPUModelRunner(config, torch.device("cpu"))

    # Stand-ins where there is no GPU: HeadGather's CUDA pieces, one GPU per rank on
    # one host, the runtime facts, and the kernel's timing (a collective cost model).
    fake_cuda(setattr, rank, "ok")
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")
    provenance.facts = lambda: dict(FACTS)
    timed, stocks = [], []

    def make_target(ranks, vocab, limits=firstuse.FIRST_USE_LIMITS, stock=None,
                    dtype="bfloat16", *, stock_kind="nccl-all-gather"):
        stocks.append(stock)  # what first-use tuning was handed to time against
        return CollectiveTarget(ranks, vocab, "", timed)

    firstuse.make_target = make_target

    vllm.plugins.load_general_plugins()  # the real entry point wraps Worker.load_model
    vllm_worker(config, runner).load_model()  # vLLM's: CPUModelRunner.load_model, then
    # the plugin's install

    model = runner.get_model()
    lp = model.logits_processor
    gather = getattr(lp, "head_gather", None)
    out = {"model": type(model).__name__, "timed": len(timed),
           "rows": sorted({r for r, _ in timed}),
           "served": [] if gather is None else sorted(gather.rows), "logits": {},
           # vLLM's own _gather_logits of this processor: the path the route replaces
           "stock_timed": [getattr(s, "__func__", None) is LogitsProcessor._gather_logits
                           and getattr(s, "__self__", None) is lp for s in stocks]}
    g = torch.Generator().manual_seed(5)
    for m in (1, MAX_NUM_SEQS, MAX_NUM_SEQS + 1):
        hidden = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16)
        got = model.compute_logits(hidden)  # the path vLLM's sampler takes
        # vLLM's own gather, called as the class defines it (not the routed attribute)
        shard = lp._apply_head(model.lm_head, hidden, None)
        stock = LogitsProcessor._gather_logits(lp, shard)[..., :lp.org_vocab_size]
        out["logits"][m] = {"shape": list(got.shape), "stock": same_bits(got, stock),
                            "bytes": sorted(set(got.contiguous().view(torch.uint8)
                                                .flatten().tolist()))[:3]}
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module", params=HOST_ISAS)
def starts(request, tmp_path_factory, vllm_release):
    """Two server starts on one user table (the second: fresh processes), on a host whose
    CPU has AMX and on one without (tests/engine_cpu.py), on the installed release."""
    tmp = tmp_path_factory.mktemp("vllm_firstuse")
    model_dir = tmp / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    cache = tmp / "cache"
    results, logs, tables = [], [], []
    for start in range(2):
        run = tmp / f"start{start}"
        run.mkdir()
        result, log = spawn_vllm_ranks(_rank, 2, run, str(run), str(cache), str(model_dir),
                                       host_isa=request.param)
        results.append(result)
        logs.append(log)
        path = cache / "head_gather.yaml"
        tables.append(yaml.safe_load(path.read_text()) if path.exists() else None)
    return results, logs, tables, cache / "head_gather.yaml"


def test_first_start_measures_the_rows_from_vllms_config_and_serves_them(starts):
    results, logs, tables, path = starts
    from lamport_head.tuning.firstuse import FIRST_USE_LIMITS

    for r in results[0]:
        assert r["model"] == "LlamaForCausalLM"
        assert r["rows"] == MEASURED  # 1, the powers of two, the cap: from max_num_seqs
        assert r["timed"] == len(MEASURED) * len(FIRST_USE_LIMITS.ctas)
        assert r["served"] == list(range(1, MAX_NUM_SEQS + 1))
        assert r["stock_timed"] == [True]  # issue 32 item 4: timed against vLLM's own gather
        for m in ("1", str(MAX_NUM_SEQS)):  # served: the (fake) kernel's bytes reach vLLM
            assert r["logits"][m] == {"shape": [int(m), VOCAB], "stock": False,
                                      "bytes": [FAKE_BYTE]}
        beyond = r["logits"][str(MAX_NUM_SEQS + 1)]  # past vLLM's rows: vLLM's own, bitwise
        assert beyond["stock"] and beyond["shape"] == [MAX_NUM_SEQS + 1, VOCAB]
    measured = (r"lamport-head: first-use tuning on NVIDIA H200 \(tp=2, dcp=1, missing\): "
                r"measured rows \[1, 2, 4, 6\] in [\d.]+ s, wrote " + re.escape(str(path)))
    for rank, log in enumerate(logs[0]):
        assert len(re.findall(measured, log)) == 1, (rank, log)
        summary = (r"lamport-head summary: vLLM 0\.3\d\.\d, LlamaForCausalLM, tp=2, dcp=1: "
                   r"Lamport logits gather for rows \[1, 2, 3, 4, 5, 6\] on all 2 TP ranks, "
                   r"through compute_logits\n")
        assert bool(re.search(summary, log)) == (rank == 0), (rank, log)
    (section,) = tables[0]["devices"]["NVIDIA H200"]
    assert section["tp"] == 2 and section["dcp"] == 1 and section["emulated"] is False
    assert section["stock"] == "nccl-all-gather"  # vLLM's _gather_logits
    assert list(section["rows"]) == MEASURED and all(e["enabled"]
                                                     for e in section["rows"].values())
    assert section["provenance"]["command"].startswith("first-use tuning at install")


def test_second_start_measures_nothing_and_serves(starts):
    results, logs, tables, _ = starts
    for r in results[1]:
        assert r["timed"] == 0 and r["served"] == list(range(1, MAX_NUM_SEQS + 1))
        assert r["logits"]["1"]["bytes"] == [FAKE_BYTE]
    for log in logs[1]:
        assert "first-use tuning" not in log
    assert tables[1] == tables[0]  # untouched
