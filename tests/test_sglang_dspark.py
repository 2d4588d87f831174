"""engines/sglang_dspark.py on CPU against stand-ins of SGLang 0.5.23's DSpark draft
(``sglang/srt/models/dspark.py``): what the real classes cannot show on a CPU
(tests/test_sglang_dspark_real.py covers them): ranks that took different paths, a rank
failing the build, the configurations left stock, an SGLang without the name, a target
gather of the same stock shared, an FP32 projection, the rows, the hook's two timings.

This module stands in for SGLang's ``dspark`` module: its ``gather_and_crop_vocab`` and
``tensor_model_parallel_all_gather`` are module globals, as there, and ``DSparkDraft``'s
``compute_base_logits`` calls the former by its global name (its "projection" is the
identity: the hidden rows are the local logits). HeadGather's CUDA parts are faked as in
helpers (``fake_cuda``; its kernel writes ``FAKE_BYTE``)."""

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
from helpers import FAKE_BYTE, fake_cuda, same_bits
from spawn import spawn
from tables import sections

from lamport_head.engines import sglang as sgl
from lamport_head.engines import sglang_dspark as dspark
from lamport_head.outcome import Reason

SHARD, VOCAB = 64, 120  # a 64-row shard a rank (V = 128 on 2 ranks), 120 kept by the crop
GAMMA = 2
CALLS = []  # SGLang's all-gathers here, one entry each


def tensor_model_parallel_all_gather(x, dim=-1):
    """SGLang's: ``GroupCoordinator.all_gather(x, dim)`` of the TP group (here gloo's)."""
    assert dim == -1
    CALLS.append(x.shape[0])
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def gather_and_crop_vocab(local_logits, lm_head):
    full_logits = tensor_model_parallel_all_gather(local_logits, dim=-1)
    return full_logits[..., : int(lm_head.org_vocab_size)]


class ParallelLMHead(torch.nn.Module):
    def __init__(self, tp=2, dtype=torch.bfloat16, attention_tp=False, shard=SHARD):
        super().__init__()
        self.tp_size, self.org_vocab_size, self.use_attn_tp_group = tp, VOCAB, attention_tp
        self.weight = torch.nn.Parameter(torch.zeros(shard, 16, dtype=dtype), requires_grad=False)


class MultimemAllGatherer:
    """SGLang's gatherer by name and ``_state`` (left enabled: ``multimem-all-gather``);
    NCCL-shaped underneath (our tests never create multicast)."""

    _state = object()

    def __call__(self, x):
        return tensor_model_parallel_all_gather(x, dim=-1)


class DSparkDraft(torch.nn.Module):
    """``DSparkDraftMixin`` as the adapter sees it: the head attached later, a Markov head
    (``vocab_shard`` set when TP-sharded), ``_base_logits_gatherer`` (None: dense)."""

    def __init__(self, gatherer=None, sharded=False, fp32=False):
        super().__init__()
        self.lm_head, self.gamma = None, GAMMA
        self.markov_head = types.SimpleNamespace(vocab_shard=object() if sharded else None)
        self._base_logits_gatherer = gatherer
        self._use_fp32_lm_head = fp32  # DeepSeek V4's flag

    def attach_shared_modules(self, *, embed_tokens, lm_head):
        self.lm_head = lm_head

    def compute_base_logits(self, hidden):
        if self.markov_head.vocab_shard is not None:
            return hidden, hidden
        if self._base_logits_gatherer is not None:
            return self._base_logits_gatherer(hidden)[..., :VOCAB], hidden
        return gather_and_crop_vocab(hidden, self.lm_head), hidden


def _shard(rank, rows, width=SHARD):
    g = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


def _reference(nprocs, rows):
    return torch.cat([_shard(r, rows) for r in range(nprocs)], dim=1)[:, :VOCAB]


