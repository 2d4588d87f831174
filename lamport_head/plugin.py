"""vLLM general plugin (entry point ``vllm.general_plugins`` -> ``lamport_head``).

``register()`` wraps the GPU worker's ``load_model`` so that, once the model is
loaded (before any CUDA graph capture), every TP worker calls
``install_logits_gather`` with the TP device group, TP size and rank, its device,
the DCP size and the rows its decode steps gather (``autotune.rows_from_vllm``: 1 ..
max_num_seqs x (1 + num_speculative_tokens), capped at ``table.MAX_ROWS``). vLLM loads general plugins in every process and possibly more than
once: wrapping is idempotent, and vLLM is imported only here, lazily. Install's
outcome (stock included) is agreed by every TP rank; an exception out of it is never
swallowed, since the rank it left would enter vLLM's collectives out of step with
its peers. The
``lamport_head`` logger is routed through vLLM's handlers (``log.attach_to_vllm``), so
each worker's lines reach the server's output; rank 0 adds a one-line summary.
"""

import functools
import logging

from . import log

logger = logging.getLogger("lamport_head")
_MARK = "_lamport_head_wrapped"


def _install_after_load(worker):
    from vllm.distributed import parallel_state as ps

    from .autotune import rows_from_vllm
    from .install import install_logits_gather

    tp_group = ps.get_tp_group()
    try:
        dcp = ps.get_dcp_group().world_size
    except Exception:  # no DCP group in this configuration
        dcp = 1
    model = worker.model_runner.get_model()
    tp, rank = tp_group.world_size, tp_group.rank_in_group
    # The rows its decode steps gather: max running requests x (1 + draft tokens).
    rows = rows_from_vllm(getattr(worker, "vllm_config", None))
    with log.collect() as lines:
        served = install_logits_gather(model, tp_group.device_group, tp, rank, worker.device, dcp,
                                       rows=rows)
    if rank == 0:
        logger.info("lamport-head summary: %s", summary(type(model).__name__, tp, dcp, served, lines))
    return served


def summary(model_name, tp, dcp, served, lines):
    """Rank 0's one line for the whole TP group. Every rank takes the same outcome
    (the checks see the same inputs; the build is agreed by a MIN all-reduce)."""
    head = f"{model_name}, tp={tp}, dcp={dcp}: "
    if served:
        return head + f"Lamport logits gather for rows {list(served)} on all {tp} TP ranks"
    why = (lines[-1].removeprefix("lamport-head: ").removeprefix("stock logits gather: ")
           if lines else "see the lines above")
    return head + f"stock logits gather on all {tp} TP ranks ({why})"


def wrap_worker(worker_cls):
    """Make ``worker_cls.load_model`` install the gather afterwards (once)."""
    original = worker_cls.load_model
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # No catch-all here: install_logits_gather never raises (every rank takes the
        # agreed outcome, stock included), so an exception means this rank could not
        # finish while its peers may wait in one of install's collectives. Swallowing
        # it would send this rank alone into vLLM's collectives; letting it stop the
        # worker is the fail-stop outcome (the engine stops every rank).
        _install_after_load(self)
        return result

    setattr(load_model, _MARK, True)
    worker_cls.load_model = load_model
    return True


def register():
    """The plugin entry point: harmless when called twice or without vLLM's GPU worker."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as exc:
        logger.debug("lamport-head: no vLLM GPU worker to hook (%s)", exc)
        return
    log.attach_to_vllm()
    if wrap_worker(Worker):
        logger.debug("lamport-head: logits gather hook registered on %s", Worker.__qualname__)
