"""install_sglang_logits_gather and the SGLang plugin, on CPU.

SGLang itself does not import on a CPU machine without most of its dependency set
(triton, pyzmq, pydantic, aiohttp, IPython, ... : see docs/sglang.md), so these tests
use stand-ins shaped from SGLang 0.5.23's source: ``LogitsProcessor`` (the attributes
its ``__init__`` sets that decide the gather, ``_logits_gatherer``, and the tail of
``_get_logits`` from the TP gather to the slice to ``vocab_size``), its stock
gatherer (``MultimemAllGatherer`` without multicast: ``tensor_model_parallel_all_gather``
= ``GroupCoordinator.all_gather(x, dim=-1)``, here on gloo), ``ParallelLMHead``, a
Kimi K2.5-shaped model (``language_model`` holds the processor and the lm_head) and
the plugin framework's ``HookRegistry`` (AFTER hooks). HeadGather's CUDA parts are
faked as in helpers (``fake_cuda``)."""

import enum
import functools
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
from spawn import spawn
from helpers import FAKE_BYTE, capture_log, fake_cuda, same_bits
from tables import TWO_RANKS as TABLE
from tables import sections

from lamport_head import install
from lamport_head.engines import sglang as sgl
from lamport_head.outcome import Outcome, Ranks, Reason

SHARD = 64  # per-rank lm_head rows (a multiple of 8), padded vocab = TP * SHARD


class StockGatherer:
    """SGLang's ``MultimemAllGatherer`` when multicast is unavailable: falls back to
    ``tensor_model_parallel_all_gather(x, dim=-1)``, i.e. ``GroupCoordinator.all_gather``:
    all-gather into ``[TP*M, s]``, reshape ``(TP, M, s)``, movedim(0, 1), reshape
    ``(M, TP*s)``."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        world = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        out = torch.cat(parts).reshape((world,) + x.shape).movedim(0, 1)
        return out.reshape(x.shape[0], world * x.shape[1])


class LogitsProcessor(torch.nn.Module):
    def __init__(self, vocab_size, tp, **flags):
        super().__init__()
        self.vocab_size = vocab_size
        self.use_attn_tp_group = False  # get_parallel().enable_dp_lm_head
        self.use_tp_lm_head_all_to_all = False
        self.use_fp32_lm_head = False
        self.use_fp32_lm_head_output = False
        self.do_tensor_parallel_all_gather = tp > 1
        self.do_tensor_parallel_all_gather_dp_attn = False
        for key, value in flags.items():
            setattr(self, key, value)
        self._logits_gatherer = StockGatherer()

    def gather(self, logits):
        """``_get_logits`` from the TP gather to ``_copy_logits_to_buffer``'s slice."""
        if self.do_tensor_parallel_all_gather:
            logits = self._logits_gatherer(logits)
        if logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits


class ParallelLMHead(torch.nn.Module):
    def __init__(self, tp, dtype=torch.bfloat16, shard=SHARD):
        super().__init__()
        self.tp_size = tp
        self.num_embeddings_per_partition = shard
        self.weight = torch.nn.Parameter(torch.zeros(shard, 16, dtype=dtype), requires_grad=False)


class CausalLM(torch.nn.Module):
    def __init__(self, tp, vocab=None, lp_flags=None, head=None):
        super().__init__()
        self.model = torch.nn.Identity()  # SGLang causal LMs hold their decoder as .model
        self.lm_head = head or ParallelLMHead(tp)
        width = self.lm_head.weight.shape[0]
        self.logits_processor = LogitsProcessor(vocab or tp * width - 5, tp, **(lp_flags or {}))


class KimiK25(torch.nn.Module):
    """Kimi K2.5's shape: the processor and lm_head live in ``language_model``; the
    top-level ``lm_head`` is a property."""

    def __init__(self, tp):
        super().__init__()
        self.vision_tower = torch.nn.Identity()
        self.language_model = CausalLM(tp)

    @property
    def lm_head(self):
        return self.language_model.lm_head


def _shard(rank, rows, width=SHARD):
    g = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


def _reference(nprocs, rows, vocab, width=SHARD):
    return torch.cat([_shard(r, rows, width) for r in range(nprocs)], dim=1)[:, :vocab]