def _worker(rank, nprocs, table):
    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, "ok")
    world = dist.group.WORLD
    sgl._sglang_tp = lambda: (world, nprocs, rank, world)
    sgl._target = None
    rows = (2, 4)
    out = {}

    def attached(model, head=None):
        model.attach_shared_modules(embed_tokens=None, lm_head=head or ParallelLMHead(nprocs))
        return model

    def run(name, model, target=None, calls=True):
        done = dspark.install_sglang_dspark_gathers(model, rows=rows, target=target)
        g = dspark.served_gather(model)
        result = {"routes": [[p, list(o.rows), o.reason and o.reason.label, o.message]
                             for p, o in done.routes],
                  "others": [list(x) for x in done.others], "gather": g is not None}
        for m in (1, 2, 3, 4) if calls else ():
            before = len(CALLS)
            got = model.compute_base_logits(_shard(rank, m))[0]
            result[str(m)] = {"kernel": sorted(set(got.contiguous().view(torch.uint8).flatten()
                                                   .tolist())) == [FAKE_BYTE],
                              "stock": same_bits(got, _reference(nprocs, m)),
                              "sglang": len(CALLS) - before}
        out[name] = result
        return done, g

    run("dense", attached(DSparkDraft()))
    differ = attached(DSparkDraft(sharded=rank == 1))  # SGLang's settings differ on rank 1
    out["differ_paths"] = [dspark.base_path(differ)[0]]
    run("differ", differ, calls=False)  # SGLang's own steps would not meet either
    run("dp_lm_head", attached(DSparkDraft(), ParallelLMHead(nprocs, attention_tp=True)))
    fake_cuda(setattr, rank, "prepare@1")  # rank 1's compile fails
    run("build_fails", attached(DSparkDraft()))
    fake_cuda(setattr, rank, "ok")
    # a target gather of the same stock (SGLang's multimem gatherer disabled: NCCL),
    # group and shard width: shared, no second build
    head = ParallelLMHead(nprocs)
    target_draft = attached(DSparkDraft(), head)
    _, g = run("own", target_draft)
    target = sgl.Target("LlamaForCausalLM", tuple(sorted(g.rows)), g, world)
    _, shared = run("shared", attached(DSparkDraft()), target)
    out["shared"]["same_gather"] = shared is g
    multimem = target._replace(stock="multimem-all-gather")
    run("other_stock", attached(DSparkDraft()), multimem)
    for name, flag in (("fp32_site_dtype", True), ("bf16_site_dtype", False)):
        # DeepSeek V4's SGLANG_DSPARK_FP32_LM_HEAD: FP32 logits over the BF16 weight
        model = attached(DSparkDraft(fp32=flag))
        site, _ = dspark._site(model, model.lm_head, *dspark.base_path(model))
        out[name] = str(site.logits_dtype)
    # first-use tuning (no section for this V): handed SGLang's own collective to time,
    # with its kind, for each path
    os.environ["LAMPORT_HEAD_AUTOTUNE"] = "1"
    from lamport_head.collective import together
    from lamport_head.tuning import firstuse

    asked = []

    def measure(*args, stock=None, stock_kind=None, **kwargs):
        x = _shard(rank, 2, width=2 * SHARD)
        before = len(CALLS)
        got = stock(x)
        asked.append([stock_kind, len(CALLS) - before, same_bits(got, torch.cat(
            [_shard(r, 2, width=2 * SHARD) for r in range(nprocs)], dim=1))])
        raise together(RuntimeError("measured elsewhere"))  # on every rank alike: stock

    firstuse.measure = measure
    wide = lambda: ParallelLMHead(nprocs, shard=2 * SHARD)  # noqa: E731 (V = 256: no section)
    run("first_use_nccl", attached(DSparkDraft(), wide()), calls=False)
    run("first_use_multimem", attached(DSparkDraft(gatherer=MultimemAllGatherer()), wide()),
        calls=False)
    out["asked"] = asked
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark")
    table = tmp / "t.yaml"
    table.write_text(sections((2 * SHARD,)))
    return spawn(_worker, 2, tmp, str(table))


def _assert_rows(result, served, what):
    for m in (1, 2, 3, 4):
        row = result[str(m)]
        if m in served:
            assert row == {"kernel": True, "stock": False, "sglang": 0}, (what, m, row)
        else:
            assert row == {"kernel": False, "stock": True, "sglang": 1}, (what, m, row)


def test_a_dense_draft_is_served_for_its_rows_and_sglangs_gather_takes_the_rest(results):
    for r in results:
        d = r["dense"]
        assert d["routes"] == [["drafter DSparkDraft compute_base_logits's gather_and_crop_vocab "
                                "(nccl-all-gather)", [2, 4], None, ""]] and d["gather"]
        _assert_rows(d, (2, 4), "dense")  # row 1: in the table, not a DSpark row


def test_ranks_on_different_paths_keep_sglangs_gathers_together(results):
    """SGLang's settings differ between ranks (rank 1's Markov head TP-sharded): one
    agreement before any install takes every rank to SGLang's gathers, no rank left in
    an install's collectives (the spawn's deadline would fail a hang)."""
    for rank, r in enumerate(results):
        assert r["differ_paths"] == ["local" if rank == 1 else "gather_and_crop_vocab"]
        route = r["differ"]["routes"][0]
        assert route[2] == "plans-differ" and "(gather_and_crop_vocab, local)" in route[3]
        assert not r["differ"]["gather"]


def test_a_head_on_the_attention_tp_group_stays_stock(results):
    for r in results:
        route = r["dp_lm_head"]["routes"][0]
        assert route[2] == "site" and "--enable-dp-lm-head" in route[3]
        _assert_rows(r["dp_lm_head"], (), "dp_lm_head")


