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
"""

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch

# modules, not names, where a test replaces a name (mailbox.device_key, its deadline,
# head_gather.HeadGather, provenance.facts): read at the call
from . import all_to_all, dtypes, head_gather, mailbox, provenance, settings
from .collective import all_gather_objects, raised_together, within
from .outcome import Outcome, Stock
from .status import SERVING
from .table import ALL_TO_ALL_STOCK, MAX_ROWS, NCCL_STOCK, TableError, load_table, user_path
from .tablefile import set_aside_agreed

logger = logging.getLogger("lamport_head")


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


def _build(group, device, tp, rank, shard, entries, budget_s, dtype=dtypes.DEFAULT, *,
           stock=NCCL_STOCK):
    """The serving gather of ``entries`` (``{rows: table.TableRow}``, the enabled ones)
    for logits of ``dtype`` (a ``dtypes`` name), in place of the engine's ``stock``
    (``collective``: the all-to-all for ``ALL_TO_ALL_STOCK``): its plan is their
    configs. A give-up
    stops the GPU context (``mode="serving"``: its launch flag, ``build.launch_flag``),
    so no step with missing data reaches the
    engine's sampler or its host. Built on ``build``'s one path: the kernel is the one
    the tuner timed for the row, under the tuner's occupancy limit."""
    plan = {m: e.config for m, e in entries.items()}
    gather = collective(stock)(group, device, tp, rank, shard, plan, budget_s=budget_s,
                               mode=SERVING, clamp=True, dtype=dtypes.torch_dtype(dtype))
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
    reason: object  # (Stock label, text): why this rank cannot serve (a local failure,
    # DISABLE), or None
    force: bool  # LAMPORT_HEAD_FORCE as this rank's environment reads it
    settings: object = None  # _View.settings: what every rank must set alike
    broken: bool = False  # this host's user table is broken (to set aside, then measure)


