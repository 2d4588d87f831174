"""The vLLM releases tested (``RELEASES``; tests/helpers.py reads it) and whether the running
one has every name the adapter relies on. The adapter calls ``check`` before its first
collective; a release lacking a name keeps vLLM's gathers (the speed-up is lost, not the engine)."""

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass

logger = logging.getLogger("lamport_head")

RELEASES = ("0.33.0", "0.34.0")  # the README names them too
STOCK_PROCESSOR = ("vllm.model_executor.layers.logits_processor", "LogitsProcessor")

TP_GROUP = ("vllm.distributed.parallel_state", "get_tp_group")
# (module, dotted attribute): every module-level vLLM name the adapter calls, wraps or replaces
RELIED = (
    ("vllm.v1.worker.gpu_worker", "Worker.load_model"),
    TP_GROUP,
    ("vllm.distributed", "tensor_model_parallel_all_gather"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor._gather_logits"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.get_top_tokens"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.get_top_k_tokens"),
    # the candidates' dispatcher replaces it here, where the candidate methods look it up
    ("vllm.model_executor.layers.logits_processor", "tensor_model_parallel_all_gather"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
)
# vLLM 0.34's all-to-all of vocab shards, and each caller's module global (bound at import).
# Looked up only where a step takes that path: 0.33 lacks it, and that path alone stays stock.
EXCHANGE = "all_to_all_vocab_shards"
EXCHANGE_HOME = "vllm.v1.worker.gpu.sample.batch_shard"
TARGET_EXCHANGE = "GPUModelRunner.sample"
DSPARK_EXCHANGE = "DSparkSpeculator._sample_sequential_sharded"
EXCHANGE_CALLERS = {
    TARGET_EXCHANGE: "vllm.v1.worker.gpu.model_runner",
    DSPARK_EXCHANGE: "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
}
# set by DSparkSpeculator.load_model: its PyNCCL communicator; None: sampling stays replicated
DSPARK_SHARDED = "_sharded_sequential_comm"
# CudaCommunicator's one-shot all-gather: the stock where vLLM's own _gather_logits calls it
# (no release does yet; find.gather_stock): never relied on
CUSTOM_GATHER = "custom_all_gather"
RELIED_ON_WORKER = ("model_runner.get_model", "device")
RELIED_ON_GROUP = ("world_size", "rank_in_group", "device_group")


@dataclass(frozen=True)
class Release:
    """The running vLLM: its version, whether ``RELEASES`` holds it, the names it lacks."""

    version: str
    tested: bool
    missing: tuple = ()

    @property
    def usable(self):
        return not self.missing

    def __str__(self):
        return f"vLLM {self.version}"


def version():
    """``vllm.__version__``, else the installed metadata's."""
    import vllm

    found = getattr(vllm, "__version__", None)
    if not found:
        found = importlib.metadata.version("vllm")
    return str(found)


def _has(obj, dotted):
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except Exception:  # a property raising counts as missing
            return False
    return True


def lacks(names):
    """The ``(module, dotted attribute)`` names the running vLLM lacks, as ``module:attribute``.
    Never raises: a module that fails to import lacks all its names."""
    missing = []
    for module, dotted in names:
        try:
            found = _has(importlib.import_module(module), dotted)
        except Exception:
            found = False
        if not found:
            missing.append(f"{module}:{dotted}")
    return tuple(missing)


def exchange_names(paths):
    """The names each caller in ``paths`` needs: vLLM's function and the caller's global."""
    return ((EXCHANGE_HOME, EXCHANGE),) + tuple((EXCHANGE_CALLERS[p], EXCHANGE) for p in paths)


def check(worker=None, group=None):
    """The running ``Release``: ``RELIED``, and ``RELIED_ON_WORKER``/``RELIED_ON_GROUP`` on
    ``worker``/``group`` (vLLM's TP coordinator) when given. Never raises."""
    missing = list(lacks(RELIED))
    # find.owns_gather tells vLLM's own processor by its class's module: a class moved
    # elsewhere (even re-exported here) would read as "has its own gather" everywhere
    try:
        home = importlib.import_module(STOCK_PROCESSOR[0])
        defined = getattr(home, STOCK_PROCESSOR[1]).__module__ == STOCK_PROCESSOR[0]
    except Exception:
        defined = False
    if not defined and f"{STOCK_PROCESSOR[0]}:{STOCK_PROCESSOR[1]}._gather_logits" not in missing:
        missing.append(f"{STOCK_PROCESSOR[0]}:{STOCK_PROCESSOR[1]} (defined there)")
    if worker is not None:
        missing += [f"{type(worker).__name__}.{d}" for d in RELIED_ON_WORKER
                    if not _has(worker, d)]
    if group is not None:
        missing += [f"{type(group).__name__}.{d}" for d in RELIED_ON_GROUP if not _has(group, d)]
    try:
        found = version()
    except Exception as exc:
        found = f"unknown ({type(exc).__name__})"
    return Release(found, found in RELEASES, tuple(missing))


_said = set()


def say(release):
    """One WARNING line per process for an untested or incomplete release; returns it."""
    key = (release.version, release.missing)
    if key in _said or (release.tested and release.usable):
        return release
    _said.add(key)
    window = ", ".join(RELEASES)
    if not release.usable:
        logger.warning("lamport-head: %s lacks %s, which the plugin relies on: every rank keeps "
                       "vLLM's own logits gather (the plugin is written for vLLM %s)", release,
                       ", ".join(release.missing), window)
    else:
        logger.warning("lamport-head: %s is not a release the plugin was tested on (%s); every "
                       "name it relies on is present, so it serves", release, window)
    return release
