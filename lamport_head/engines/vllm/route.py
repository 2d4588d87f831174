"""Installing on vLLM: ``install_logits_gather``, the drafter's install, and the worker hook
that runs every install once ``load_model`` returns. Whether an install starts is decided
from facts equal on every rank by construction: ``release.check`` (before any collective),
the model's classes, the config (docs/design.md, "Rule for adapters")."""

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
    """Route the ``_gather_logits`` of the processor ``find_gather_target`` picks through a
    HeadGather: an ``outcome.Outcome``. Collective once a processor is found. ``rows``: the
    decode steps' row counts (None: the table's); ``group``: where the ranks agree (a CPU
    group where there is one); ``device_group``: the stock's, timed by first-use tuning."""
    return _install_target(model, Ranks(group, tp, rank, device, dcp, device_group), rows)


def _install_target(model, ranks, rows):
    lp, head, where = find_gather_target(model, force=True)  # FORCE is decided agreed
    if lp is None:
        return install.kept(Reason.NO_PROCESSOR, where)
    site = _site(model, lp, head, where, find_gather_target)
    return install.install(site, ranks, rows, measure=measure_first_use)


def _site(model, lp, head, where, finder):
    """The install core's view of the processor ``finder`` found. Its logits' dtype: its
    ``head_dtype`` (``ModelConfig.head_dtype``, float32 for an FP32 head), else the weight's."""
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

    name: str
    outcome: object  # .shared: served by the target's gather
    vocab: int  # TP x shard width (0: no head found)
    through: tuple
    around: tuple

    @property
    def served(self):
        return self.outcome.rows


def install_drafter_gather(draft, target, ranks, rows=None,
                           paths=(("drafter compute_logits x 1",), ())):
    """Route the drafter's LogitsProcessor after the target's, on every rank: a ``Drafter``.
    No draft path gathers logits (``paths``): nothing built. A head of the target gather's
    shard width and logits dtype: that gather serves it (``install.reroute``, no collective).
    Else its own install, agreed and fail-stop; the target's gather is never touched."""
    name = type(draft).__name__
    through, around = (tuple(p) for p in paths)
    lp, head, where = find_drafter_target(draft, force=True)
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
    cpu = getattr(coordinator, "cpu_group", None)
    return cpu if cpu is not None else coordinator.device_group


def _install_after_load(worker):
    """Every install of a loaded worker, in one order on every rank: the target's ``Outcome``."""
    from vllm.distributed import parallel_state as ps

    tp_group = ps.get_tp_group()
    running = releases.say(releases.check(worker, tp_group))
    usable = running.usable
    if not running.missing or all(hasattr(tp_group, n) for n in releases.RELIED_ON_GROUP):
        # a name read off a live object could answer on one rank alone: agreed first
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
    except Exception:
        dcp = 1
    model = worker.model_runner.get_model()
    config = getattr(worker, "vllm_config", None)
    ranks = Ranks(_cpu_group(tp_group), tp_group.world_size, tp_group.rank_in_group,
                  worker.device, dcp, tp_group.device_group)
    outcome = _install_target(model, ranks, rows_from_vllm(config))
    # the runner's load_model loaded the drafter's model too (V2: speculator.load_model)
    draft = draft_model(worker.model_runner)
    drafter, candidates = None, []
    if draft is not None:
        drafter = install_drafter_gather(draft, model, ranks, drafter_rows(config),
                                         drafter_paths(config))
        path = candidate_path(config)
        if path is not None:
            candidates.append(install_pair_candidates(draft, model, ranks, drafter_rows(config),
                                                      path))
        top_k = install_drafter_candidates(draft, ranks, candidate_rows(config))
        if top_k is not None:
            candidates.append(top_k)
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
        # No catch-all: install raises only for this rank's own failure, and swallowing it
        # would send this rank alone into vLLM's collectives (docs/design.md, "The fail-stop rule").
        _install_after_load(self)
        return result

    setattr(load_model, _MARK, True)
    worker_cls.load_model = load_model
    return True


class _ToVllm(logging.Handler):
    def emit(self, record):
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def attach_to_vllm() -> bool:
    """Send our records through the ``vllm`` logger's handlers, at its level (vLLM configures
    only its own logger). Idempotent; False when vLLM's logging is not importable or the
    user configured ``lamport_head``."""
    ours = logging.getLogger("lamport_head")
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return True
    if ours.handlers:
        return False
    try:
        import vllm.logger  # noqa: F401
    except Exception:
        return False
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's level decides, in _ToVllm
    ours.propagate = False
    return True


def register():
    """The plugin entry point, harmless twice or without vLLM's GPU worker. A release lacking
    a relied-upon name is left unhooked (docs/engines.md, "vLLM")."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
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
