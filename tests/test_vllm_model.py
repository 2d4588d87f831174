"""find_gather_target on stand-ins (no vLLM): the head under get_language_model(), LoRA's
base layer, a subclass with its own gather (kept unless LAMPORT_HEAD_FORCE=1), and
install routing what the model really calls. tests/test_vllm_real.py repeats these on
vLLM's own classes."""

import sys
import types

import torch

from lamport_head import install
from lamport_head.engines import vllm as plugin
from lamport_head.engines.vllm import find_gather_target, install_logits_gather, owns_gather
from lamport_head.outcome import Outcome, Reason

STOCK_MODULE = "vllm.model_executor.layers.logits_processor"


def stock_class():
    """A class named and placed as vLLM's LogitsProcessor, with a stock gather."""

    class LogitsProcessor:
        logits_as_input, head_dtype, use_all_gather = False, None, True

        def _gather_logits(self, logits):
            return ("stock", logits.shape[0])

    LogitsProcessor.__module__, LogitsProcessor.__qualname__ = STOCK_MODULE, "LogitsProcessor"
    return LogitsProcessor


def head():
    return types.SimpleNamespace(weight=torch.zeros(64, 16, dtype=torch.bfloat16), tp_size=2)


class Lm:
    def __init__(self, processor):
        self.logits_processor, self.lm_head = processor, head()


def test_flat_model():
    lp = stock_class()()
    m = Lm(lp)
    assert find_gather_target(m) == (lp, m.lm_head, "Lm.logits_processor")


def test_nested_language_model_and_failing_lookup():
    inner = Lm(stock_class()())

    class KimiK3ForConditionalGeneration:
        def get_language_model(self):
            return inner

    lp, h, where = find_gather_target(KimiK3ForConditionalGeneration())
    assert lp is inner.logits_processor and h is inner.lm_head
    assert where == "KimiK3ForConditionalGeneration.get_language_model().logits_processor"

    class NoneMarked:  # vLLM raises NotImplementedError when no language model is marked
        def get_language_model(self):
            raise NotImplementedError

    assert find_gather_target(NoneMarked()) == (None, None, "no logits_processor on NoneMarked")


def test_lora_wrapper_routes_base_layer_and_unwraps_head():
    base = stock_class()()

    class LogitsProcessorWithLoRA:
        def __init__(self):
            self.base_layer = base

    m = Lm(LogitsProcessorWithLoRA())
    inner_head = m.lm_head
    m.lm_head = types.SimpleNamespace(base_layer=inner_head)  # a LoRA-wrapped lm_head
    lp, h, where = find_gather_target(m)
    assert lp is base and h is inner_head
    assert where.startswith("Lm.logits_processor.base_layer; the base layer of LogitsProcessorWithLoRA")


def test_own_gather_kept_unless_forced(monkeypatch):
    Reason = stock_class()

    class SpecializedDecodeLogitsProcessor(Reason):
        def _gather_logits(self, logits):
            return ("own", logits.shape[0])

    class Inherits(SpecializedDecodeLogitsProcessor):
        pass

    assert not owns_gather(Reason()) and owns_gather(Inherits())
    assert not owns_gather(types.SimpleNamespace(_gather_logits=len))  # instance attr only
    monkeypatch.delenv("LAMPORT_HEAD_FORCE", raising=False)
    lp, h, why = find_gather_target(Lm(SpecializedDecodeLogitsProcessor()))
    assert lp is None and "has its own _gather_logits" in why and "LAMPORT_HEAD_FORCE=1" in why
    monkeypatch.setenv("LAMPORT_HEAD_FORCE", "1")
    m = Lm(SpecializedDecodeLogitsProcessor())
    lp, h, where = find_gather_target(m)
    assert lp is m.logits_processor and "LAMPORT_HEAD_FORCE=1: replaces" in where


class FakeGather:
    def __init__(self, rows, dtype="bfloat16"):
        self.rows, self.dtype = frozenset(rows), getattr(torch, dtype)

    def __call__(self, logits, stock):
        return (("lamport", logits.shape[0])
                if logits.shape[0] in self.rows and logits.dtype == self.dtype else stock(logits))