def _sglang_worker(rank, nprocs, table, case):
    from lamport_head import head_gather

    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, case)
    seen = capture_log()

    m, other = KimiK25(nprocs), CausalLM(nprocs)
    lp = m.language_model.logits_processor
    stock = lp._logits_gatherer
    vocab = lp.vocab_size
    group = dist.group.WORLD
    served = sgl.install_sglang_logits_gather(m, group, nprocs, rank, "cpu").rows
    again = sgl.install_sglang_logits_gather(m, group, nprocs, rank, "cpu").rows
    out = {"served": list(served), "again": list(again), "log": seen,
           "stock_kept": lp._logits_gatherer is stock}

    one = lp.gather(_shard(rank, 1))  # row 1: enabled
    out["one_bytes"] = sorted(set(one.contiguous().view(torch.uint8).flatten().tolist()))
    out["one_is_stock"] = same_bits(one, _reference(nprocs, 1, vocab))
    out["one_shape"] = list(one.shape)
    calls = stock.calls
    three = lp.gather(_shard(rank, 3))  # row 3: disabled in the table
    out["three_is_stock"] = same_bits(three, _reference(nprocs, 3, vocab))
    fp32 = lp.gather(_shard(rank, 1).float())  # not BF16
    out["fp32_is_stock"] = same_bits(fp32, _reference(nprocs, 1, vocab).float())
    out["stock_calls"] = stock.calls - calls
    out["other_is_stock"] = (same_bits(other.logits_processor.gather(_shard(rank, 1)),
                                   _reference(nprocs, 1, vocab))
                             and not hasattr(other.logits_processor, "head_gather"))
    if served:
        routed = lp._logits_gatherer
        out["routes_to_head_gather"] = (isinstance(routed, functools.partial)
                                        and routed.func is lp.head_gather
                                        and routed.keywords == {"stock": stock})
        # Under CUDA graph capture the routed gatherer still asks HeadGather, which
        # decides (stock today; a recorded launch once the kernel is capture-safe).
        asked = []
        call = head_gather.HeadGather.__call__
        head_gather.HeadGather.__call__ = lambda self, x, stock: (asked.append(1),
                                                                  call(self, x, stock))[1]
        torch.cuda.is_current_stream_capturing = lambda: True
        lp.gather(_shard(rank, 1))
        out["asked_under_capture"] = len(asked)
    return out


def _run(tmp_path, case, nprocs=2):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE.replace("tp: 2", f"tp: {nprocs}"))
    return spawn(_sglang_worker, nprocs, tmp_path, str(table), case)


def test_sglang_serves_enabled_rows_and_sglang_gathers_the_rest_bitwise(tmp_path):
    for r in _run(tmp_path, "ok"):
        assert r["served"] == [1, 2, 4] and r["again"] == [1, 2, 4] and not r["stock_kept"]
        assert r["one_bytes"] == [FAKE_BYTE] and r["one_shape"] == [1, 2 * SHARD - 5]
        assert r["three_is_stock"] and r["fp32_is_stock"] and r["other_is_stock"]
        assert r["stock_calls"] == 2  # rows 3 and the FP32 call; row 1 took the kernel
        assert r["routes_to_head_gather"] and r["asked_under_capture"] == 1


class ReplayingRunner:
    """SGLang's ModelRunner as a decode step sees it: ``forward`` replays a captured
    graph, i.e. runs the recorded gather launch with no ``HeadGather.__call__``."""

    def __init__(self, model):
        self.model = model
        self.replays = 0

    def forward(self, batch):
        g = self.model.language_model.logits_processor.head_gather
        out = torch.empty(batch.shape[0], g.width, dtype=torch.bfloat16)
        g.launch(batch, out, g.plan[batch.shape[0]].ctas)
        self.replays += 1
        return out


def _replay_worker(rank, nprocs, table):
    from lamport_head import GatherTimeout
    from lamport_head.kernels.protocol import STATUS_FLAG, STATUS_PEERS

    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, "ok")
    runner = ReplayingRunner(KimiK25(nprocs))
    served = sgl.install_sglang_logits_gather(runner, dist.group.WORLD, nprocs, rank, "cpu").rows
    sgl.install_sglang_logits_gather(runner, dist.group.WORLD, nprocs, rank, "cpu").rows  # again
    g = runner.model.language_model.logits_processor.head_gather
    for _ in range(3):
        runner.forward(_shard(rank, 1))
    # What rank 0's kernel of the call after a failed one writes on every rank: the
    # flag (after the details), naming rank 1 as never published.
    g._status.words[STATUS_PEERS + 1] = 1
    g._status.words[STATUS_FLAG] = 1
    raised = []
    for _ in range(2):  # and it keeps raising until a collective reset()
        try:
            runner.forward(_shard(rank, 1))
        except GatherTimeout as exc:
            raised.append(str(exc))
    return {"served": list(served), "replays": runner.replays, "raised": raised,
            "polled": len(runner.__dict__[sgl.POLLED])}


