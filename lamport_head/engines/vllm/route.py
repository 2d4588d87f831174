"""Installing on vLLM: the explicit ``install_logits_gather`` on a loaded model, the
drafter's install after the target's, and the worker hook that runs both (and the
candidate gathers, then the all-to-alls of vocab shards: ``vocab_shards``) once a
worker's ``load_model`` returns, then has rank 0 say the summary.

Every install here is collective over the TP group once it starts (``install.install``:
every rank takes the same ``Outcome``) and raises only for a failure of this rank
alone, which must stop the worker (fail-stop: the engine then stops every rank). What
decides whether to start is the same on every rank by construction: the running
release's names (``release.check``, before any collective), the model's classes and
the config (``find``).
"""

import functools
import logging
from typing import NamedTuple

import torch

from ... import dtypes, install
from ...collective import all_min
from ...outcome import Outcome, Ranks, Reason
from .. import measure_first_use
from . import release as releases
from .candidates import install_drafter_candidates, install_pair_candidates
from .find import (GATHER, candidate_path, candidate_rows, draft_model, drafter_paths,
                   drafter_rows, exchange_paths, find_drafter_target, find_gather_target,
                   gather_stock, logits_paths, other_collectives, owns_gather, rows_from_vllm)
from .summary import summary
from .vocab_shards import install_exchanges

logger = logging.getLogger("lamport_head")
_MARK = "_lamport_head_wrapped"


def install_logits_gather(model, group, tp, rank, device, dcp=1, rows=None, *,
                          device_group=None):
    """Route the vLLM model's LogitsProcessor ``_gather_logits`` (an instance
    attribute: other LogitsProcessors keep theirs) through a HeadGather for the
    table's enabled rows; which processor is ``find_gather_target``'s to say.
    ``rows``: the row counts the server's decode steps gather (``rows_from_vllm``);
    None: the table's rows. Returns an ``outcome.Outcome``: ``.rows`` served, or
    ``.reason`` and ``.message`` saying why the stock gather stays.
    Collective over ``group`` once a processor is found (``install.install``: every
    rank takes the same outcome); raises only for a failure of this rank alone, which
    must stop the worker (``install``'s fail-stop). ``group``: where the ranks agree (a
    CPU group where there is one); ``device_group``: the stock all-gather's group,
    which first-use tuning times (default ``group``)."""
    return _install_target(model, Ranks(group, tp, rank, device, dcp, device_group), rows)


def _install_target(model, ranks, rows):
    lp, head, where = find_gather_target(model, force=True)  # FORCE is decided agreed
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR, where)
    site = _site(model, lp, head, where, find_gather_target)
    return install.install(site, ranks, rows, measure=measure_first_use)


def _site(model, lp, head, where, finder):
    """The install core's view of the processor ``finder`` found in ``model``. Its logits'
    dtype is the processor's ``head_dtype`` (vLLM's ``ModelConfig.head_dtype``: the model
    dtype, or float32 with ``--hf-overrides '{"head_dtype": "float32"}'``, the projection
    then accumulating into FP32 over the BF16 weight), else the weight's; its stock is
    ``find.gather_stock``'s (NCCL's all-gather, or vLLM's custom all-gather where its
    release gathers through it)."""
    head_dtype = getattr(lp, "head_dtype", None)
    return install.GatherSite(
        processor=lp, attr=GATHER, weight=getattr(head, "weight", None),
        head_tp=getattr(head, "tp_size", 1), where=where,
        plain=(getattr(lp, "use_all_gather", False) and not getattr(lp, "logits_as_input", False)
               and (head_dtype is None or isinstance(head_dtype, torch.dtype))),
        facts=(f"use_all_gather={getattr(lp, 'use_all_gather', None)}, "
               f"logits_as_input={getattr(lp, 'logits_as_input', None)}, "
               f"head_dtype={head_dtype}"),
        kept=finder(model, force=False)[2] if owns_gather(lp) else None,
        stock=gather_stock(lp), dtype=head_dtype)


class Drafter(NamedTuple):
    """What the drafter's install did, for the summary line (the same on every rank)."""

    name: str  # the drafter model's class
    outcome: object  # its Outcome (.shared: through the target's gather, not its own)
    vocab: int  # its head's full (padded) vocabulary, TP x shard width (0: no head found)
    through: tuple  # its paths through the gather ("drafter compute_logits x k")
    around: tuple  # its paths that skip the gather, with the setting that sends vLLM there

    @property
    def served(self):
        return self.outcome.rows