def _serve(monkeypatch, tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n    - tp: 2\n      dcp: 1\n"
                     "      vocab: 128\n"  # the model's: 2 ranks x 64 rows of lm_head
                     "      rows:\n        1-2: {ctas: 4, enabled: true}\n")
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(table))
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build",
                        lambda g, d, tp, r, shard, entries, budget_s, dtype, stock:
                        FakeGather(entries, dtype))
    monkeypatch.setattr(install, "all_gather_objects", lambda obj, group=None: [obj])  # one rank


def test_install_routes_what_the_model_calls(monkeypatch, tmp_path, caplog):
    _serve(monkeypatch, tmp_path)
    monkeypatch.delenv("LAMPORT_HEAD_FORCE", raising=False)
    base = stock_class()()
    lora = types.SimpleNamespace(base_layer=base)
    m = Lm(lora)
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install_logits_gather(m, None, 2, 0, "cpu").rows == (1, 2)
    assert base._gather_logits(torch.zeros(1, 8, dtype=torch.bfloat16)) == ("lamport", 1)  # what LoRA calls
    assert base._gather_logits(torch.zeros(3, 8, dtype=torch.bfloat16)) == ("stock", 3)
    assert not hasattr(lora, "_gather_logits") and "routed at Lm.logits_processor.base_layer" in caplog.text
    # a subclass's own gather: kept, one line saying so
    Reason = stock_class()

    class Own(Reason):
        def _gather_logits(self, logits):
            return ("own", logits.shape[0])

    caplog.clear()
    own = Lm(Own())
    with caplog.at_level("INFO", logger="lamport_head"):
        assert install_logits_gather(own, None, 2, 0, "cpu").rows == ()
    assert own.logits_processor._gather_logits(torch.zeros(1, 8, dtype=torch.bfloat16)) == ("own", 1)
    assert len(caplog.records) == 1 and "keeps it" in caplog.text
    monkeypatch.setenv("LAMPORT_HEAD_FORCE", "1")
    forced = Lm(Own())
    assert install_logits_gather(forced, None, 2, 0, "cpu").rows == (1, 2)
    assert forced.logits_processor._gather_logits(torch.zeros(1, 8, dtype=torch.bfloat16)) == ("lamport", 1)
    assert forced.logits_processor._gather_logits(torch.zeros(3, 8, dtype=torch.bfloat16)) == ("own", 3)


SERVED = Outcome.serving((1, 2))
WHY = Outcome.kept(Reason.NO_ROWS, "why")


def test_summary_line():
    assert plugin.summary("vLLM 0.34.0", "M", 8, 1, SERVED) == (
        "vLLM 0.34.0, M, tp=8, dcp=1: Lamport logits gather for rows [1, 2] on all 8 TP ranks, "
        "through compute_logits")
    assert plugin.summary("vLLM 0.33.0", "M", 8, 1, WHY) == (
        "vLLM 0.33.0, M, tp=8, dcp=1: stock logits gather on all 8 TP ranks (no-rows: why)")
    others = [("drafter D comm.gather_logits", "its own mailbox")]
    assert plugin.summary("vLLM 0.34.0", "M", 8, 1, SERVED, others=others).endswith(
        "through compute_logits; drafter D comm.gather_logits: not routed (its own mailbox)")