def test_a_failed_peer_stops_every_graph_replay(tmp_path):
    """Decode steps are graph replays: no ``__call__`` reads the flag, so the runner's
    forward polls it first; without that, a peer's timeout would leave every later
    step delivering NaN with no rank raising."""
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    for r in spawn(_replay_worker, 2, tmp_path, str(table)):
        assert r["served"] == [1, 2, 4] and r["polled"] == 1
        assert r["replays"] == 3  # none after the flag went up
        assert len(r["raised"]) == 2 and all("1" in m for m in r["raised"])


@pytest.mark.parametrize("case", ["prepare@1", "connect@0"])
def test_one_rank_failing_leaves_every_sglang_rank_stock(tmp_path, case):
    for r in _run(tmp_path, case):
        assert r["served"] == [] and r["stock_kept"]
        assert r["one_is_stock"] and r["three_is_stock"] and r["stock_calls"] == 2
        assert len([line for line in r["log"] if "stays stock" in line]) == 2


@pytest.mark.parametrize("flags,why", [
    ({"do_tensor_parallel_all_gather": False}, "does not gather"),
    ({"use_attn_tp_group": True}, "--enable-dp-lm-head"),
    ({"do_tensor_parallel_all_gather_dp_attn": True}, "DP attention"),
    ({"use_tp_lm_head_all_to_all": True}, "all-to-all"),
    ({"use_fp32_lm_head_output": True}, "FP32 lm_head output"),  # dtype: the device's
    ({"use_fp32_lm_head": True, "final_logit_softcapping": 30.0}, "fused gather and softcap"),
    ({"use_attn_tp_group": None}, "lacks use_attn_tp_group"),  # deleted below: another version
])
def test_sglang_variants_stay_stock_with_one_line(flags, why, monkeypatch, caplog):
    built = []
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build", lambda *a, **k: built.append(a))
    m = CausalLM(2, lp_flags=flags)
    if None in flags.values():
        delattr(m.logits_processor, "use_attn_tp_group")
    stock = m.logits_processor._logits_gatherer
    with caplog.at_level("INFO", logger="lamport_head"):
        assert sgl.install_sglang_logits_gather(m, "tp-group", 2, 0, "cpu").rows == ()
    assert built == [] and m.logits_processor._logits_gatherer is stock
    assert len(caplog.records) == 1 and why in caplog.text
    assert caplog.records[0].getMessage().startswith("lamport-head: stock SGLang logits "
                                                     "gather: ")


def test_fp32_logits_of_an_fp32_head_with_softcapping_stay_stock(monkeypatch, caplog):
    """FP32 logits reach SGLang's fused gather and softcap (which bypasses the gatherer on
    CUDA) whether asked for (``use_fp32_lm_head``) or from an FP32 head: both stay stock
    with one line, no gather built; a truthy flag (SGLang reads it so) is FP32."""
    built = []
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build", lambda *a, **k: built.append(a))
    m = CausalLM(2, head=ParallelLMHead(2, dtype=torch.float32),
                 lp_flags={"final_logit_softcapping": 30.0})
    with caplog.at_level("INFO", logger="lamport_head"):
        assert sgl.install_sglang_logits_gather(m, "tp-group", 2, 0, "cpu").rows == ()
    assert built == [] and "fused gather and softcap" in caplog.text
    plain = CausalLM(2, lp_flags={"use_fp32_lm_head": 1})
    assert sgl._site(plain, plain.logits_processor).dtype == torch.float32
    assert sgl._site(CausalLM(2), CausalLM(2).logits_processor).dtype is None


@pytest.mark.parametrize("head", [
    ParallelLMHead(2, dtype=torch.float16),
    ParallelLMHead(4),  # tp_size != TP (a replicated or attention-TP lm_head)
])
def test_sglang_checks_shared_with_vllm_leave_stock(head, monkeypatch):
    built = []
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr(install, "_build", lambda *a, **k: built.append(a))
    m = CausalLM(2, head=head)
    stock = m.logits_processor._logits_gatherer
    assert sgl.install_sglang_logits_gather(m, "tp-group", 2, 0, "cpu").rows == ()
    assert built == [] and m.logits_processor._logits_gatherer is stock