def test_a_rank_failing_the_build_leaves_every_rank_on_sglangs_gather(results):
    for r in results:
        route = r["build_fails"]["routes"][0]
        assert route[1] == [] and route[2] == "build-failed"
        _assert_rows(r["build_fails"], (), "build_fails")


def test_the_targets_gather_of_the_same_stock_serves_the_draft(results):
    """Keyed by the stock each replaces: a target gather built against NCCL's all-gather
    (its group and shard width) serves the dense draft's (no second build); against
    SGLang's multimem gatherer it does not (the draft's own install)."""
    for r in results:
        assert r["shared"]["same_gather"] and r["shared"]["routes"][0][1] == [2, 4]
        assert "the target's" not in r["own"]["routes"][0][0]
        _assert_rows(r["shared"], (2, 4), "shared")
        assert r["other_stock"]["routes"][0][1] == [2, 4] and r["other_stock"]["gather"]


def test_an_fp32_projection_gathers_float32_logits(results):
    """DeepSeek V4's FP32 projection over a BF16 head: a float32 gather (and section)."""
    for r in results:
        assert r["fp32_site_dtype"] == "torch.float32"
        assert r["bf16_site_dtype"] == "torch.bfloat16"


def test_first_use_tuning_times_the_stock_each_path_replaces(results):
    """No section for the draft's V: first-use tuning is handed SGLang's own collective
    of each path to time, with its kind: ``gather_and_crop_vocab``'s all-gather
    (``nccl-all-gather``; a call of it is one SGLang all-gather, right) and the vocab-
    parallel draft's ``MultimemAllGatherer`` (``multimem-all-gather``); a failure on
    every rank leaves both stock."""
    for r in results:
        assert r["asked"] == [["nccl-all-gather", 1, True], ["multimem-all-gather", 1, True]]
        for name in ("first_use_nccl", "first_use_multimem"):
            assert r[name]["routes"][0][2] == "tuning-failed" and not r[name]["gather"], name


def test_sglang_without_gather_and_crop_vocab_stays_stock(monkeypatch):
    """A caller module that lacks the name (another SGLang): stock (engine), before
    any install; the path says why."""
    module = types.ModuleType("elsewhere")

    class Moved(DSparkDraft):
        compute_base_logits = DSparkDraft.compute_base_logits

    Moved.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    kind, why = dspark.base_path(Moved())
    assert kind is None and "elsewhere has no gather_and_crop_vocab" in why
    monkeypatch.setattr(sgl, "_sglang_tp", lambda: (None, 1, 0, None))
    monkeypatch.setattr(sgl, "_target", None)
    done = dspark.install_sglang_dspark_gathers(Moved())
    assert done.routes[0][1].reason is Reason.ENGINE


@pytest.mark.parametrize("requests, tokens, want", [
    (2, None, (2, 4)),  # the draft config's gamma (2)
    (3, 4, (3, 6, 9)),  # speculative_num_draft_tokens 4: gamma 3
    (None, None, tuple(range(2, 1025, 2))),  # max running requests unsized: up to the cap
    (0, None, None),
])
def test_rows_are_requests_times_gamma(requests, tokens, want, monkeypatch):
    context = types.ModuleType(sgl.CONTEXT)
    context.get_schedule = lambda: types.SimpleNamespace(max_running_requests=requests)
    context.get_spec = lambda: types.SimpleNamespace(speculative_num_draft_tokens=tokens)
    monkeypatch.setitem(sys.modules, sgl.CONTEXT, context)
    assert dspark.rows_from_sglang(DSparkDraft()) == want


def test_the_hook_installs_when_sglang_attaches_the_head(monkeypatch):
    """A draft loaded without its head (SGLang attaches the target's later) installs
    right after SGLang's ``attach_shared_modules``, once; one holding its head at load
    (DeepSeek V4's own) installs at once."""
    done = []
    monkeypatch.setattr(dspark, "install_sglang_dspark_gathers",
                        lambda model, dcp, rows: done.append(model) or dspark.DSpark(
                            "D", (), (), 1, 2, dcp))
    monkeypatch.setattr(dspark, "rows_from_sglang", lambda model: None)
    runner = types.SimpleNamespace(model=DSparkDraft())
    assert dspark.on_attach(runner) is None and done == []
    dspark.on_attach(runner)  # a second load hook call wraps nothing more
    runner.model.attach_shared_modules(embed_tokens=None, lm_head=ParallelLMHead())
    assert done == [runner.model]
    own = types.SimpleNamespace(model=attached_at_load())
    assert dspark.on_attach(own).name == "D" and done[-1] is own.model


def attached_at_load():
    model = DSparkDraft()
    model.lm_head = ParallelLMHead()
    return model