def test_a_bf16_section_does_not_serve_an_fp32_head_and_an_fp32_one_does(monkeypatch, tmp_path,
                                                                           caplog):
    """Issue 42: vLLM's ``head_dtype`` float32 (``--hf-overrides '{"head_dtype":
    "float32"}'``) makes the gathered logits FP32 over the BF16 weight. The table's
    BF16 section (written without ``dtype``) does not serve it: stock, no-rows, the line
    naming the BF16 section it holds instead. With an FP32 section beside it the FP32
    head is routed through a gather built for float32: FP32 calls take the gather,
    BF16 calls of the same rows the stock gather; the outcome and the summary name
    float32."""
    monkeypatch.setenv("LAMPORT_HEAD_AUTOTUNE", "0")
    _serve(monkeypatch, tmp_path)
    built = []
    monkeypatch.setattr(install, "_build", lambda g, d, tp, r, shard, entries, budget_s, dtype,
                        stock: (built.append(dtype), FakeGather(entries, dtype))[1])
    fp32 = Lm(stock_class()())
    fp32.logits_processor.head_dtype = torch.float32
    with caplog.at_level("INFO", logger="lamport_head"):
        stayed = install_logits_gather(fp32, None, 2, 0, "cpu")
    assert stayed.rows == () and stayed.reason is Reason.NO_ROWS and built == []
    assert ("dtype=float32 (the tables hold sections for this vocab and stock measured for "
            "bfloat16 logits only)") in stayed.message
    assert fp32.logits_processor._gather_logits(torch.zeros(1, 8)) == ("stock", 1)
    bf16 = Lm(stock_class()())  # head_dtype None: the model's BF16
    assert install_logits_gather(bf16, None, 2, 0, "cpu").dtype == "bfloat16"
    assert built == ["bfloat16"]

    table = tmp_path / "t.yaml"
    table.write_text(table.read_text() + "    - tp: 2\n      vocab: 128\n      dtype: float32\n"
                     "      rows:\n        1-2: {ctas: 4, enabled: true}\n")
    fp32 = Lm(stock_class()())
    fp32.logits_processor.head_dtype = torch.float32
    served = install_logits_gather(fp32, None, 2, 0, "cpu")
    assert served.rows == (1, 2) and served.dtype == "float32" and built[-1] == "float32"
    gather = fp32.logits_processor._gather_logits
    assert gather(torch.zeros(1, 8, dtype=torch.float32)) == ("lamport", 1)
    assert gather(torch.zeros(1, 8, dtype=torch.bfloat16)) == ("stock", 1)
    assert plugin.summary("vLLM 0.34.0", "M", 2, 1, served) == (
        "vLLM 0.34.0, M, tp=2, dcp=1: Lamport logits gather for rows [1, 2] on all 2 TP ranks "
        "(float32 logits), through compute_logits")


def test_attach_without_vllm_leaves_logging_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    import logging

    before = list(logging.getLogger("lamport_head").handlers)
    assert plugin.attach_to_vllm() is False
    assert logging.getLogger("lamport_head").handlers == before


def _config(sharded=False, v2=True, argmax=None):
    """vLLM's config fields that decide which logits paths its runners take: 0.33's
    (``use_v2_model_runner`` True or False), or 0.34's (``v2=None``: no such field, the
    V2 runner being the only one)."""
    spec = None if argmax is None else types.SimpleNamespace(use_local_argmax_reduction=argmax)
    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(enable_batch_sharded_sampling=sharded),
        speculative_config=spec)
    if v2 is not None:
        config.use_v2_model_runner = v2
    return config


class Sharding(Lm):
    def compute_logits_local(self, hidden):  # e.g. Llama, Qwen 3.5, DeepSeek V4.1
        return hidden