def test_runner_defaults_come_from_sglang(monkeypatch):
    """A ModelRunner (``.model``) resolves SGLang's TP group and the lm_head's device;
    a LoRA-wrapped lm_head is read through ``base_layer``."""
    calls = []
    monkeypatch.setattr(sgl, "_sglang_tp", lambda: ("tp-cpu-group", 2, 1, "tp-device-group"))
    monkeypatch.setattr(install, "install",
                        lambda site, *a, **kw: calls.append((site, a, kw))
                        or Outcome.kept(Reason.NO_ROWS, "none"))
    model = CausalLM(2)
    base = model.lm_head
    model.lm_head = torch.nn.Module()  # a LoRA wrapper
    model.lm_head.base_layer = base
    runner = types.SimpleNamespace(model=model, is_draft_worker=False)
    assert sgl.install_sglang_logits_gather(runner, dcp=2).rows == ()
    site, args, kw = calls[0]
    # agreement on SGLang's CPU group, first-use timing on its device group
    assert args == (Ranks("tp-cpu-group", 2, 1, base.weight.device, 2, "tp-device-group"),
                    None)  # rows: the table's
    assert site.weight is base.weight and site.head_tp == base.tp_size  # the base layer's
    assert site.processor is model.logits_processor and site.attr == sgl.GATHERER
    assert sgl.install_sglang_logits_gather(torch.nn.Linear(2, 2)).rows == ()  # no processor


class HookType(enum.Enum):
    AFTER = "after"


class HookRegistry:
    """SGLang's registry, reduced: ``register(target, hook, hook_type)``; applying an
    AFTER hook wraps the method as ``hook(original(*a), *a)``, None keeps the result."""
    hooks = []

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER):
        cls.hooks.append((target, hook, hook_type))

    @classmethod
    def apply_to(cls, klass):
        for target, hook, _ in cls.hooks:
            original = getattr(klass, target.rsplit(".", 1)[1])

            def wrapper(*args, _original=original, _hook=hook, **kwargs):
                result = _original(*args, **kwargs)
                new = _hook(result, *args, **kwargs)
                return result if new is None else new

            setattr(klass, target.rsplit(".", 1)[1], wrapper)


class ModelRunner:
    """SGLang 0.5.23's ModelRunner as the plugin sees it: ``load_model`` sets ``model``;
    ``update_model_fields`` (a weight update) sets it to the model it is handed;
    ``decode_num_tokens_per_req``: logits rows per decode slot (1, or the draft
    tokens verified per request); ``forward``: one step's gather."""

    def __init__(self, is_draft_worker=False, tp=2, shard=SHARD):
        self.is_draft_worker, self.tp, self.shard_width = is_draft_worker, tp, shard

    def load_model(self):
        self.model = CausalLM(self.tp, head=ParallelLMHead(self.tp, shard=self.shard_width))
        return "loaded"

    def update_model_fields(self, new_model, *, model_path, load_format, load_config):
        self.model = new_model

    def decode_num_tokens_per_req(self, *, num_draft_tokens=None):
        return num_draft_tokens or 1

    def forward(self, batch):
        return self.model.logits_processor.gather(batch)


def fake_sglang(set_module, requests=8, draft_tokens=None, group=None, topk=None):
    """SGLang's plugin framework, runtime context (``max_running_requests``, the largest
    draft-token count, ``get_spec().speculative_eagle_topk``, DCP 2) and TP group as
    modules, each put with ``set_module(name, module)``."""
    HookRegistry.hooks = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookRegistry, registry.HookType = HookRegistry, HookType
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_parallel = lambda: types.SimpleNamespace(attn_dcp_size=2 if group is None else 1)
    context.get_schedule = lambda: types.SimpleNamespace(max_running_requests=requests)
    context.max_speculative_num_draft_tokens = lambda: draft_tokens
    context.get_spec = lambda: types.SimpleNamespace(speculative_eagle_topk=topk)
    state = types.ModuleType("sglang.srt.distributed.parallel_state")
    state.get_tp_group = lambda: types.SimpleNamespace(
        cpu_group=group, device_group=group, world_size=dist.get_world_size(),
        rank_in_group=dist.get_rank())
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.distributed"):
        set_module(name, types.ModuleType(name))
    set_module("sglang.srt.plugins.hook_registry", registry)
    set_module("sglang.srt.runtime_context", context)
    set_module("sglang.srt.distributed.parallel_state", state)