def install_drafter_gather(draft, target, ranks, rows=None,
                           paths=(("drafter compute_logits x 1",), ())):
    """Route the drafter's LogitsProcessor after the target's install (every TP rank,
    the same order, over ``ranks``, an ``outcome.Ranks``): a ``Drafter`` saying how.

    - No path of the drafter gathers logits (``paths``: ``drafter_paths``): nothing is
      built (no mailbox, no first-use tuning), one line.
    - Its head has the shard width and its logits the dtype of the gather the target
      was served by (EAGLE and MTP share the target's lm_head; a drafter of the same
      vocabulary and head dtype): the target's gather serves it too
      (``install.reroute``: no collective; the gather was agreed by every rank, the
      site's facts are the same on every rank).
    - Else its own install (another vocabulary, e.g. an EAGLE3 head of 32000, or the
      target stayed stock): ``install.install`` with the drafter's ``rows``,
      collective, agreed, fail-stop as the target's (for its own logits' dtype): every
      rank serves the drafter's
      rows or every rank keeps its stock gather; the target's outcome is not touched
      either way (its gather and mailbox are its own).

    Raises only as ``install_logits_gather`` does (a failure of this rank alone)."""
    name = type(draft).__name__
    through, around = (tuple(p) for p in paths)
    lp, head, where = find_drafter_target(draft, force=True)  # FORCE is decided agreed
    weight = getattr(head, "weight", None)
    vocab = ranks.tp * weight.shape[0] if getattr(weight, "dim", lambda: 0)() == 2 else 0
    what = f"the drafter {name}'s logits gather"
    if not through:
        why = f"no draft step gathers logits: {around[0] if around else 'see the config'}"
        return Drafter(name, install.kept(Reason.NOT_GATHERED, why, what), vocab, through,
                       around)
    if lp is None:
        return Drafter(name, install.kept(Reason.NO_PROCESSOR, where, what), vocab, through,
                       around)
    site = _site(draft, lp, head, where, find_drafter_target)
    target_lp = find_gather_target(target, force=True)[0] if target is not None else None
    gather = getattr(target_lp, "head_gather", None)
    if (gather is not None and weight is not None and weight.shape[0] == gather.shard_width
            and dtypes.served(site.logits_dtype)
            and dtypes.name(site.logits_dtype) == install.gather_dtype(gather)):
        outcome = install.reroute(site, gather, label=f"the drafter {name}")
    else:
        outcome = install.install(site, ranks, rows, measure=measure_first_use)
    # the target's rows may reach further than a draft step's
    return Drafter(name, outcome.within(rows), vocab, through, around)


def _cpu_group(coordinator):
    """A GroupCoordinator's CPU (gloo) group, or its device group when it has none."""
    cpu = getattr(coordinator, "cpu_group", None)
    return cpu if cpu is not None else coordinator.device_group