def test_summary_names_only_the_paths_through_the_gather():
    """Batch-sharded sampling samples through compute_logits_local and the drafter's
    local argmax reduction through get_top_tokens: neither gathers logits, so the
    summary does not report the rows as served through them."""
    plain, sharding = Lm(stock_class()()), Sharding(stock_class()())
    assert plugin.logits_paths(plain, _config()) == (["compute_logits"], [])
    assert plugin.logits_paths(plain, None) == (["compute_logits"], [])
    assert plugin.logits_paths(plain, _config(sharded=True)) == (["compute_logits"], [])
    assert plugin.logits_paths(sharding, _config(sharded=True, v2=False)) == (
        ["compute_logits"], [])  # 0.33's V1 runner has no batch-sharded sampling
    for v2 in (True, None):  # 0.33's V2 runner; 0.34, which has no other
        through, around = plugin.logits_paths(sharding, _config(sharded=True, v2=v2, argmax=True))
        assert through == [] and [a.split(" (")[0] for a in around] == [
            "compute_logits_local", "the drafter's get_top_tokens"]
    line = plugin.summary("vLLM 0.34.0", "M", 8, 1, SERVED, through, around)
    assert line.startswith("vLLM 0.34.0, M, tp=8, dcp=1: Lamport logits gather installed for "
                           "rows [1, 2] on all 8 TP ranks, but no step takes it: "
                           "compute_logits_local (")
    assert line.endswith("skip the gather") and "through" not in line
    through, around = plugin.logits_paths(plain, _config(argmax=True))
    assert plugin.summary("vLLM 0.33.0", "M", 8, 1, Outcome.serving((1,)), through, around) == (
        "vLLM 0.33.0, M, tp=8, dcp=1: Lamport logits gather for rows [1] on all 8 TP ranks, "
        "through compute_logits; the drafter's get_top_tokens (use_local_argmax_reduction: an "
        "argmax reduced across ranks) skips it")
    assert "stock logits gather" in plugin.summary("vLLM 0.33.0", "M", 8, 1, WHY, through, around)


def _spec(**fields):
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(**fields),
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=4),
                                 parallel_config=types.SimpleNamespace(
                                     enable_batch_sharded_sampling=True))


def test_parallel_drafting_of_both_releases():
    """0.33 says it on the speculative config; 0.34 leaves that None and says it on the
    speculator's config class (DFlash): either way one pass drafts every token."""
    old = _spec(num_speculative_tokens=3, parallel_drafting=True)
    new = _spec(num_speculative_tokens=3, parallel_drafting=None,
                speculator_config=types.SimpleNamespace(parallel_drafting=True))
    serial = _spec(num_speculative_tokens=3, parallel_drafting=None,
                   speculator_config=types.SimpleNamespace(parallel_drafting=False))
    for config in (old, new):
        assert plugin.drafter_rows(config) == tuple(range(1, 13))
        assert plugin.drafter_paths(config) == (("drafter compute_logits x 1",), ())
    assert plugin.drafter_rows(serial) == (1, 2, 3, 4)
    assert plugin.drafter_paths(serial) == (("drafter compute_logits x 3",), ())


def test_other_logits_collectives_are_named_never_routed():
    """vLLM 0.34's collectives of draft logits that are no LogitsProcessor gather and no
    all-to-all of vocab shards: each named, with why it is not routed; none for a plain
    drafter."""
    plain, sharding = Lm(stock_class()()), Sharding(stock_class()())

    class DSpark(torch.nn.Module):
        def compute_draft_logits_local(self, hidden):
            return hidden

    class SpecializedK3DSparkForCausalLM(torch.nn.Module):
        pass

    class VocabParallelMarkovHead:
        markov_w2 = types.SimpleNamespace(tp_size=8)

    muse = types.SimpleNamespace(model=types.SimpleNamespace(markov_head=VocabParallelMarkovHead()))
    assert plugin.other_collectives(sharding, None, _spec(method="dspark")) == []
    assert plugin.other_collectives(plain, torch.nn.Linear(1, 1), _spec(method="eagle3")) == []
    # DSpark's sharded drafting is an all-to-all path of its own (find.exchange_paths)
    assert plugin.other_collectives(sharding, DSpark(), _spec(method="dspark")) == []
    assert plugin.other_collectives(plain, DSpark(), _spec(method="dspark")) == []  # gathered
    [(path, why)] = plugin.other_collectives(plain, SpecializedK3DSparkForCausalLM(),
                                             _spec(method="dspark"))
    assert "comm.gather_logits" in path and "own multicast mailbox" in why
    [(path, why)] = plugin.other_collectives(plain, muse, _spec(method="dspark"))
    assert "Markov sampler" in path and "sp_all_gather" in path
    [(path, why)] = plugin.other_collectives(plain, torch.nn.Linear(1, 1), _spec(method="xpress"))
    assert "3-D logits" in why
