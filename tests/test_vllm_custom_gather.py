"""A vLLM release whose LogitsProcessor gathers through ``CudaCommunicator.custom_all_gather``
(issue 48 item 3; vLLM PR 57856 would): the route names that stock and keys it apart.

On the real vLLM installed (each release of ``RELEASES`` in its own venv), 2 gloo ranks
made by vLLM's own init, the real plugin loader and the real ``Worker.load_model`` on a
stand-in runner (install forced onto a stand-in kernel: no GPU), one process per rank
loading a model in turn:

- this release, as it is: its ``_gather_logits`` is NCCL's all-gather (``find.gather_stock``),
  served from the NCCL section, and rank 0's summary is the line it always was;
- a stand-in release (``vllm.__version__`` 0.35.0, ``LogitsProcessor._gather_logits``
  calling ``device_communicator.custom_all_gather`` as PR 57856's shape does, then
  vLLM's own gather where it declines; on CPU the communicator's ``custom_all_gather``
  is a gloo stand-in that counts its calls): served only from a ``custom-all-gather``
  section (bitwise, the rows outside the plan through ``custom_all_gather``), not from
  NCCL's (``no-rows``, the message naming the stock and the NCCL sections held), and
  first-use tuning is handed that gather as the stock to time, with its kind; rank 0's
  summary names the stock each time.
"""

import pytest
from helpers import (as_vllm_rank, forced_build, same_bits, spawn_vllm_ranks, vllm_lm,
                     vllm_ranks, vllm_worker)
from tables import sections

VOCAB, HIDDEN = 1000, 64  # padded to 1024: 512 rows of lm_head a rank
ROWS = (1, 2, 3, 4)
STANDIN = "0.35.0"
NCCL_TABLE = sections((1024,))
CUSTOM_TABLE = sections((1024,), stock="custom-all-gather")
PHASES = (("release", "nccl", "0"), ("custom", "custom", "0"), ("nccl_table", "nccl", "0"),
          ("first_use", "nccl", "1"))  # (name, table, LAMPORT_HEAD_AUTOTUNE)


def _rank(rank, world, tmp, tables):
    as_vllm_rank(tmp, rank)
    import logging
    import os

    import torch
    import torch.distributed as dist

    import vllm
    import vllm.plugins
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    import lamport_head.install as install
    from lamport_head import mailbox, provenance
    from lamport_head.collective import together
    from lamport_head.engines.vllm import find
    from lamport_head.tuning import firstuse

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    ours = logging.getLogger("lamport_head")  # configured here: vLLM's bridge stays off
    ours.addHandler(Keep(logging.INFO))
    ours.setLevel(logging.INFO)
    forced_build(install)  # a stand-in kernel (no GPU): it gathers with its own collective
    mailbox.device_key = lambda device: ("host", f"gpu{rank}")  # one GPU a rank
    provenance.facts = lambda: {}
    gen = torch.Generator()

    Lm = vllm_lm(rank, VOCAB, HIDDEN)

    class Runner:
        def __init__(self):
            self.model = None

        def load_model(self, load_dummy_weights=False):
            self.model = Lm()

        def get_model(self):
            return self.model

    customs = []

    def custom_all_gather(x):
        """CudaCommunicator.custom_all_gather's result on CPU: rank-major rows
        ``[TP x M, ...]`` (gloo)."""
        customs.append(x.shape[0])
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def standin_gather_logits(self, logits):
        """PR 57856's shape: the communicator's one-shot all-gather, rank-major rows
        turned into vocab shards as NCCL lays them out; vLLM's own where it declines."""
        communicator = ps.get_tp_group().device_communicator
        if self.use_all_gather:
            gathered = communicator.custom_all_gather(logits)
            if gathered is not None:
                return gathered.view(-1, *logits.shape).movedim(0, -2).flatten(-2)
        return tensor_model_parallel_all_gather(logits)

    out = {}
    with set_current_vllm_config(VllmConfig()):
        vllm_ranks(world, rank, tmp)
        vllm.plugins.load_general_plugins()  # the real loader: our register()
        for name, table, autotune in PHASES:
            if name == "custom":  # from here on, the stand-in release
                vllm.__version__ = STANDIN
                LogitsProcessor._gather_logits = standin_gather_logits
                ps.get_tp_group().device_communicator.custom_all_gather = custom_all_gather
            os.environ.update(LAMPORT_HEAD_TABLE=tables[table], LAMPORT_HEAD_AUTOTUNE=autotune)
            asked = []

            def measure(*args, stock=None, stock_kind=None, **kwargs):
                x = torch.randn(2, 512, generator=gen.manual_seed(7 + rank)).to(torch.bfloat16)
                before = len(customs)
                got = stock(x)
                want = torch.cat([torch.randn(2, 512, generator=gen.manual_seed(7 + r))
                                  .to(torch.bfloat16) for r in range(world)], dim=1)
                asked.append([stock_kind, len(customs) - before, same_bits(got, want)])
                # raised on every rank alike, as first-use tuning's failures are: stays stock
                raise together(RuntimeError("measured elsewhere"))

            firstuse.measure = measure
            before = len(said)
            worker = vllm_worker(VllmConfig(), Runner())
            worker.load_model()
            model, twin = worker.model_runner.model, Lm()
            lp = model.logits_processor
            gather = getattr(lp, "head_gather", None)
            rows = {}
            for m in ROWS:
                hidden = torch.randn(m, HIDDEN, generator=gen.manual_seed(50 + m)).to(
                    torch.bfloat16)
                calls, gathered = len(customs), len(gather.calls) if gather else 0
                got = model.compute_logits(hidden)
                rows[m] = {"kernel": (len(gather.calls) if gather else 0) - gathered,
                           "custom": len(customs) - calls,
                           "equal": same_bits(got, twin.compute_logits(hidden))}
            out[name] = {"stock": find.gather_stock(lp),
                         "served": None if gather is None else sorted(gather.rows),
                         "rows": rows, "asked": asked,
                         "summary": [m for m in said[before:]
                                     if m.startswith("lamport-head summary: ")]}
    dist.barrier()
    out["installed"] = vllm.__version__
    return out