@pytest.fixture
def sglang_modules(monkeypatch):
    fake_sglang(functools.partial(monkeypatch.setitem, sys.modules))
    monkeypatch.setattr(sgl, "_registered", False)
    monkeypatch.setattr(sgl, "_unsaid", [])
    monkeypatch.setattr(sgl, "_target", None)
    monkeypatch.setattr(ModelRunner, "load_model", ModelRunner.load_model)
    monkeypatch.setattr(ModelRunner, "update_model_fields", ModelRunner.update_model_fields)


def test_plugin_installs_after_load_model_once(sglang_modules, monkeypatch, caplog):
    calls, drafts = [], []
    monkeypatch.setattr(sgl, "install_sglang_logits_gather",
                        lambda runner, dcp, rows: calls.append((runner, dcp, rows))
                        or Outcome.serving((1,)))
    monkeypatch.setattr(sgl, "install_sglang_draft_gather", lambda runner, dcp, rows: (
        drafts.append((runner, dcp, rows))
        or sgl.Drafter("Eagle", Outcome.serving((1,), shared=True), 128, 0, 2, dcp)))
    sgl.register()
    sgl.register()  # loaded twice in one process: one hook each
    assert [(t, h, k) for t, h, k in HookRegistry.hooks] == [
        (sgl.LOAD_MODEL, sgl._after_load_model, HookType.AFTER),
        (sgl.UPDATE_MODEL, sgl._after_update_model_fields, HookType.AFTER)]
    HookRegistry.apply_to(ModelRunner)
    runner, draft = ModelRunner(), ModelRunner(is_draft_worker=True)
    with caplog.at_level("INFO", logger="lamport_head"):
        assert runner.load_model() == "loaded" and draft.load_model() == "loaded"
    # rows: 8 running requests, no speculation (x 1 row a request; draft topk unset: 1)
    assert calls == [(runner, 2, tuple(range(1, 9)))]
    assert drafts == [(draft, 2, tuple(range(1, 9)))]  # the draft runner: its own install
    said = [r.getMessage() for r in caplog.records if "summary" in r.getMessage()]
    assert said == ["lamport-head summary: SGLang speculative decoding, tp=2, dcp=2: target "
                    "CausalLM: Lamport logits gather for rows [1]; drafter Eagle: the target's "
                    "Lamport logits gather (its head has the target's shard width) for rows [1]; "
                    "routed on all 2 TP ranks: target logits gather, drafter logits gather"]

    def broken(runner, dcp, rows):
        raise RuntimeError("boom")

    monkeypatch.setattr(sgl, "install_sglang_logits_gather", broken)
    with pytest.raises(RuntimeError, match="boom"):  # fail-stop: never swallowed
        ModelRunner().load_model()


@pytest.mark.parametrize("requests, draft_tokens, top", [
    (8, None, 8),  # max running requests x 1
    (8, 4, 32),  # x the draft tokens verified per request
    (600, 4, 1024),  # capped
    (None, None, 1024),  # SGLang sizes it from the KV pool after load: up to the cap
])
def test_rows_from_sglang(requests, draft_tokens, top, monkeypatch):
    fake_sglang(functools.partial(monkeypatch.setitem, sys.modules), requests, draft_tokens)
    assert sgl.rows_from_sglang(ModelRunner()) == tuple(range(1, top + 1))
    assert sgl.rows_from_sglang(types.SimpleNamespace()) is None  # not 0.5.23's runner


@pytest.mark.parametrize("requests, topk, top", [
    (8, None, 8),  # no speculative settings: one row a request
    (8, 1, 8),  # EAGLE chains: a draft step's requests
    (8, 4, 32),  # topk 4: four rows a request each draft step
    (None, 1, 1024),  # up to the cap
])
def test_draft_rows_from_sglang(requests, topk, top, monkeypatch):
    fake_sglang(functools.partial(monkeypatch.setitem, sys.modules), requests, topk=topk)
    assert sgl.draft_rows_from_sglang(ModelRunner(is_draft_worker=True)) == tuple(
        range(1, top + 1))


DRAFT_SHARD = 32  # an EAGLE3-like draft head: its own vocabulary (64 on 2 ranks)


