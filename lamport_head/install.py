"""The engine-neutral install core: route one engine's logits gather (a ``GatherSite``,
found by an adapter in ``lamport_head.engines``) through a HeadGather for the rows the
HEAD_GATHER table enables on this GPU model, (TP, DCP), V and stock.

Invariants a change must keep (docs/design.md, the fail-stop rule):

- Order: the site checks (the same on every rank by construction) need no collective;
  each rank then reads alone what may differ on it (device, tables, environment) into
  its ``_Vote``; every rank meets at one agreement and decides from the same gathered
  votes; only then is the gather built (itself collective). No rank switches to stock
  alone: a failure of this rank alone raises and stops the worker.
- First-use tuning (``measure``) is injected by the adapter: this module never imports
  the tuner. It runs, collectively, only when the agreed view asks for it; what
  follows reads the agreed view, never the environment again.
- First-use tuning of a collective with a switch of its own (``SWITCHED``: the
  all-to-all of vocab shards, ``settings.ALL_TO_ALL_ENV``, on by default, agreed as
  every setting): where it would measure one for whose key no layer holds a section
  and the switch is off, every rank keeps the engine's collective
  (``Reason.SWITCHED_OFF``), nothing measured or built.
- A broken user table costs only itself: when any rank's vote says its host's copy
  cannot be read whole, every rank serves from the other layers (``Table.without_user``,
  read in the same vote), and the broken copies are set aside where they can be.
"""

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch

# modules, not names, where a test replaces a name (mailbox.device_key, its deadline,
# head_gather.HeadGather, provenance.facts): read at the call
from . import all_to_all, dtypes, head_gather, mailbox, provenance, settings
from .mailbox_collective import Setup
from .plan import Plan
from .collective import all_gather_objects, raised_together, within
from .outcome import Outcome, Reason
from .status import SERVING
from .table import (ALL_TO_ALL_STOCK, MAX_ROWS, NCCL_STOCK, TableError, load_table,
                    section_status, set_aside_agreed, user_path)
from .tablefile import healing_line

logger = logging.getLogger("lamport_head")

# The collectives whose first-use tuning a switch of their own can turn off where no
# layer holds a section for the key (``settings.ALL_TO_ALL_ENV=0``): nothing of one is
# then measured or built there; a layer's section serves (a stale one measured again).
SWITCHED = (ALL_TO_ALL_STOCK,)


@dataclass(frozen=True)
class GatherSite:
    """One engine's logits gather, as its adapter found it: all the core reads of the
    engine. Facts only, the same on every rank of the TP group by construction (the
    same model and head everywhere); what may differ per rank (the environment, the
    device) the core reads itself into the rank's vote."""

    processor: object  # holds the gather; gets ``head_gather`` once served
    attr: str  # its attribute x [M, V/TP] -> [M, V], routed as gather(x, stock=the engine's)
    weight: object  # the vocab-parallel lm_head's weight: this rank's [V/TP, hidden] shard
    head_tp: object  # the lm_head's TP size (must be the group's)
    where: str  # where the processor sits, for the log lines
    plain: bool = True  # the engine gathers these logits by the plain TP all-gather (last dim)
    facts: str = ""  # the engine's facts behind ``plain``, for the line when it is not
    kept: object = None  # set when the processor's class has its own gather: why it keeps it
    # unless every rank's LAMPORT_HEAD_FORCE is set (None: no gather of its own)
    stock: str = NCCL_STOCK  # what the engine's gather at ``attr`` is (table.STOCKS): only a
    # section measured against it is served, and first-use tuning times that gather itself
    dtype: object = None  # the dtype of the logits the engine gathers at ``attr`` (the head's
    # output: an FP32 lm_head's is float32 over a BF16 weight); None: the weight's

    @property
    def logits_dtype(self):
        """The logits' dtype at ``attr``: ``dtype``, else the weight's (None: unknown)."""
        return self.dtype if self.dtype is not None else getattr(self.weight, "dtype", None)


