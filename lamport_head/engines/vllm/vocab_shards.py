"""vLLM 0.34's ``all_to_all_vocab_shards`` (batch-sharded sampling, DSpark's sharded drafting)
on ``AllToAll``. Its callers bind it at import, so each caller's module global is replaced by a
dispatcher: replacing vLLM's own would reach no caller, and wrapping the callers or PyNCCL's
``all_to_all_single`` would copy vLLM's sampling or take MoE's all-to-alls too. Every rank takes
the same path: the dispatcher decides by the call's TP group, device, shard width and dtype, the
AllToAll by M (``sum(send_splits)``, replicated). One AllToAll per such key, installed in sorted
order on every rank; an engine on another group or device never reaches it."""

import functools
import importlib
from dataclasses import replace
from typing import NamedTuple

import torch

from ... import install
from ...build import cuda_device
from ...outcome import Outcome, Reason
from ...table import ALL_TO_ALL_STOCK
from .. import measure_first_use
from . import release as releases

_MARK = "_lamport_head_wrapped"
# {(group, device, shard width, torch dtype): routed exchange}; groups (kept alive here) hash
# by identity
_ROUTES = {}
# {(group, device, shard width, dtype name): _Holder}, kept so that a later load's install
# of a key keeps its AllToAll, with no collective
_HOLDERS = {}


class Exchange(NamedTuple):
    """What the all-to-all install did for one caller, for the summary line."""

    path: str  # a key of release.EXCHANGE_CALLERS
    outcome: Outcome  # .shared: by an AllToAll an earlier path installed
    width: int  # 0: no head found


class _Holder:
    """The install core's processor for one key; its stock ``exchange`` is vLLM's function."""

    def __init__(self, original):
        self.exchange = original


def _site(path, holder):
    """The install core's view of ``path``'s exchange, its logits' dtype as for the gather."""
    lp, head = path.processor, path.head
    head_dtype = getattr(lp, "head_dtype", None)
    return install.GatherSite(
        processor=holder, attr="exchange", weight=getattr(head, "weight", None),
        head_tp=getattr(head, "tp_size", 1),
        where=f"{path.path}'s {releases.EXCHANGE} ({path.where})",
        plain=(not getattr(lp, "logits_as_input", False)
               and (head_dtype is None or isinstance(head_dtype, torch.dtype))),
        facts=f"logits_as_input={getattr(lp, 'logits_as_input', None)}, head_dtype={head_dtype}",
        stock=ALL_TO_ALL_STOCK, dtype=head_dtype)


def _group(ranks):
    """vLLM's own all-to-all's group (its device group), as ``_calling_group`` finds it."""
    return ranks.timing_group


def _calling_group():
    """The group vLLM's own function would run a call on now, looked up as it does, or None."""
    module, name = releases.TP_GROUP
    try:
        return getattr(importlib.import_module(module), name)().device_group
    except Exception:
        return None


def _width(path):
    weight = getattr(path.head, "weight", None)
    return int(weight.shape[0]) if getattr(weight, "dim", lambda: 0)() == 2 else 0


def install_exchanges(paths, ranks):
    """Route each caller in ``paths`` (``find.exchange_paths``): an ``Exchange`` per path. A
    missing vLLM name or processor leaves a path stock before any collective; else one
    ``install.install`` per distinct (shard width, dtype), sorted, for its paths' rows."""
    found, out = [], {}
    missing = releases.lacks(releases.exchange_names(p.path for p in paths))
    for p in paths:
        if missing:
            out[p.path] = Outcome.kept(Reason.ENGINE, f"this vLLM lacks {', '.join(missing)}")
        elif p.processor is None:
            out[p.path] = install.kept(Reason.NO_PROCESSOR, p.where,
                                        f"{p.path}'s {releases.EXCHANGE}")
        else:
            found.append(p)
    keys = {}
    for p in found:  # the one rule for the logits' dtype: GatherSite.logits_dtype
        dtype = _site(p, None).logits_dtype
        keys.setdefault((_width(p), str(dtype).removeprefix("torch.")), []).append(p)
    if keys:
        original = getattr(importlib.import_module(releases.EXCHANGE_HOME), releases.EXCHANGE)
        where = (_group(ranks), cuda_device(ranks.device))
    for key in sorted(keys):
        callers = keys[key]
        holder = _HOLDERS.setdefault(where + key, _Holder(original))
        site = _site(callers[0], holder)
        rows = (None if any(p.rows is None for p in callers)
                else tuple(sorted({m for p in callers for m in p.rows})))
        outcome = install.install(site, ranks, rows, measure=measure_first_use)
        if outcome.served:
            _ROUTES[where + (key[0], holder.head_gather.dtype)] = holder.exchange
            for p in callers:
                _dispatching(releases.EXCHANGE_CALLERS[p.path])
        for i, p in enumerate(callers):
            shared = replace(outcome, shared=True) if i and outcome.served else outcome
            out[p.path] = shared.within(p.rows)
    return tuple(Exchange(p.path, out[p.path], _width(p)) for p in paths)


def routed():
    """The (shard width, dtype) pairs routed in this process (any group), sorted by width."""
    return sorted({k[2:] for k in _ROUTES}, key=lambda k: (k[0], str(k[1])))


def _dispatching(module_name):
    """Replace ``all_to_all_vocab_shards`` in ``module_name`` once by the dispatcher, with the
    module's original as its stock; an unrouted call is the original's, unchanged."""
    module = importlib.import_module(module_name)
    original = getattr(module, releases.EXCHANGE)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def all_to_all_vocab_shards(logits_shard, send_splits, num_local_rows):
        route = (_ROUTES.get((_calling_group(), logits_shard.device, logits_shard.shape[-1],
                              logits_shard.dtype))
                 if logits_shard.dim() == 2 and _ROUTES else None)
        if route is None:
            return original(logits_shard, send_splits, num_local_rows)
        return route(logits_shard, send_splits, num_local_rows, stock=original)

    setattr(all_to_all_vocab_shards, _MARK, True)
    setattr(module, releases.EXCHANGE, all_to_all_vocab_shards)
