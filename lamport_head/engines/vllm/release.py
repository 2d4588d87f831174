"""Which vLLM releases the adapter is written for, and whether the running one still has
every name the adapter relies on.

``RELEASES`` is the window: the releases the test bed runs the real-vLLM tests on
(tests/helpers.py reads it from here). ``check()`` looks up ``RELIED`` (the module-level
names: classes, methods, module globals) in the running vLLM, ``check(worker)`` also the
names the hook reads off a live worker; ``lacks(exchange_names(...))`` the 0.34 names the
all-to-all of vocab shards relies on, only where a step takes that path (0.33 has none:
that path alone stays stock). Every rank runs the same vLLM, so the answer is
the same on every rank: a rank acting on it alone never leaves a peer in a collective.
Invariant: the adapter consults ``check`` before its first collective, and a release
missing any name serves stock (the speed-up is lost, never the engine).
"""

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass

logger = logging.getLogger("lamport_head")

RELEASES = ("0.33.0", "0.34.0")  # the vLLM releases tested (the README names them too)
STOCK_PROCESSOR = ("vllm.model_executor.layers.logits_processor", "LogitsProcessor")

# vLLM's TP group of a worker (the hook's), and of an all-to-all's call: the dispatcher
# finds it where vLLM's own all_to_all_vocab_shards does
TP_GROUP = ("vllm.distributed.parallel_state", "get_tp_group")
# (module, dotted attribute): every module-level name of vLLM the adapter calls, wraps,
# replaces or recognizes
RELIED = (
    ("vllm.v1.worker.gpu_worker", "Worker.load_model"),  # wrapped: the install hook
    TP_GROUP,  # the TP group (route's hook; the all-to-all's dispatcher)
    ("vllm.distributed", "tensor_model_parallel_all_gather"),  # the candidates' stock
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor._gather_logits"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.get_top_tokens"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.get_top_k_tokens"),
    # replaced by the candidates' dispatcher: the candidate methods look it up here
    ("vllm.model_executor.layers.logits_processor", "tensor_model_parallel_all_gather"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
)
# vLLM 0.34's all-to-all of vocab shards (batch-sharded sampling): the function, where vLLM
# defines it, and each caller's module global (the callers import it by name, so the global
# is what runs; the exchange routes replace it there, ``vocab_shards``), by the caller's
# name in the summary. Looked up only when a step takes that path: 0.33 has none (its
# batch-sharded sampling calls ``all_to_all_logits``, not routed), so a missing name leaves
# that path stock and never the gather (``lacks``).
EXCHANGE = "all_to_all_vocab_shards"
EXCHANGE_HOME = "vllm.v1.worker.gpu.sample.batch_shard"
TARGET_EXCHANGE = "GPUModelRunner.sample"  # the target's batch-sharded sampling
DSPARK_EXCHANGE = "DSparkSpeculator._sample_sequential_sharded"  # DSpark's sharded drafting
EXCHANGE_CALLERS = {
    TARGET_EXCHANGE: "vllm.v1.worker.gpu.model_runner",
    DSPARK_EXCHANGE: "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
}
# DSparkSpeculator's own decision (its load_model) to shard its sequential sampling: the
# PyNCCL communicator it exchanges with, None when sampling stays replicated
DSPARK_SHARDED = "_sharded_sequential_comm"
# CudaCommunicator's one-shot all-gather (vLLM 0.33 on: IPC, or the MNNVL Lamport
# all-gather with multicast; None where it declines). A LogitsProcessor._gather_logits
# of vLLM's own that calls it (no release does yet; vLLM PR 57856 would) makes it the
# stock the route replaces (find.gather_stock): looked up only in that code, never relied on
CUSTOM_GATHER = "custom_all_gather"
# what the hook reads off a loaded worker (attribute paths from the worker)
RELIED_ON_WORKER = ("model_runner.get_model", "device")
RELIED_ON_GROUP = ("world_size", "rank_in_group", "device_group")  # vLLM's GroupCoordinator


@dataclass(frozen=True)
class Release:
    """The running vLLM as the adapter sees it: its ``version``, whether the window
    holds it (``tested``), and the relied-upon names it lacks (``missing``, as
    ``module:attribute``)."""

    version: str
    tested: bool
    missing: tuple = ()

    @property
    def usable(self):
        return not self.missing

    def __str__(self):
        return f"vLLM {self.version}"


def version():
    """The running vLLM's version string (``vllm.__version__``: what vLLM itself reports;
    the installed metadata when the module does not say)."""
    import vllm  # lazy: vLLM, in the worker that has it

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
    """The ``(module, dotted attribute)`` names the running vLLM lacks, as
    ``module:attribute``. Never raises: a module that fails to import counts its names as
    missing."""
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
    """The names the exchange of each caller in ``paths`` (keys of ``EXCHANGE_CALLERS``)
    relies on: vLLM's function where it is defined, and the caller's module global."""
    return ((EXCHANGE_HOME, EXCHANGE),) + tuple((EXCHANGE_CALLERS[p], EXCHANGE) for p in paths)


def check(worker=None, group=None):
    """The running release: its version and the relied-upon names it lacks (``RELIED``;
    with ``worker``, ``RELIED_ON_WORKER`` on it, and with ``group``, vLLM's TP group
    coordinator, ``RELIED_ON_GROUP`` on it). Never raises: a module that fails to
    import counts its names as missing."""
    missing = list(lacks(RELIED))
    # find.owns_gather tells vLLM's own processor by where its class is defined: a class
    # moved elsewhere (even re-exported here) would read as "has its own gather" everywhere
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


_said = set()  # (version, missing) lines said in this process: one each


def say(release):
    """One WARNING line per process for a release outside the window or missing names
    (nothing for a tested, complete one); returns ``release``."""
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