def _device_name(device):
    """The GPU model of ``device``; None when it is not a usable CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def collective(stock):
    """The class serving a site whose engine collective is ``stock`` (``table.STOCKS``):
    ``AllToAll`` in place of an all-to-all, ``HeadGather`` in place of an all-gather."""
    return all_to_all.AllToAll if stock == ALL_TO_ALL_STOCK else head_gather.HeadGather


def _build(group, device, tp, rank, shard_width, entries, budget_s, dtype=dtypes.DEFAULT, *,
           stock=NCCL_STOCK):
    """The serving gather of ``entries`` (``{rows: table.TableRow}``, the enabled ones)
    for logits of ``dtype`` (a ``dtypes`` name), in place of the engine's ``stock``
    (``collective``: the all-to-all for ``ALL_TO_ALL_STOCK``): its plan is their
    configs. A give-up
    stops the GPU context (``mode="serving"``: its launch flag, ``build.launch_flag``),
    so no step with missing data reaches the
    engine's sampler or its host. Built on ``build``'s one path: the kernel is the one
    the tuner timed for the row, under the tuner's occupancy limit."""
    gather = collective(stock)(group, device, tp, rank, shard_width, Plan.of(entries),
                               mode=SERVING,
                               dtype=dtypes.torch_dtype(dtype),
                               setup=Setup(budget_s=budget_s, clamp=True))
    for m, (asked, most) in sorted(gather.clamped.items()):
        logger.warning("lamport-head: the table's %d CTAs for %d rows cannot all be co-resident "
                       "with this version's kernel on this device: served with %d (re-tune with "
                       "`lamport-head tune`)", asked, m, most)
    return gather


class _Vote(NamedTuple):
    """What one rank brings to the agreement (collective 1): every fact it read
    alone, so that no rank decides on one before its peers have heard it."""

    agreed: object  # _View.agreed, or None with ``reason``
    key: object  # _View.key: equal keys mean ranks sharing one GPU
    reason: object  # (Reason label, text): why this rank cannot serve (a local failure,
    # DISABLE), or None
    force: bool  # LAMPORT_HEAD_FORCE as this rank's environment reads it
    settings: object = None  # _View.settings: what every rank must set alike
    broken: bool = False  # this host's user table is broken (every rank serves without it)
    fallback: object = None  # _View.agreed of the layers but the user table (_View.fallback)