def _draft_worker(rank, nprocs, table, case):
    """The plugin on 2 ranks with speculative decoding: the target's runner, then two
    draft runners (SGLang builds one; each shape here in turn): one whose head has the
    target's shard width, one of another vocabulary. ``case`` "compile@1": the draft
    head's kernel fails to compile on rank 1 (only that width)."""
    from lamport_head import build

    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, "ok")
    if case == "compile@1":
        compiled = build.TOOLCHAIN.compiled

        def failing(tp, words, *args, **kwargs):
            if words == DRAFT_SHARD // 2 and rank == 1:  # the draft head's BF16 words
                raise RuntimeError("injected: the draft head's kernel failed to compile")
            return compiled(tp, words, *args, **kwargs)

        build.TOOLCHAIN.compiled = failing
    seen = capture_log()
    fake_sglang(sys.modules.__setitem__, requests=2, group=dist.group.WORLD, topk=1)
    sgl.register()
    HookRegistry.apply_to(ModelRunner)
    target = ModelRunner(tp=nprocs)
    target.load_model()
    if case == "lookup@1" and rank == 1:  # its target's TP group lookup failed alone
        sgl._target = sgl._target._replace(group=None)
    g = target.model.logits_processor.head_gather
    out = {"log": {}}
    for name, width in (("same", SHARD), ("other", DRAFT_SHARD)):
        draft = ModelRunner(is_draft_worker=True, tp=nprocs, shard=width)
        before = len(seen)
        draft.load_model()
        out["log"][name] = seen[before:]
        lp = draft.model.logits_processor
        hg = getattr(lp, "head_gather", None)
        one = draft.forward(_shard(rank, 1, width))
        three = draft.forward(_shard(rank, 3, width))
        out[name] = {
            "served": sorted(hg.rows) if hg is not None else [], "shared": hg is g,
            "kernel": sorted(set(one.contiguous().view(torch.uint8).flatten().tolist()))
            == [FAKE_BYTE],
            "one_stock": same_bits(one, _reference(nprocs, 1, lp.vocab_size, width)),
            "three_stock": same_bits(three, _reference(nprocs, 3, lp.vocab_size, width)),
            "stock_kept": isinstance(lp._logits_gatherer, StockGatherer),
            "polled": [x is hg for x in draft.__dict__.get(sgl.POLLED, [])]}
    one = target.forward(_shard(rank, 1))
    out["target"] = {"same": target.model.logits_processor.head_gather is g,
                     "kernel": sorted(set(one.contiguous().view(torch.uint8).flatten().tolist()))
                     == [FAKE_BYTE]}
    return out


@pytest.mark.parametrize("case", ["ok", "compile@1", "lookup@1"])
def test_plugin_routes_the_draft_workers_model(tmp_path, case):
    """SGLang's EAGLE draft worker (``is_draft_worker``), on 2 ranks through the hook: a
    head of the target's shard width takes the target's gather (no second build); a
    head of another vocabulary its own install, at its rows, agreed: a compile that
    fails on rank 1 only leaves every rank on SGLang's gather for that drafter, the
    target's gather untouched; rank 0's summary names every routed path. A rank that
    cannot share alone (``lookup@1``: its target's group unknown) takes every rank to
    the drafter's own install (sharing skips a collective: all or none)."""
    from tables import sections

    table = tmp_path / "t.yaml"
    table.write_text(sections((2 * SHARD, 2 * DRAFT_SHARD)))
    results = spawn(_draft_worker, 2, tmp_path, str(table), case)
    for rank, r in enumerate(results):
        same, other = r["same"], r["other"]
        shared = case != "lookup@1"
        assert same == {"served": [1, 2], "shared": shared, "kernel": True, "one_stock": False,
                        "three_stock": True, "stock_kept": False, "polled": [True]}, same
        assert ("through the gather already built" in " ".join(r["log"]["same"])) == shared
        assert r["target"] == {"same": True, "kernel": True}
        summaries = [x for x in r["log"]["other"] if x.startswith("lamport-head summary")]
        if case in ("ok", "lookup@1"):
            assert other == {"served": [1, 2], "shared": False, "kernel": True,
                             "one_stock": False, "three_stock": True, "stock_kept": False,
                             "polled": [True]}, other
            tail = ("drafter CausalLM: its own Lamport logits gather (vocab 64) for rows [1, 2]; "
                    "routed on all 2 TP ranks: target logits gather, drafter logits gather")
        else:
            assert other == {"served": [], "shared": False, "kernel": False, "one_stock": True,
                             "three_stock": True, "stock_kept": True, "polled": []}, other
            assert any("stays stock" in x for x in r["log"]["other"])
            tail = ("drafter CausalLM: SGLang's logits gather (build-failed: building the logits "
                    "gather failed: PeerFailed: lamport-head: another "
                    "rank failed to build the gather (checks, compile, occupancy)); routed on "
                    "all 2 TP ranks: target logits gather")
            if rank == 1:  # the failing rank's own error; rank 0 hears it in the agreement
                assert any("injected" in x for x in r["log"]["other"])
        assert len(summaries) == (1 if rank == 0 else 0), summaries
        if rank == 0:
            assert summaries[0].startswith(
                "lamport-head summary: SGLang speculative decoding, tp=2, dcp=1: target "
                "CausalLM: Lamport logits gather for rows [1, 2]; drafter CausalLM: ")
            assert summaries[0].endswith(tail), summaries[0]