def _install_after_load(worker):
    """Every install a loaded worker takes, in the same order on every rank; rank 0 says
    the summary. Returns the target's ``Outcome``."""
    from vllm.distributed import parallel_state as ps  # lazy: vLLM

    tp_group = ps.get_tp_group()
    running = releases.say(releases.check(worker, tp_group))
    usable = running.usable
    if not running.missing or all(hasattr(tp_group, n) for n in releases.RELIED_ON_GROUP):
        # Every rank runs the same vLLM and reads the same names, but a name read off a
        # live object (a property raising on one rank) could answer alone: agreed on
        # vLLM's gloo group, which every rank that loaded reaches, before any other step.
        usable = bool(all_min(usable, _cpu_group(tp_group)))
    if not usable:
        why = (f"{running} lacks {', '.join(running.missing)}" if running.missing
               else "another rank's vLLM lacks a name the plugin relies on")
        outcome = Outcome.kept(Reason.ENGINE, why)
        if getattr(tp_group, "rank_in_group", 0) == 0:
            name = type(getattr(worker, "model_runner", None)).__name__
            logger.info("lamport-head summary: %s", summary(
                running, name, getattr(tp_group, "world_size", "?"), "?", outcome))
        return outcome
    try:
        dcp = ps.get_dcp_group().world_size
    except Exception:  # no DCP group in this configuration
        dcp = 1
    model = worker.model_runner.get_model()
    config = getattr(worker, "vllm_config", None)
    # agreement on vLLM's gloo group: a rank whose CUDA context broke still reaches it
    ranks = Ranks(_cpu_group(tp_group), tp_group.world_size, tp_group.rank_in_group,
                  worker.device, dcp, tp_group.device_group)
    # The rows its decode steps gather: max running requests x (1 + draft tokens).
    outcome = _install_target(model, ranks, rows_from_vllm(config))
    # The drafter's model, loaded by the runner's load_model (V2 speculator.load_model)
    # before it returned: after the target's, on every rank.
    draft = draft_model(worker.model_runner)
    drafter, candidates = None, []
    if draft is not None:
        drafter = install_drafter_gather(draft, model, ranks, drafter_rows(config),
                                         drafter_paths(config))
        path = candidate_path(config)
        if path is not None:
            candidates.append(install_pair_candidates(draft, model, ranks, drafter_rows(config),
                                                      path))
        # the drafter's compute_candidates, on every rank alike
        top_k = install_drafter_candidates(draft, ranks, candidate_rows(config))
        if top_k is not None:
            candidates.append(top_k)
    # the all-to-alls of vocab shards (batch-sharded sampling), last, on every rank alike
    speculator = getattr(worker.model_runner, "speculator", None)
    exchanges = install_exchanges(exchange_paths(model, draft, speculator, config, ranks.tp),
                                  ranks)
    if ranks.rank == 0:
        through, around = logits_paths(model, config)
        logger.info("lamport-head summary: %s", summary(
            running, type(model).__name__, ranks.tp, dcp, outcome, through, around, drafter,
            candidates, other_collectives(model, draft, config), exchanges,
            stock=gather_stock(find_gather_target(model, force=True)[0])))
    return outcome


def wrap_worker(worker_cls):
    """Make ``worker_cls.load_model`` install the gather afterwards (once)."""
    original = worker_cls.load_model
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # No catch-all here: install_logits_gather raises only when this rank failed
        # alone (every rank takes the agreed outcome, stock included): this rank could not
        # finish while its peers may wait in one of install's collectives. Swallowing
        # it would send this rank alone into vLLM's collectives; letting it stop the
        # worker is the fail-stop outcome (the engine stops every rank).
        _install_after_load(self)
        return result

    setattr(load_model, _MARK, True)
    worker_cls.load_model = load_model
    return True


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, at vLLM's level."""

    def emit(self, record):
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def attach_to_vllm() -> bool:
    """Route the ``lamport_head`` logger through vLLM's in this process (idempotent).

    vLLM configures only its ``vllm`` logger (handler, format, level, stream; or the
    user's ``VLLM_LOGGING_CONFIG_PATH``), so records of ours had no handler there and
    INFO lines were dropped. Each record goes to whatever the ``vllm`` logger's
    handlers are when it is emitted (a later reconfiguration is followed), at vLLM's
    level, without propagating twice; a user who configured ``lamport_head``
    themselves keeps their configuration. False when vLLM's logging is not importable
    or ours is configured already."""
    ours = logging.getLogger("lamport_head")
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return True
    if ours.handlers:
        return False
    try:
        import vllm.logger  # noqa: F401  (vLLM then configures "vllm" per process)
    except Exception:
        return False
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's level decides, in _ToVllm
    ours.propagate = False
    return True


def register():
    """The plugin entry point: harmless when called twice or without vLLM's GPU worker.
    A release missing a name the plugin relies on is left unhooked (one WARNING line:
    the engine runs with its own gathers); one outside ``release.RELEASES`` with every
    name present is hooked, with one WARNING line saying it is untested."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # called without vLLM: nothing to hook
        logger.debug("lamport-head: no vLLM to hook (%s)", exc)
        return
    attach_to_vllm()
    running = releases.say(releases.check())
    if not running.usable:
        return
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as exc:
        logger.warning("lamport-head: %s: no GPU worker to hook (%s: %s); vLLM's own logits "
                       "gather serves", running, type(exc).__name__, exc)
        return
    if wrap_worker(Worker):
        logger.debug("lamport-head: logits gather hook registered on %s", Worker.__qualname__)