@pytest.fixture(scope="module")
def ranks(vllm_release, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom_gather")
    tables = {}
    for name, text in (("nccl", NCCL_TABLE), ("custom", CUSTOM_TABLE)):
        tables[name] = str(tmp / f"{name}.yaml")
        (tmp / f"{name}.yaml").write_text(text)
    return vllm_release, spawn_vllm_ranks(_rank, 2, tmp, str(tmp), tables)[0]


def _assert_rows(rows, served, custom):
    for m, row in rows.items():
        assert row["equal"], (m, row)  # vLLM's own logits, bitwise
        assert row["kernel"] == (1 if int(m) in served else 0), (m, row)
        assert row["custom"] == (1 if custom and int(m) not in served else 0), (m, row)


def test_this_release_gathers_by_nccl_and_says_what_it_always_said(ranks):
    release, results = ranks
    for rank, r in enumerate(results):
        p = r["release"]
        assert p["stock"] == "nccl-all-gather" and p["served"] == [1, 2, 4]
        _assert_rows(p["rows"], (1, 2, 4), custom=False)
        assert p["summary"] == ([
            f"lamport-head summary: vLLM {release}, Lm, tp=2, dcp=1: Lamport logits gather for "
            "rows [1, 2, 4] on all 2 TP ranks, through compute_logits"] if rank == 0 else [])


def test_a_release_gathering_by_custom_all_gather_is_served_from_its_own_section(ranks):
    """The stand-in release's stock is ``custom-all-gather``: its section serves rows 1, 2
    and 4 (the stand-in kernel), row 3 takes vLLM's custom_all_gather, every row vLLM's
    own logits bitwise; rank 0's summary names the stock."""
    _, results = ranks
    for rank, r in enumerate(results):
        p = r["custom"]
        assert p["stock"] == "custom-all-gather" and p["served"] == [1, 2, 4]
        _assert_rows(p["rows"], (1, 2, 4), custom=True)
        assert p["summary"] == ([
            f"lamport-head summary: vLLM {STANDIN}, Lm, tp=2, dcp=1: Lamport logits gather for "
            "rows [1, 2, 4] on all 2 TP ranks, through compute_logits; the logits gather's "
            "stock: custom-all-gather (LogitsProcessor._gather_logits calls "
            "CudaCommunicator.custom_all_gather)"] if rank == 0 else [])


def test_nccls_section_is_not_served_in_place_of_custom_all_gather(ranks):
    _, results = ranks
    for rank, r in enumerate(results):
        p = r["nccl_table"]
        assert p["stock"] == "custom-all-gather" and p["served"] is None
        _assert_rows(p["rows"], (), custom=True)
        assert p["summary"] == ([
            f"lamport-head summary: vLLM {STANDIN}, Lm, tp=2, dcp=1: stock logits gather on all "
            "2 TP ranks (no-rows: no enabled HEAD_GATHER rows for NVIDIA H200, tp=2, dcp=1, "
            "vocab=1024, stock=custom-all-gather, dtype=bfloat16 (the tables hold sections for "
            "this vocab measured against nccl-all-gather only)); the logits gather's stock: "
            "custom-all-gather (LogitsProcessor._gather_logits calls "
            "CudaCommunicator.custom_all_gather)"] if rank == 0 else [])


def test_first_use_tuning_times_custom_all_gather_as_the_stock(ranks):
    """No section against custom-all-gather: first-use tuning is asked to measure with
    the processor's own gather as the stock (a call of it goes through
    custom_all_gather, and gathers right) and its kind ``custom-all-gather``."""
    _, results = ranks
    for r in results:
        p = r["first_use"]
        assert p["asked"] == [["custom-all-gather", 1, True]], p["asked"]
        assert p["served"] is None
        _assert_rows(p["rows"], (), custom=True)


def test_gather_stock_reads_the_code_of_vllms_own_gather():
    """Without vLLM: ``find.gather_stock`` names ``custom-all-gather`` only where vLLM's own
    LogitsProcessor class (by module and name) gathers through ``custom_all_gather``,
    directly or in code nested in its ``_gather_logits``; a subclass with a gather of its
    own keeps NCCL's key (forced, as before), and so does a plain NCCL gather."""
    from lamport_head.engines.vllm import find

    def processor_class(gather):
        cls = type("LogitsProcessor", (), {"_gather_logits": gather})
        cls.__module__ = "vllm.model_executor.layers.logits_processor"
        return cls

    def direct(self, logits):
        return self.communicator.custom_all_gather(logits)

    def nested(self, logits):
        return (lambda: self.communicator.custom_all_gather(logits))()

    def nccl(self, logits):
        return self.tensor_model_parallel_all_gather(logits)

    for gather, want in ((direct, "custom-all-gather"), (nested, "custom-all-gather"),
                         (nccl, "nccl-all-gather")):
        assert find.gather_stock(processor_class(gather)()) == want, gather.__name__
    own = type("SpecializedDecodeLogitsProcessor", (processor_class(nccl),),
               {"_gather_logits": direct})  # DeepSeek V4.1's shape: its own, custom inside
    assert find.gather_stock(own()) == "nccl-all-gather" and find.gather_stock(None) == \
        "nccl-all-gather"