def install(site, ranks, rows=None, *, measure):
    """Route ``site`` through a HeadGather for the table's enabled rows over ``ranks``
    (an ``outcome.Ranks``: ``group`` where the ranks agree and the mailboxes are
    exchanged, ``device_group`` where first-use tuning times the engine's stock gather);
    an ``outcome.Outcome``: the rows served, or why the engine's stock gather stays
    (``Stock``), the same on every rank. One log line says the same for people; no
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
    say = partial(stock, where=what)
    lp, where = site.processor, site.where
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return Outcome.serving(installed.rows, dtype=gather_dtype(installed))
    if tp <= 1:
        return say(Stock.NO_GATHER, f"tp={tp} has no logits gather to replace")
    why = _site_refuses(site, tp)
    if why is not None:
        return say(Stock.SITE, why)
    shard = site.weight.shape[0]
    vocab = tp * shard  # the full (padded) vocabulary: a table section is measured at one V
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
        kind = (Stock.DISABLED if any(r[0] == Stock.DISABLED.label for _, r in reasons)
                else Stock.RANK)
        if vote.reason and vote.reason[0] == kind.label:
            return say(kind, vote.reason[1])
        first, (_, text) = next((r, v) for r, v in reasons if v[0] == kind.label)
        return say(kind, f"rank {first}: {text}")
    healing = any(v.broken for v in votes)  # some host's user table is broken
    if len({v.settings if healing else v.agreed for v in votes}) > 1:
        return say(Stock.PLANS_DIFFER, "the TP ranks resolved different HEAD_GATHER plans "
                     "(different tables or environments, first-use tuning settings or the "
                     "engine's gather kind included)")
    keys = [v.key for v in votes]
    if healing:
        # Every rank, whichever host's table is broken: the broken copies are set aside
        # (a host whose copy reads whole keeps it), and every rank chooses as if no table
        # held this section, so the hosts measure together and each writes a whole one.
        set_aside_agreed(user_path(), view.broken, keys, rank, group)
        view = replace(view, entries={}, emulated_entries={}, real="missing",
                       emulated="missing")
    shared = None if None in keys else len(set(keys)) < tp  # several ranks on one GPU
    choice, entries = _choose(view, shared)
    measured = False
    if choice == "unknown":
        return say(Stock.NO_DEVICE_KEY, "first-use tuning cannot tell whether the TP ranks "
                     "share a GPU (no device key)")
    if choice == "tune":
        try:  # collective, fail-stop: every rank gets the same outcome or every rank raises
            outcome = measure(ranks.timing_group, device, tp, rank, dcp, shard, view.rows,
                              shared, name, stock=stock_gather, stock_kind=stock_kind,
                              dtype=dtype)
        except Exception as exc:
            _alone(exc, "first-use tuning")
            return say(Stock.TUNING_FAILED,
                         f"first-use tuning failed: {type(exc).__name__}: {exc}")
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
        return _measured(measured, what, Stock.EMULATED,
                         f"the ranks share one GPU, so the {name} section for tp={tp}, "
                         f"dcp={dcp} is emulated: true, never served "
                         f"({settings.SERVE_EMULATED_ENV}=1 serves it, to test this mode only)")
    if choice == "emulated":
        logger.warning("lamport-head: serving an emulated section (processes sharing one GPU: "
                       "not performance) because %s is set", settings.SERVE_EMULATED_ENV)
    if not entries:
        return _measured(measured, what, Stock.NO_ROWS,
                         f"no enabled HEAD_GATHER rows for {name}, tp={tp}, dcp={dcp}, "
                         f"vocab={vocab}, stock={stock_kind}, dtype={dtype}{_others(view)}")
    try:  # collective, fail-stop: every rank gets a gather or every rank raises
        gather = _build(group, device, tp, rank, shard, entries, view.budget_s, dtype,
                        stock=stock_kind)
    except Exception as exc:  # a capability fallback, taken by every rank together
        _alone(exc, "building the gather")
        return _measured(measured, what, Stock.BUILD_FAILED,
                         f"building the {what} failed: {type(exc).__name__}: {exc}")
    served = _route(site, gather)
    logger.info("lamport-head: Lamport %s on %s (tp=%d, dcp=%d, %s logits) for rows "
                "%s, routed at %s; spin budget %g s (%s), agreed by every rank; a give-up stops "
                "the GPU context", what, name, tp, dcp, dtype, served.rows, where, view.budget_s,
                settings.BUDGET_ENV)
    return replace(served, measured=measured)


def _measured(measured, what, reason, message):
    """``stock(reason, message, what)``, saying whether first-use tuning measured first."""
    return replace(stock(reason, message, what), measured=measured)


def _words(stock_kind):
    """What the lines call the collective a route of ``stock_kind`` replaces."""
    return "all-to-all" if stock_kind == ALL_TO_ALL_STOCK else "logits gather"


def stock(reason, message, where=None):
    """``Outcome.stock(reason, message)``, with its one line for people (at the
    reason's level). ``where``: what stays stock, when it is not the logits gather."""
    what = where or "logits gather"
    # a WARNING asks a person to act ("stays stock"); an INFO line states the configuration
    form = ("lamport-head: %s stays stock: %s [%s]" if reason.level >= logging.WARNING
            else "lamport-head: stock %s: %s [%s]")
    logger.log(reason.level, form, what, message, reason.label)
    return Outcome.stock(reason, message)


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


def _site_refuses(site, tp, shard=None, dtype=None):
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
    if shard is not None and weight.shape[0] != shard:
        return f"shard width {weight.shape[0]}, the gather's is {shard}"
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
        return stock(Stock.OWN_GATHER, site.kept, f"logits gather on {label or 'the new model'}")
    why = _site_refuses(site, gather.tp, gather.shard, gather_dtype(gather))
    if why is not None:
        return stock(Stock.SITE, why, f"logits gather on {label or 'the new model'}")
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
        return None, None, _Vote(None, None, (Stock.RANK.label, f"TimeoutError: {exc}"),
                                 settings.forced())


def _local_vote(tp, dcp, device, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """``(device name, _View or None, _Vote)``: everything this rank reads alone before
    the agreement. Never raises: a failure here is the vote's reason, which every
    rank hears (each rank then stays stock together)."""
    force = settings.forced()
    try:
        name = _device_name(device)
    except Exception as exc:
        return None, None, _Vote(None, None, (Stock.RANK.label, f"cannot name the GPU model of "
                                             f"{device}: {type(exc).__name__}: {exc}"), force)
    if name is None:
        return None, None, _Vote(None, None, (Stock.RANK.label, f"{device} is not a CUDA device"),
                                 force)
    view, reason = _local_view(tp, dcp, device, name, rows, vocab, stock, dtype)
    if view is None:  # a reading that failed says so, even with an empty message
        reason = (Stock.RANK.label, reason or "the tables could not be read")
    if settings.disabled():
        # An environment variable may reach some ranks only: it travels with the vote.
        view, reason = None, (Stock.DISABLED.label, f"disabled by {settings.DISABLE_ENV}")
    return name, view, _Vote(view and view.agreed, view and view.key, reason, force,
                             view and view.settings, bool(view and view.broken is not None))


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
        return stock(Stock.OWN_GATHER, why)
    off = [r for r, v in enumerate(votes) if not v.force]
    return stock(Stock.FORCE_PARTIAL, f"{settings.FORCE_ENV}=1 reached TP rank(s) {on} but not "
                 f"{off} (every rank must say the same): {why}")


@dataclass(frozen=True)
class _View:
    """This rank's reading of the tables and settings (no collectives)."""

    entries: dict  # {rows: TableRow}: the enabled entries of the real-rank section
    emulated_entries: dict  # ... and of the emulated section
    real: str  # provenance.section_status of the real-rank section
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

    @property
    def settings(self):
        """What every rank must set alike, whatever its tables hold."""
        return (self.autotune, self.serve_emulated, self.rows, self.budget_s, self.stock,
                self.dtype)

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
    missing (first-use tuning measures this one)."""
    try:
        table = load_table()  # lenient: what it skipped is one line each, the rest serves
        for problem in table.problems:
            if not problem.aside:  # a table set aside has its own line, after the agreement
                logger.warning("lamport-head: HEAD_GATHER table: %s", problem.line)
        on = settings.autotune_enabled()
        if on:  # which environment's version of a key serves (first use measures the rest)
            table.facts = provenance.facts()

        def read(emulated):
            section = table.section(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock,
                                    dtype=dtype)
            entries = table.entries(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock,
                                    dtype=dtype)
            enabled = {m: e for m, e in entries.items()
                       if e.enabled and (rows is None or m in rows)}
            # Only first-use tuning asks whether a section is stale (it costs nvidia-smi).
            state = provenance.section_status(section) if on else ("missing" if section is None
                                                         else "current")
            return enabled, state

        (entries, real), (emulated_entries, emulated) = read(False), read(True)
        key = None
        try:
            key = mailbox.device_key(device)
        except Exception:  # no device key: first-use tuning will not guess
            pass
        others = tuple(v for v in table.vocabs(name, tp, dcp) if v != vocab)
        stocks = tuple(k for k in table.stocks(name, tp, dcp, vocab) if k != stock)
        kinds = tuple(d for d in table.dtypes(name, tp, dcp, vocab, stock) if d != dtype)
        return _View(entries, emulated_entries, real, emulated, on, settings.serve_emulated(),
                     tuple(sorted(set(rows or settings.DEFAULT_ROWS))), key,
                     settings.spin_budget_s(), stock, others, stocks, table.broken, dtype,
                     kinds), None
    except TableError as exc:
        return None, str(exc)
    except Exception as exc:  # told to every rank by the agreement, never raised alone
        return None, f"{type(exc).__name__}: {exc}"


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
    """The plan of ``entries`` (``{rows: TableRow}``), hashable: each row's config."""
    return tuple(sorted((m, e.config) for m, e in entries.items()))  # every knob, by construction