def install(site, ranks, rows=None, *, measure):
    """Route ``site`` through a HeadGather for the table's enabled rows over ``ranks``
    (an ``outcome.Ranks``: ``group`` where the ranks agree and the mailboxes are
    exchanged, ``device_group`` where first-use tuning times the engine's stock gather);
    an ``outcome.Outcome``: the rows served, or why the engine's stock gather stays
    (``Reason``), the same on every rank. One log line says the same for people; no
    caller reads it.
    ``rows``: the row counts the server's decode steps gather; served rows are
    limited to them, so the mailbox's cap follows, and first-use tuning measures
    among them. None: the table's rows, and ``settings.DEFAULT_ROWS`` for first-use
    tuning. ``measure``: first-use tuning's measuring, called (collectively) only
    when the agreed view asks for it, as ``measure(group, device, tp, rank, dcp, shard,
    rows, shared, name)`` returning an outcome with ``entries`` (the enabled
    ``{rows: TableRow}``), ``results``, ``emulated``, ``seconds``, ``path``.

    Raises only for a failure of this rank alone, after which it must not go on
    (``_alone``: the worker stops, and the engine with it), and never leaves a peer in
    a collective otherwise: it returns before the first collective only on facts every
    rank shares by construction (the site, an earlier install, itself agreed, tp). Whatever a rank reads or fails at alone (its
    device, its tables, its environment: DISABLE, FORCE, first-use tuning settings)
    travels in its ``_Vote``; every rank reaches the agreement and all take the
    decision from the same gathered votes."""
    group, tp, rank, device, dcp = ranks.group, ranks.tp, ranks.rank, ranks.device, ranks.dcp
    what = _words(site.stock)  # the lines' name of the collective the route replaces
    say = partial(kept, where=what)
    lp, where = site.processor, site.where
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return Outcome.serving(installed.rows, dtype=gather_dtype(installed))
    if tp <= 1:
        return say(Reason.NO_GATHER, f"tp={tp} has no logits gather to replace")
    why = _site_refuses(site, tp)
    if why is not None:
        return say(Reason.SITE, why)
    shard_width = site.weight.shape[0]
    vocab = tp * shard_width  # the full (padded) vocabulary: a table section is measured at one V
    dtype = dtypes.name(site.logits_dtype)  # ... for one logits dtype (the site's: agreed)
    # the gather the route replaces: what a section must have been measured against, and
    # what first-use tuning times (the engine's own callable, before routing)
    stock_kind, stock_gather = site.stock, getattr(lp, site.attr)
    name, view, vote = _bounded_vote(tp, dcp, device, rows, vocab, stock_kind, dtype)
    # Collective 1: agree on the entries and on whether to measure first. Every rank gets
    # here, whatever it read or failed at: a rank deciding alone would be missing from
    # the mailbox's (or the sweep's) collectives its peers enter next.
    votes = [_Vote(*v) for v in all_gather_objects(tuple(vote), group)]
    if site.kept is not None:
        refused = _agree_force(votes, site.kept)
        if refused is not None:
            return refused
    reasons = [(r, v.reason) for r, v in enumerate(votes) if v.reason]
    if reasons:
        kind = (Reason.DISABLED if any(r[0] == Reason.DISABLED.label for _, r in reasons)
                else Reason.RANK)
        if vote.reason and vote.reason[0] == kind.label:
            return say(kind, vote.reason[1])
        first, (_, text) = next((r, v) for r, v in reasons if v[0] == kind.label)
        return say(kind, f"rank {first}: {text}")
    healing = any(v.broken for v in votes)  # some host's user table is broken
    if len({v.fallback if healing else v.agreed for v in votes}) > 1:
        return say(Reason.PLANS_DIFFER, "the TP ranks resolved different HEAD_GATHER plans "
                     "(different tables or environments, first-use tuning settings or the "
                     "engine's gather kind included)")
    keys = [v.key for v in votes]
    shared = None if None in keys else len(set(keys)) < tp  # several ranks on one GPU
    why = view.broken  # this rank's reading of its host's user table, when broken
    if healing:
        # Every rank, whichever host's table is broken, reads the other layers only (the
        # same on every rank: agreed above), so they keep serving; what they do not hold,
        # first-use tuning measures (when on), and each host then writes a whole table.
        view = view.fallback
    choice, entries = _choose(view, shared)
    off = _switched_off(view, choice, name, tp, dcp, vocab)
    if off:
        choice = "switched-off"
    unwritable = False  # this host's broken copy could not be set aside: the cache is not
    if healing:  # writable, which the one line of this start says
        # collective: the broken copies are set aside (a host whose copy reads whole keeps
        # it); what follows does not depend on the outcome, but the line says it
        kind, detail = set_aside_agreed(user_path(), keys, rank, group)
        unwritable = kind == "kept"
        line = healing_line(user_path(), why, kind, detail,
                            _next(view, choice, entries, what, unwritable))
        if line is not None:
            logger.warning(line)
    if off:
        return say(Reason.SWITCHED_OFF, off)
    measured = False
    if choice == "unknown":
        return say(Reason.NO_DEVICE_KEY, "first-use tuning cannot tell whether the TP ranks "
                     "share a GPU (no device key)")
    if choice == "tune":
        try:  # collective, fail-stop: every rank gets the same outcome or every rank raises
            outcome = measure(ranks.timing_group, device, tp, rank, dcp, shard_width, view.rows,
                              shared, name, stock=stock_gather, stock_kind=stock_kind,
                              dtype=dtype)
        except Exception as exc:
            _alone(exc, "first-use tuning")
            return say(Reason.TUNING_FAILED,
                         f"first-use tuning failed: {type(exc).__name__}: {exc}")
        if getattr(outcome, "unsaved", None) is not None and not unwritable:
            # A cache that cannot be written costs the table, not this start: the rows
            # were measured and agreed, so every rank serves them. (Where the broken
            # table's line said the cache is not writable, this would be a second warning.)
            logger.warning("lamport-head: first-use tuning measured rows %s and serves them on "
                           "this start, but could not save the user table %s (%s): the next "
                           "start measures again", [r.rows for r in outcome.results],
                           outcome.path, outcome.unsaved)
        logger.info("lamport-head: first-use tuning on %s (tp=%d, dcp=%d, %s): measured rows "
                    "%s in %.1f s, wrote %s%s; vocab=%d, %s%s", name, tp, dcp, view.real,
                    [r.rows for r in outcome.results], outcome.seconds,
                    outcome.path if getattr(outcome, "unsaved", None) is None
                    else f"nothing (could not save {outcome.path})",
                    " (emulated: true)" if outcome.emulated else "", vocab, dtype, _others(view))
        entries, measured = outcome.entries, True
        if outcome.emulated:
            # The agreed view's setting, never a fresh read of the environment: it may
            # have changed on one rank while the ranks measured.
            choice = "emulated" if view.serve_emulated else "unserved"
    if choice == "unserved":
        return _measured(measured, what, Reason.EMULATED,
                         f"the ranks share one GPU, so the {name} section for tp={tp}, "
                         f"dcp={dcp} is emulated: true, never served "
                         f"({settings.SERVE_EMULATED_ENV}=1 serves it, to test this mode only)")
    if choice == "emulated":
        logger.warning("lamport-head: serving an emulated section (processes sharing one GPU: "
                       "not performance) because %s is set", settings.SERVE_EMULATED_ENV)
    if not entries:
        return _measured(measured, what, Reason.NO_ROWS,
                         f"no enabled HEAD_GATHER rows for {name}, tp={tp}, dcp={dcp}, "
                         f"vocab={vocab}, stock={stock_kind}, dtype={dtype}{_others(view)}")
    try:  # collective, fail-stop: every rank gets a gather or every rank raises
        gather = _build(group, device, tp, rank, shard_width, entries, view.budget_s, dtype,
                        stock=stock_kind)
    except Exception as exc:  # a capability fallback, taken by every rank together
        _alone(exc, "building the gather")
        return _measured(measured, what, Reason.BUILD_FAILED,
                         f"building the {what} failed: {type(exc).__name__}: {exc}")
    served = _route(site, gather)
    logger.info("lamport-head: Lamport %s on %s (tp=%d, dcp=%d, %s logits) for rows "
                "%s, routed at %s; spin budget %g s (%s), agreed by every rank; a give-up stops "
                "the GPU context", what, name, tp, dcp, dtype, served.rows, where, view.budget_s,
                settings.BUDGET_ENV)
    return replace(served, measured=measured)