def _plugin_worker(rank, nprocs, table, requests):
    """The plugin on a 2-rank gloo group: load, then three weight updates."""
    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, "ok")
    seen = capture_log()
    fake_sglang(sys.modules.__setitem__, requests=requests, group=dist.group.WORLD)
    sgl.register()
    HookRegistry.apply_to(ModelRunner)
    runner = ModelRunner(tp=nprocs)
    runner.load_model()
    lp = runner.model.logits_processor
    out = {"served": sorted(getattr(lp, "head_gather", None) and lp.head_gather.rows or [])}

    def step(name, model):
        before = len(seen)
        if model is not None:
            runner.update_model_fields(model, model_path="m", load_format="auto",
                                       load_config=None)
        lp = runner.model.logits_processor
        one = runner.forward(_shard(rank, 1))
        three = runner.forward(_shard(rank, 3))
        out[name] = {
            "kernel": sorted(set(one.contiguous().view(torch.uint8).flatten().tolist()))
            == [FAKE_BYTE],
            "one_stock": same_bits(one, _reference(nprocs, 1, lp.vocab_size)),
            "three_stock": same_bits(three, _reference(nprocs, 3, lp.vocab_size)),
            "same_gather": getattr(lp, "head_gather", None) is runner.lamport_head_gathers[-1]
            if hasattr(runner, sgl.POLLED) else None,
            "log": seen[before:]}

    step("loaded", None)
    step("in_place", runner.model)  # 0.5.23 loads the weights in place: the same object
    step("new", CausalLM(nprocs))  # a new model object
    step("fp32", CausalLM(nprocs, lp_flags={"use_fp32_lm_head": True}))
    out["polled"] = len(runner.__dict__.get(sgl.POLLED, []))
    return out


def test_plugin_serves_sglangs_rows_and_routes_a_new_model_again(tmp_path):
    """Through the hooks, on 2 ranks: rows bounded by max running requests (2: the
    table's row 4 is not served); after a weight update that hands the runner a new
    model object, that model's gather goes through the same HeadGather (no collective,
    no second mailbox); an in-place update changes nothing; a new model that cannot be
    served says so in one line and keeps SGLang's gather."""
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    for r in spawn(_plugin_worker, 2, tmp_path, str(table), 2):
        assert r["served"] == [1, 2] and r["polled"] == 1
        for name in ("loaded", "in_place", "new"):
            assert r[name]["kernel"] and r[name]["three_stock"] and r[name]["same_gather"], name
        assert r["in_place"]["log"] == []
        assert len(r["new"]["log"]) == 1 and "routed again" in r["new"]["log"][0]
        assert r["fp32"]["one_stock"] and r["fp32"]["three_stock"]
        assert r["fp32"]["same_gather"] is False
        why = ("lamport-head: stock logits gather on the new model: float32 logits, the "
               "gather's are bfloat16 [site]")
        assert r["fp32"]["log"] == [why]


def _logging_worker(rank, nprocs, out):
    """SGLang's order in a scheduler process: load_plugins (register), then
    configure_logger (``logging.basicConfig(..., force=True)`` on the root logger),
    then the model loads."""
    import logging

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # basicConfig's handler writes to stderr: the file
    fake_sglang(sys.modules.__setitem__)
    sgl.install_sglang_logits_gather = (  # no ranks here
        lambda runner, dcp, rows: Outcome.kept(Reason.NO_GATHER, "no ranks"))
    sgl.register()  # load_plugins(): nothing configured logging yet
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)  # SGLang's configure_logger
    HookRegistry.apply_to(ModelRunner)
    ModelRunner().load_model()
    ModelRunner().load_model()
    return True


