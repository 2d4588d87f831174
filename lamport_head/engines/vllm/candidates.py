"""vLLM's candidate all-gathers (``get_top_tokens``' pairs, ``get_top_k_tokens``' values, ids
and log-partition) on packed Lamport gathers (docs/candidates.md). vLLM's code runs unchanged:
its module-global all-gather, replaced once, routes a (cols, dtype) only inside a routed
processor's candidate method, deciding by processor, shape and dtype alone, alike on every rank."""

import functools
import importlib
import logging
import threading
from typing import NamedTuple

import torch

from ... import install
from ...candidates import SmallGather, packed_width
from ...outcome import Reason
from .. import measure_first_use
from .find import (TOP_K_PATH, candidate_caller, find_drafter_target, find_gather_target,
                   pair_payloads)

logger = logging.getLogger("lamport_head")
_MARK = "_lamport_head_wrapped"

CANDIDATE_METHODS = ("get_top_tokens", "get_top_k_tokens")
_LP_MODULE = "vllm.model_executor.layers.logits_processor"
_ALL_GATHER = "tensor_model_parallel_all_gather"
_ROUTES = "_lamport_candidates"  # a processor's {(cols, dtype): SmallGather}
_ACTIVE = threading.local()  # .routes: the routes of the candidate method running now



class Candidates(NamedTuple):
    """What the candidate gathers' install did, for the summary line (alike on every rank)."""

    path: str
    outcomes: tuple  # ((packed width, Outcome), ...), sorted by width

    @property
    def served(self):
        return tuple((w, o.rows) for w, o in self.outcomes if o.served)

    @property
    def kept(self):
        return None if self.served else next((o for _, o in self.outcomes), None)


class _Packed:
    """The install core's processor for one packed width; its stock ``gather`` is vLLM's."""

    def __init__(self, all_gather):
        self.gather = functools.partial(all_gather, dim=-1)


def install_candidate_gather(processors, ranks, rows=None, payloads=None, *,
                             path="get_top_tokens"):
    """Route the candidate all-gathers of ``processors`` through one Lamport gather per packed
    width of ``payloads`` (default ``pair_payloads()``): a ``Candidates``. Each is an
    ``install.install`` (table sections keyed by V = TP x packed width), in sorted order on
    every rank. Raises, before any collective, only for payloads ``packed_width`` refuses."""
    from vllm.distributed import tensor_model_parallel_all_gather


    payloads = tuple(payloads or pair_payloads())
    widths = {}
    for cols, dtype in payloads:
        widths.setdefault(packed_width(cols, dtype), []).append((cols, dtype))
    names = [type(p).__name__ for p in processors]
    routes, outcomes = {}, []
    for width in sorted(widths):
        holder = _Packed(tensor_model_parallel_all_gather)
        what = ", ".join(f"[M, {c}] {str(d).removeprefix('torch.')}" for c, d in widths[width])
        site = install.GatherSite(
            processor=holder, attr="gather", head_tp=ranks.tp,
            weight=torch.empty((width, 0), dtype=torch.bfloat16, device="meta"),
            where=f"the {path} all-gather of {what} ({' and '.join(names)}), packed to "
                  f"{width} BF16 a rank")
        outcome = install.install(site, ranks, rows, measure=measure_first_use)
        outcomes.append((width, outcome))
        if outcome.served:
            for cols, dtype in widths[width]:
                routes[(cols, dtype)] = SmallGather(holder.head_gather, ranks.tp, cols, dtype)
    for processor in processors:
        _route_candidates(processor, routes)
    return Candidates(path, tuple(outcomes))


def _route_candidates(processor, routes):
    """Register ``routes`` on ``processor``, active while its candidate methods run."""
    if not routes:
        return
    _dispatching()
    vars(processor).setdefault(_ROUTES, {}).update(routes)
    for name in CANDIDATE_METHODS:
        method = getattr(processor, name, None)
        if method is None or getattr(method, _MARK, False):
            continue
        setattr(processor, name, _with_routes(method, vars(processor)[_ROUTES]))


def _with_routes(method, routes):
    @functools.wraps(method)
    def routed(*args, **kwargs):
        before = getattr(_ACTIVE, "routes", None)
        _ACTIVE.routes = routes
        try:
            return method(*args, **kwargs)
        finally:
            _ACTIVE.routes = before

    setattr(routed, _MARK, True)
    return routed


def _dispatching():
    """Replace the module-global all-gather once: a 2-D last-dim call of an active route's
    ``(cols, dtype)`` takes its ``SmallGather``; every other call is vLLM's, unchanged."""
    module = importlib.import_module(_LP_MODULE)
    original = getattr(module, _ALL_GATHER)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def all_gather(input_, dim=-1):
        routes = getattr(_ACTIVE, "routes", None)
        if routes and input_.dim() == 2 and dim in (-1, 1):
            small = routes.get((input_.shape[1], input_.dtype))
            if small is not None:
                return small(input_, stock=functools.partial(original, dim=dim))
        return original(input_, dim)

    setattr(all_gather, _MARK, True)
    setattr(module, _ALL_GATHER, all_gather)



def install_drafter_candidates(draft, ranks, rows=None):
    """Route the ``compute_candidates`` gathers of a drafter ``CANDIDATE_CALLERS`` lists: a
    ``Candidates``, or None for another (``candidate_caller`` decides, alike on every rank)."""
    caller, processor, payloads, where = candidate_caller(draft)
    if caller is None:
        logger.debug("lamport-head: no candidate gather to route: %s", where)
        return None
    if processor is None:
        return Candidates(TOP_K_PATH, ((0, install.kept(Reason.NO_PROCESSOR, where,
                                                         f"the {TOP_K_PATH} all-gather")),))
    return install_candidate_gather([processor], ranks, rows, payloads, path=TOP_K_PATH)



def install_pair_candidates(draft, model, ranks, rows, path):
    """Route the drafter's ``get_top_tokens`` pairs on its processor and the target's (one
    gather serves both: routes are keyed by shape)."""
    found = [find_drafter_target(draft, force=True)[0], find_gather_target(model, force=True)[0]]
    processors = [p for i, p in enumerate(found) if p is not None and p not in found[:i]]
    if found[0] is None:
        why = f"no LogitsProcessor found on {type(draft).__name__}"
        return Candidates(path, ((0, install.kept(Reason.NO_PROCESSOR, why,
                                                   f"the {path} all-gather")),))
    return install_candidate_gather(processors, ranks, rows, pair_payloads(), path=path)

