"""vLLM 0.34's all-to-all of vocab shards on the Lamport mailbox: batch-sharded sampling's
``all_to_all_vocab_shards(logits_shard, send_splits, num_local_rows)`` (``[M, V/TP]``
vocab-local logits, rows ``offsets[r]:offsets[r + 1]`` to rank r -> ``[num_local_rows,
V]``), called by ``GPUModelRunner.sample`` and by DSpark's sharded sequential sampling
(``find.exchange_paths``), served by ``lamport_head.all_to_all.AllToAll``.

Routing: each caller's module global. Both callers import the function by name, so
the name each calls is its own module's global (``release.EXCHANGE_CALLERS``); each is
replaced, once and only where an AllToAll serves, by a dispatcher marked
``_lamport_head_wrapped`` (the candidate gathers' house style) that keeps vLLM's
signature: a call whose (shard width, dtype) an AllToAll serves goes through it (its
rows outside the plan take the module's original, as its ``stock``); every other call
is the original's, unchanged. This reaches least into vLLM of the ways to reach these
calls: replacing the function where vLLM defines it (``batch_shard``) changes nothing
the callers call (they bound their own names at import); wrapping
``GPUModelRunner.sample`` or ``DSparkSpeculator._sample_sequential_sharded`` would make
us keep copies of vLLM's owner sorting and sampling in step; wrapping the TP group's
PyNCCL ``all_to_all_single`` would put every all-to-all of that communicator (MoE's
too) through us, with the splits re-derived from its arguments.

Invariants: the dispatcher decides by the call's TP group (the one vLLM's own
function runs on: its TP group's device group, looked up as vLLM looks it up), device,
shard width and dtype only, and the AllToAll by M (``sum(send_splits)``, vLLM's
replicated plan), so every rank takes the same path. One AllToAll per distinct (group,
device, shard width, dtype) of the paths a step takes, for the union of their row
counts, installed in the same order on every rank (sorted keys) through
``install.install`` (agreed, fail-stop: every rank serves or every rank keeps vLLM's
all-to-all); an engine on another group or device never reaches another's AllToAll or
its peers. Whether to install is decided before any collective from facts every rank
shares (the config, the models' classes, the release's names). Only a table section
measured against the all-to-all (``stock: nccl-all-to-all``) serves; first-use tuning
measures one where none (the tuner's ``AllToAllTarget``, timed against vLLM's own
``all_to_all_vocab_shards``) unless its switch is off (``install.SWITCHED``).
"""

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
# This process's served all-to-alls, {(group, device, shard width, torch dtype): the routed
# exchange}: what the dispatchers consult. The group (``_group``: the ProcessGroup object,
# hashed by identity, kept alive here) and the device keep engines of one process apart.
_ROUTES = {}
# The install core's processor of each (group, device, shard width, dtype name), kept: a
# later load's install of a key finds its AllToAll there and keeps it (install's "an
# earlier call installed one"), with no collective and no second mailbox, as every rank
# did the same; another group or device gets its own
_HOLDERS = {}


class Exchange(NamedTuple):
    """What the all-to-all install did for one caller, for the summary line (the same on
    every rank)."""

    path: str  # the caller (a key of release.EXCHANGE_CALLERS)
    outcome: Outcome  # served rows (.shared: by an AllToAll an earlier path installed) or why
    # vLLM's all-to-all stays
    width: int  # the shard width it exchanges (0: no head found)


class _Holder:
    """The install core's processor for one (shard width, dtype): ``exchange`` is vLLM's
    ``all_to_all_vocab_shards`` (the stock the route keeps), routed by install to the
    AllToAll (``head_gather``) once served."""

    def __init__(self, original):
        self.exchange = original


def _site(path, holder):
    """The install core's view of ``path``'s exchange (``find.ExchangePath``): the
    logits' dtype is its processor's ``head_dtype`` (vLLM's ``ModelConfig.head_dtype``),
    else its head's weight's, as for the gather."""
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
    """The identity of the TP group an install over ``ranks`` serves: the group vLLM's own
    all-to-all runs on (its device group, ``Ranks.timing_group``), which the dispatcher
    finds again at a call (``_calling_group``)."""
    return ranks.timing_group


def _calling_group():
    """The group vLLM's own ``all_to_all_vocab_shards`` would run a call on now (its TP
    group's device group, looked up as vLLM's function looks it up), or None when vLLM
    has none (vLLM's own then raises its own error)."""
    module, name = releases.TP_GROUP
    try:
        return getattr(importlib.import_module(module), name)().device_group
    except Exception:
        return None


def _width(path):
    weight = getattr(path.head, "weight", None)
    return int(weight.shape[0]) if getattr(weight, "dim", lambda: 0)() == 2 else 0


def install_exchanges(paths, ranks):
    """Route the all-to-all of vocab shards of each caller in ``paths``
    (``find.exchange_paths``, the same list on every rank) through Lamport all-to-alls
    over ``ranks`` (an ``outcome.Ranks``): one ``Exchange`` per path, in its order.

    - The running vLLM lacks a name this relies on (0.33: no ``all_to_all_vocab_shards``)
      or no processor was found: that path stays stock, before any collective.
    - Else one ``install.install`` per distinct (shard width, dtype), sorted, for the
      union of its paths' rows (a key an earlier load installed on this group and
      device keeps its AllToAll: ``_HOLDERS``); a served one is registered for the
      dispatchers (by group, device, width and dtype) and each
      of its callers' module globals is replaced, once (``_dispatching``). A path served
      by an AllToAll an earlier path installed is ``shared``; each path's rows are its
      own (``Outcome.within``).
    Raises only as ``install.install`` does (a failure of this rank alone)."""
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
    for p in found:  # the site's logits dtype: the one rule, GatherSite.logits_dtype
        dtype = _site(p, None).logits_dtype
        keys.setdefault((_width(p), str(dtype).removeprefix("torch.")), []).append(p)
    if keys:
        original = getattr(importlib.import_module(releases.EXCHANGE_HOME), releases.EXCHANGE)
        where = (_group(ranks), cuda_device(ranks.device))  # this engine's, apart from others'
    for key in sorted(keys):
        callers = keys[key]
        holder = _HOLDERS.setdefault(where + key, _Holder(original))
        site = _site(callers[0], holder)
        rows = (None if any(p.rows is None for p in callers)
                else tuple(sorted({m for p in callers for m in p.rows})))
        outcome = install.install(site, ranks, rows, measure=measure_first_use)
        if outcome.served:
            # install built it for the site's shard width (key[0]) and logits dtype
            _ROUTES[where + (key[0], holder.head_gather.dtype)] = holder.exchange
            for p in callers:
                _dispatching(releases.EXCHANGE_CALLERS[p.path])
        for i, p in enumerate(callers):
            shared = replace(outcome, shared=True) if i and outcome.served else outcome
            out[p.path] = shared.within(p.rows)
    return tuple(Exchange(p.path, out[p.path], _width(p)) for p in paths)


def routed():
    """The (shard width, dtype) pairs this process's dispatchers route (on some group and
    device), sorted by width."""
    return sorted({k[2:] for k in _ROUTES}, key=lambda k: (k[0], str(k[1])))


def _dispatching(module_name):
    """Replace ``all_to_all_vocab_shards`` in the caller's module ``module_name``, once,
    by a dispatcher: a 2-D call whose (group, device, shard width, dtype) is routed (the
    group vLLM's own would run it on: ``_calling_group``) goes through that AllToAll,
    with this module's original as its stock; every other call is the original's,
    unchanged."""
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
