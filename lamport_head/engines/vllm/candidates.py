"""The candidate gathers of vLLM's speculative decoding on the mailbox: the all-gathers
inside ``LogitsProcessor.get_top_tokens`` (fp32 (value, index) pairs, greedy drafting
with ``use_local_argmax_reduction``) and ``get_top_k_tokens`` (values, ids and the
log-partition: the drafters' ``compute_candidates``), packed so that the kernel moves
them bitwise (``lamport_head.candidates``).

vLLM's reduction code runs unchanged: the processors' candidate methods (instance
attributes) mark their routes active while they run, and the LogitsProcessor module's
``tensor_model_parallel_all_gather``, replaced once by a dispatcher, sends a routed
(cols, dtype) through the packed gather there and calls vLLM's otherwise. The decision
is by the processor, shape and dtype only, the same on every rank. (vLLM's out-of-tree
layer seam, ``PluggableLayer.register_oot``, swaps a whole LogitsProcessor class by
name at construction; the candidate methods are vLLM's own code we keep, and the
processors of model-specific subclasses would not be covered, so it is not used here.)
"""

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

CANDIDATE_METHODS = ("get_top_tokens", "get_top_k_tokens")  # LogitsProcessor's candidate
# reductions: each all-gathers small payloads through the module global below
_LP_MODULE = "vllm.model_executor.layers.logits_processor"
_ALL_GATHER = "tensor_model_parallel_all_gather"
_ROUTES = "_lamport_candidates"  # a processor's {(cols, dtype): SmallGather}
_ACTIVE = threading.local()  # .routes: the routes of the candidate method running now



class Candidates(NamedTuple):
    """What the candidate gathers' install did, for the summary line (the same on
    every rank)."""

    path: str  # the path vLLM takes ("drafter get_top_tokens x 2")
    outcomes: tuple  # ((packed width, Outcome), ...), one per gather, sorted by width

    @property
    def served(self):
        """``((packed width, rows served), ...)`` of the gathers that serve."""
        return tuple((w, o.rows) for w, o in self.outcomes if o.served)

    @property
    def kept(self):
        """The first stock ``Outcome`` when no gather serves, else None."""
        return None if self.served else next((o for _, o in self.outcomes), None)


class _Packed:
    """The install core's processor for one packed width's gather: ``gather`` (routed
    by install, ``head_gather`` once served) is, stock, the engine's all-gather of the
    packed BF16 rows, bitwise what the Lamport gather returns."""

    def __init__(self, all_gather):
        self.gather = functools.partial(all_gather, dim=-1)


def install_candidate_gather(processors, ranks, rows=None, payloads=None, *,
                             path="get_top_tokens"):
    """Route the candidate all-gathers of the LogitsProcessors ``processors``
    (``get_top_tokens``, ``get_top_k_tokens``: vLLM's code, unchanged) through Lamport
    gathers of the packed payloads (``lamport_head.candidates``): a ``Candidates``.

    ``payloads``: the ``(cols, dtype)`` tensors to route (default ``pair_payloads()``;
    ``top_k_payloads`` for get_top_k_tokens). One gather per packed width, each built
    by the install core (``install.install``: its own table section, keyed by V = TP x
    packed width, or first-use tuning; agreed and fail-stop: every rank serves or
    every rank stays stock), in the same order on every rank (sorted widths); widths
    share one gather. The routes are registered on each processor (``_route_candidates``):
    while its candidate method runs, vLLM's all-gather of a routed ``(cols, dtype)``
    takes the gather for its served rows, stock otherwise: a decision by shape and dtype
    only, the same on every rank. ``path``: what the summary calls it. Never raises but
    for payloads ``candidates.packed_width`` refuses (before any collective, on every
    rank alike: the caller's error)."""
    from vllm.distributed import tensor_model_parallel_all_gather  # lazy: vLLM


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
    """Register ``routes`` on ``processor``: its candidate methods (instance attributes,
    wrapped once) make them the active routes while they run, and vLLM's module global
    all-gather consults them (``_dispatching``). No routes: nothing changes."""
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
    """Replace vLLM's ``tensor_model_parallel_all_gather`` in the LogitsProcessor's
    module, once, by a dispatcher: inside a routed processor's candidate method a
    2-D last-dimension all-gather of a routed ``(cols, dtype)`` goes through its
    ``SmallGather`` (whose stock is the original); every other call is the original's,
    unchanged (``_gather_logits``, other processors, other threads)."""
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
    """Route a drafter's ``compute_candidates`` (``get_top_k_tokens``' all-gathers of
    values, ids and, with log-probs, the log-partition) through Lamport gathers, for the
    drafters ``CANDIDATE_CALLERS`` names: a ``Candidates`` (path ``TOP_K_PATH``), or
    None for a drafter not in the table (unchanged, one debug line). Whether and what
    to install is ``candidate_caller``'s answer, the same on every rank (the model's
    class and config), so no rank enters ``install_candidate_gather``'s collectives
    alone; that install is agreed and fail-stop. Raises only as it does."""
    caller, processor, payloads, where = candidate_caller(draft)
    if caller is None:
        logger.debug("lamport-head: no candidate gather to route: %s", where)
        return None
    if processor is None:
        return Candidates(TOP_K_PATH, ((0, install.kept(Reason.NO_PROCESSOR, where,
                                                         f"the {TOP_K_PATH} all-gather")),))
    return install_candidate_gather([processor], ranks, rows, payloads, path=TOP_K_PATH)



def install_pair_candidates(draft, model, ranks, rows, path):
    """The drafter's ``get_top_tokens`` pairs routed (``install_candidate_gather``), on
    the drafter's LogitsProcessor and the target's (one gather serves both: routes are
    keyed by shape); every rank finds the same processors (the same models)."""
    found = [find_drafter_target(draft, force=True)[0], find_gather_target(model, force=True)[0]]
    processors = [p for i, p in enumerate(found) if p is not None and p not in found[:i]]
    if found[0] is None:
        why = f"no LogitsProcessor found on {type(draft).__name__}"
        return Candidates(path, ((0, install.kept(Reason.NO_PROCESSOR, why,
                                                   f"the {path} all-gather")),))
    return install_candidate_gather(processors, ranks, rows, pair_payloads(), path=path)