def _measured(measured, what, reason, message):
    """``kept(reason, message, what)``, saying whether first-use tuning measured first."""
    return replace(kept(reason, message, what), measured=measured)


def _words(stock_kind):
    """What the lines call the collective a route of ``stock_kind`` replaces."""
    return "all-to-all" if stock_kind == ALL_TO_ALL_STOCK else "logits gather"


def kept(reason, message, where=None):
    """``Outcome.kept(reason, message)``, with its one line for people (at the
    reason's level). ``where``: what stays stock, when it is not the logits gather."""
    what = where or "logits gather"
    # a WARNING asks a person to act ("stays stock"); an INFO line states the configuration
    form = ("lamport-head: %s stays stock: %s [%s]" if reason.level >= logging.WARNING
            else "lamport-head: stock %s: %s [%s]")
    logger.log(reason.level, form, what, message, reason.label)
    return Outcome.kept(reason, message)


def _alone(exc, what):
    """Re-raise ``exc`` unless every rank raised it at the same step
    (``collective.raised_together``): a failure of this rank alone left its peers in
    a collective it will never join (the engine's gather timed as stock; a step after
    the last agreement), so stock on this rank alone would diverge from them. Raising
    stops the worker, and the engine stops every rank (fail-stop)."""
    if not raised_together(exc):
        logger.error("lamport-head: %s failed on this rank alone (%s: %s): its peers may be "
                     "inside a collective it cannot join; stopping this worker (fail-stop)",
                     what, type(exc).__name__, exc)
        raise exc