def test_registered_line_reaches_sglangs_logging(tmp_path):
    out = tmp_path / "stderr"
    spawn(_logging_worker, 1, tmp_path, str(out), group=False)
    lines = [x for x in out.read_text().splitlines() if "hooks registered" in x]
    said = (f"lamport-head: logits gather hooks registered on {sgl.LOAD_MODEL} and "
            f"{sgl.UPDATE_MODEL}")
    assert lines == [f"[{lines[0][1:20]}] {said}"], out.read_text()  # SGLang's format, once


def test_plugin_without_sglang_is_harmless(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    monkeypatch.setattr(sgl, "_registered", False)
    assert sgl.register() is None and not sgl._registered


def test_sglang_entry_point_metadata():
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert any(e.name == "lamport_head" and e.value == "lamport_head.engines.sglang:register"
               for e in eps)


class MultimemAllGatherer(StockGatherer):
    """Stands in for SGLang's ``MultimemAllGatherer`` by name and ``_state`` (our tests
    never create multicast): a gather SGLang left enabled, NCCL-shaped underneath."""

    _state = object()


def _stock_kind_worker(rank, nprocs, table, case):
    from lamport_head.collective import together
    from lamport_head.tuning import firstuse

    os.environ["LAMPORT_HEAD_TABLE"] = table
    if case in ("measure", "mixed"):
        os.environ["LAMPORT_HEAD_AUTOTUNE"] = "1"
    fake_cuda(setattr, rank, "ok")
    seen = capture_log()
    asked = []

    def measure(*args, stock=None, stock_kind=None, **kwargs):
        asked.append((stock_kind, stock is gatherer))
        # raised on every rank alike, as first-use tuning's failures are: stays stock
        raise together(RuntimeError("measured elsewhere"))

    firstuse.measure = measure
    m = CausalLM(nprocs)
    lp = m.logits_processor
    gatherer = lp._logits_gatherer = MultimemAllGatherer()
    if case == "mixed" and rank == 1:  # SGLang disabled it on this rank only: NCCL here
        gatherer._state = None
    served = sgl.install_sglang_logits_gather(m, dist.group.WORLD, nprocs, rank, "cpu").rows
    return {"served": list(served), "asked": asked, "log": seen,
            "kind": sgl.stock_kind(gatherer), "disabled": sgl.stock_kind(
                types.SimpleNamespace(__class__=MultimemAllGatherer, _state=None)),
            "routed": lp._logits_gatherer is not gatherer}


@pytest.mark.parametrize("case", ["nccl-table", "multimem-table", "measure", "mixed"])
def test_a_section_measured_against_nccl_is_not_served_in_place_of_sglangs_multimem(tmp_path, case):
    """Issue 32 item 4: where SGLang built its multimem one-shot gatherer, only a section
    measured against that stock is served; an NCCL-measured one reads as missing, and
    first-use tuning is handed SGLang's own gatherer to time, with its kind. Ranks whose
    gatherers differ in kind (``mixed``: no section for this V, so both would measure)
    never time different collectives: every rank stays stock."""
    text = {"multimem-table": TABLE.replace(
        "      dcp: 1\n", "      dcp: 1\n      stock: multimem-all-gather\n"),
        "mixed": sections((192, 1024))}.get(case, TABLE)
    table = tmp_path / "t.yaml"
    table.write_text(text)
    for rank, r in enumerate(spawn(_stock_kind_worker, 2, tmp_path, str(table), case)):
        assert r["disabled"] == "nccl-all-gather"
        assert r["kind"] == ("nccl-all-gather" if case == "mixed" and rank == 1
                             else "multimem-all-gather")
        if case == "mixed":
            assert r["served"] == [] and r["asked"] == [], r
            assert "resolved different HEAD_GATHER plans" in " ".join(r["log"]), r["log"]
            continue
        if case == "multimem-table":
            assert r["served"] == [1, 2, 4] and r["routed"] and r["asked"] == []
        else:
            assert r["served"] == [] and not r["routed"]
        if case == "nccl-table":
            assert r["asked"] == [] and (
                "no enabled HEAD_GATHER rows for NVIDIA H200, tp=2, dcp=1, vocab=128, "
                "stock=multimem-all-gather, dtype=bfloat16 (the tables hold sections for this "
                "vocab measured "
                "against nccl-all-gather; vocab 192, 1024 only)") in " ".join(r["log"]), r["log"]
        if case == "measure":
            assert r["asked"] == [["multimem-all-gather", True]]  # (JSON: lists)
            assert "first-use tuning failed: RuntimeError: measured elsewhere" in " ".join(r["log"])