def _site_refuses(site, tp, shard_width=None, dtype=None):
    """Why ``site`` cannot take a gather over ``tp`` ranks (of ``shard`` columns and
    logits of ``dtype``, a ``dtypes`` name, when given), or None. Facts of the site
    only, the same on every rank by construction: no collective needed to act on the
    answer. Its weight (the model's dtype: a quantized head is refused) and its logits
    must be of dtypes a gather serves (``dtypes.NAMES``: BF16, or FP32 from an FP32
    lm_head), its shard width whole 16-byte fragments of the logits' dtype."""
    weight, logits = site.weight, site.logits_dtype
    if (weight is None or weight.dim() != 2 or not dtypes.served(weight.dtype)
            or not dtypes.served(logits) or site.head_tp != tp or not site.plain):
        return (f"{site.where} is not a vocab-parallel head of "
                f"{' or '.join(dtypes.NAMES)} weight and logits "
                f"gathered by all-gather over tp={tp} (lm_head weight "
                f"{None if weight is None else f'{tuple(weight.shape)} {weight.dtype}'}, "
                f"logits {logits}, "
                f"tp_size {site.head_tp}{f'; {site.facts}' if site.facts else ''})")
    fragment = dtypes.fragment(logits)
    if weight.shape[0] % fragment:
        return (f"shard width {weight.shape[0]} is not a multiple of {fragment} "
                f"({dtypes.name(logits)}: one 16-byte fragment)")
    if shard_width is not None and weight.shape[0] != shard_width:
        return f"shard width {weight.shape[0]}, the gather's is {shard_width}"
    if dtype is not None and dtypes.name(logits) != dtypes.name(dtype):
        return f"{dtypes.name(logits)} logits, the gather's are {dtypes.name(dtype)}"
    return None


def gather_dtype(gather):
    """The dtype name a built gather serves (``HeadGather.dtype``)."""
    return dtypes.name(getattr(gather, "dtype", dtypes.DEFAULT))


def _route(site, gather, shared=False):
    """Route ``site``'s gather attribute through ``gather`` (an instance attribute: other
    processors keep theirs); the serving ``Outcome``."""
    engine = getattr(site.processor, site.attr)
    site.processor.head_gather = gather
    setattr(site.processor, site.attr, partial(gather, stock=engine))
    return Outcome.serving(gather.rows, shared=shared, dtype=gather_dtype(gather))


def reroute(site, gather, *, label=None):
    """Route a new processor (the engine replaced its model, e.g. after a weight update)
    through the ``gather`` its first model was served by: an ``Outcome`` (``shared``
    when ``label`` names another site), with one line either way. ``label``: what the
    site is, for the lines, when it is not a replacement model (a vLLM drafter whose
    head has the target's shard width shares the target's gather: no second mailbox).

    No collective: ``gather`` (its mailboxes, rows, ranks) was agreed and built by
    every rank at install and depends on no model; ``site``'s facts are the same on
    every rank by construction (the same new model everywhere), so every rank takes the
    same branch alone. The site checks are install's; a processor whose class has its
    own gather (``site.kept``) keeps it (LAMPORT_HEAD_FORCE was agreed for another
    processor). Never raises."""
    installed = getattr(site.processor, "head_gather", None)
    if installed is gather:  # the same processor (weights updated in place): still routed
        return Outcome.serving(gather.rows, shared=label is not None,
                               dtype=gather_dtype(gather))
    if site.kept is not None:
        return kept(Reason.OWN_GATHER, site.kept, f"logits gather on {label or 'the new model'}")
    why = _site_refuses(site, gather.tp, gather.shard_width, gather_dtype(gather))
    if why is not None:
        return kept(Reason.SITE, why, f"logits gather on {label or 'the new model'}")
    served = _route(site, gather, shared=label is not None)
    if label is None:
        logger.info("lamport-head: the new model's gather routed again at %s: the gather built "
                    "at install serves rows %s", site.where, served.rows)
    else:
        logger.info("lamport-head: %s routed at %s through the gather already built (the same "
                    "shard width: no second mailbox, no collective); it serves rows %s", label,
                    site.where, served.rows)
    return served


def decode_rows(requests, per_request):
    """The row counts an engine's decode steps gather: 1 .. ``requests`` x ``per_request``
    (logits rows per request: 1 + its draft tokens), capped at ``table.MAX_ROWS``.
    ``requests`` None (the engine resolves it later, from memory): up to the cap."""
    top = MAX_ROWS if requests is None else min(int(requests) * int(per_request), MAX_ROWS)
    return tuple(range(1, top + 1))


def _others(view):
    """For the log: what the tables hold real-rank sections for instead (other
    vocabularies; this vocabulary measured against another stock or for another
    dtype)."""
    if view is None:
        return ""
    said = []
    if view.dtypes:
        said.append(f"this vocab and stock measured for {', '.join(view.dtypes)} logits")
    if view.stocks:
        said.append(f"this vocab measured against {', '.join(view.stocks)}")
    if view.vocabs:
        said.append(f"vocab {', '.join(map(str, view.vocabs))}")
    return f" (the tables hold sections for {'; '.join(said)} only)" if said else ""


def _bounded_vote(tp, dcp, device, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """``_local_vote`` under the start-up deadline (``mailbox.RENDEZVOUS_WAIT_S``): a
    rank whose reading blocks (a table on a hung file system, a device query) still
    reaches the agreement in time, its vote's reason saying so, and every rank stays
    stock; the reading left behind touches nothing its peers see."""
    try:
        return within(mailbox.RENDEZVOUS_WAIT_S, "reading the tables and settings (install's vote)",
                      _local_vote, tp, dcp, device, rows, vocab, stock, dtype)
    except TimeoutError as exc:
        return None, None, _Vote(None, None, (Reason.RANK.label, f"TimeoutError: {exc}"),
                                 settings.forced())


def _local_vote(tp, dcp, device, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """``(device name, _View or None, _Vote)``: everything this rank reads alone before
    the agreement. Never raises: a failure here is the vote's reason, which every
    rank hears (each rank then stays stock together)."""
    force = settings.forced()
    try:
        name = _device_name(device)
    except Exception as exc:
        return None, None, _Vote(None, None, (Reason.RANK.label, f"cannot name the GPU model of "
                                             f"{device}: {type(exc).__name__}: {exc}"), force)
    if name is None:
        return None, None, _Vote(None, None, (Reason.RANK.label, f"{device} is not a CUDA device"),
                                 force)
    view, reason = _local_view(tp, dcp, device, name, rows, vocab, stock, dtype)
    if view is None:  # a reading that failed says so, even with an empty message
        reason = (Reason.RANK.label, reason or "the tables could not be read")
    if settings.disabled():
        # An environment variable may reach some ranks only: it travels with the vote.
        view, reason = None, (Reason.DISABLED.label, f"disabled by {settings.DISABLE_ENV}")
    return name, view, _Vote(view and view.agreed, view and view.key, reason, force,
                             view and view.settings, bool(view and view.broken is not None),
                             view and view.fallback.agreed)


def _agree_force(votes, why):
    """For a processor whose class has its own gather (``why``: the site's text saying
    it keeps it): None when every rank's LAMPORT_HEAD_FORCE is set (route it), else the
    stock ``Outcome``. Not set anywhere: the processor keeps its gather. Set on some
    ranks only: every rank keeps it, the line naming them, as a LAMPORT_HEAD_DISABLE
    that reached some ranks only takes every rank to stock.
    The same answer on every rank: ``votes`` are the gathered ones."""
    on = [r for r, v in enumerate(votes) if v.force]
    if len(on) == len(votes):
        return None
    if not on:
        return kept(Reason.OWN_GATHER, why)
    off = [r for r, v in enumerate(votes) if not v.force]
    return kept(Reason.FORCE_PARTIAL, f"{settings.FORCE_ENV}=1 reached TP rank(s) {on} but not "
                 f"{off} (every rank must say the same): {why}")


@dataclass(frozen=True)
class _View:
    """This rank's reading of the tables and settings (no collectives)."""

    entries: dict  # {rows: TableRow}: the enabled entries of the real-rank section
    emulated_entries: dict  # ... and of the emulated section
    real: str  # table.section_status of the real-rank section
    emulated: str  # ... and of the emulated one
    autotune: bool
    serve_emulated: bool
    rows: tuple  # the rows first-use tuning measures among
    key: object  # mailbox.device_key: equal keys mean ranks sharing one GPU
    budget_s: float  # the serving gather's spin budget (settings.spin_budget_s)
    stock: str  # the engine gather the route replaces (GatherSite.stock): what first-use
    # tuning times, so every rank must name the same one
    vocabs: tuple = ()  # the vocabularies of real-rank sections for another V (for the log)
    stocks: tuple = ()  # the stocks of real-rank sections at this V against another stock (log)
    broken: object = None  # why this host's user table cannot be read whole (set aside), or None
    dtype: str = dtypes.DEFAULT  # the logits' dtype (the site's): sections of it only count
    dtypes: tuple = ()  # the dtypes of real-rank sections at this V and stock for another (log)
    switch: object = None  # a SWITCHED stock's switch (settings.ALL_TO_ALL_ENV); None: others
    fallback: object = None  # the same reading of every layer but the user table (a _View):
    # what every rank serves from when some host's user table is broken

    @property
    def settings(self):
        """What every rank must set alike, whatever its tables hold."""
        return (self.autotune, self.serve_emulated, self.rows, self.budget_s, self.stock,
                self.dtype, self.switch)

    @property
    def agreed(self):
        """What every rank must see alike when every host's user table reads whole."""
        return (_digest(self.entries), _digest(self.emulated_entries), self.real,
                self.emulated) + self.settings


def _local_view(tp, dcp, device, name, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """(_View, None) or (None, why): this rank's reading of the tables, no collectives.
    Only sections measured at ``vocab`` (the model's V = TP x shard width) against
    ``stock`` (the engine's gather the route replaces) for ``dtype`` logits count: one
    measured at another V, against another stock or for another dtype reads as
    missing (first-use tuning measures this one). Its ``fallback`` reads the same from
    every layer but the user table (``Table.without_user``, from the same reading)."""
    try:
        table = load_table()  # lenient: what it skipped is one line each, the rest serves
        for problem in table.problems:
            if not problem.aside:  # a table set aside has its own line, after the agreement
                logger.warning("lamport-head: HEAD_GATHER table: %s", problem.line)
        others = table.without_user if table.without_user is not None else table
        on = settings.autotune_enabled()
        if on:  # which environment's version of a key serves (first use measures the rest)
            table.facts = others.facts = provenance.facts()
        key = None
        try:
            key = mailbox.device_key(device)
        except Exception:  # no device key: first-use tuning will not guess
            pass
        switch = settings.all_to_all_enabled() if stock in SWITCHED else None
        same = dict(autotune=on, serve_emulated=settings.serve_emulated(),
                    rows=tuple(sorted(set(rows or settings.DEFAULT_ROWS))), key=key,
                    budget_s=settings.spin_budget_s(), stock=stock, dtype=dtype, switch=switch)
        fallback = _reading(others, name, tp, dcp, rows, vocab, same)
        view = replace(_reading(table, name, tp, dcp, rows, vocab, same), broken=table.broken,
                       fallback=fallback)
        return view, None
    except TableError as exc:
        return None, str(exc)
    except Exception as exc:  # told to every rank by the agreement, never raised alone
        return None, f"{type(exc).__name__}: {exc}"


def _reading(table, name, tp, dcp, rows, vocab, same):
    """The ``_View`` of ``table`` (a merged view) for this key; ``same``: the fields that
    do not depend on the tables (settings, device key)."""
    stock, dtype, on = same["stock"], same["dtype"], same["autotune"]

    def read(emulated):
        section = table.section(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock,
                                dtype=dtype)
        entries = table.entries(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock,
                                dtype=dtype)
        enabled = {m: e for m, e in entries.items()
                   if e.enabled and (rows is None or m in rows)}
        # Only first-use tuning asks whether a section is stale (it costs nvidia-smi).
        state = section_status(section) if on else ("missing" if section is None
                                                    else "current")
        return enabled, state

    (entries, real), (emulated_entries, emulated) = read(False), read(True)
    vocabs = tuple(v for v in table.vocabs(name, tp, dcp) if v != vocab)
    stocks = tuple(k for k in table.stocks(name, tp, dcp, vocab) if k != stock)
    kinds = tuple(d for d in table.dtypes(name, tp, dcp, vocab, stock) if d != dtype)
    return _View(entries, emulated_entries, real, emulated, vocabs=vocabs, stocks=stocks,
                 dtypes=kinds, **same)


def _switched_off(view, choice, name, tp, dcp, vocab):
    """Why first-use tuning leaves this collective off, or None: ``choice`` (``_choose``'s)
    would measure, the stock is ``SWITCHED``, its switch is off and no layer holds a
    section for its key. From the agreed view: the same on every rank."""
    if (choice not in ("tune", "unknown") or view.stock not in SWITCHED or view.switch
            or view.real != "missing" or view.emulated != "missing"):
        return None
    return (f"first-use tuning of the all-to-all is switched off ({settings.ALL_TO_ALL_ENV}=0) "
            f"and no table holds a section for {name}, tp={tp}, dcp={dcp}, vocab={vocab}, "
            f"stock={view.stock}, dtype={view.dtype}; to turn it on, unset "
            f"{settings.ALL_TO_ALL_ENV} on every rank (first-use tuning then measures it) or "
            "tune it into a table (`lamport-head tune --all-to-all` under torchrun)")


def _next(view, choice, entries, what, unwritable):
    """What happens next for ``what`` on this start, said by a broken user table's line:
    from the agreed choice on the other layers (``_choose``'s, or "switched-off") and whether
    the cache could take a fresh table."""
    if choice == "switched-off":
        return (f"the {what} stays stock ({settings.ALL_TO_ALL_ENV}=0: unsetting it or a "
                "table section turns it on)")
    if choice == "tune":
        if unwritable:
            return (f"first-use tuning measures the {what} and serves it on this start, but "
                    "cannot save it while the cache is not writable: every start measures "
                    "again")
        return f"first-use tuning measures the {what} again and writes a fresh table"
    if choice == "unknown":
        return (f"the {what} stays stock (first-use tuning cannot tell whether the ranks share "
                "a GPU)")
    if entries:
        return f"the other layers serve the {what} (their section for this key)"
    if view.real == "missing" and not view.autotune:
        return (f"no other layer holds a section for the {what} and first-use tuning is off "
                f"({settings.AUTOTUNE_ENV}=0): it stays stock until `lamport-head tune` "
                "writes a table")
    return f"the other layers hold no enabled row for the {what} here: it stays stock"


def _choose(view, shared):
    """('table', entries), ('tune', {}), ('emulated', entries), ('unserved', {}) or
    ('unknown', {}), ``entries`` the enabled ``{rows: TableRow}`` to serve; the same on
    every rank (its inputs are agreed)."""
    if view.real != "missing" and (shared or not view.autotune or view.real == "current"):
        return "table", view.entries  # processes sharing a GPU cannot re-measure real ranks
    if view.autotune and (not shared or view.emulated != "current"):
        return ("unknown", {}) if shared is None else ("tune", {})
    if shared and view.emulated != "missing":
        return ("emulated", view.emulated_entries) if view.serve_emulated else ("unserved", {})
    return "table", {}


def _digest(entries):
    """The plan of ``entries`` (``{rows: TableRow}``): what the ranks compare."""
    return Plan.of(entries)
