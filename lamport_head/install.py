"""The engine-neutral install core: route an engine's logits gather (a ``GatherSite``) through
a gather for the rows the HEAD_GATHER table enables for its key. Order and fail-stop:
docs/design.md, "Install order" and "Together or alone". First-use tuning's ``measure`` is
injected by the adapter: this module never imports the tuner.
"""

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch

# modules, not names, where a test replaces a name: read at the call
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

# collectives whose first-use tuning has a switch of its own (``settings.ALL_TO_ALL_ENV``)
SWITCHED = (ALL_TO_ALL_STOCK,)


@dataclass(frozen=True)
class GatherSite:
    """One engine's logits gather, as its adapter found it: facts only, the same on every
    rank by construction (what may differ per rank goes into the rank's vote)."""

    processor: object  # holds the gather; gets ``head_gather`` once served
    attr: str  # its attribute x [M, V/TP] -> [M, V], routed as gather(x, stock=the engine's)
    weight: object  # the vocab-parallel lm_head's weight: this rank's [V/TP, hidden] shard
    head_tp: object  # the lm_head's TP size (must be the group's)
    where: str
    plain: bool = True  # the engine gathers these logits by the plain TP all-gather (last dim)
    facts: str = ""  # the engine's facts behind ``plain``, for the line when it is not
    kept: object = None  # why its class's own gather stays unless every rank sets FORCE
    stock: str = NCCL_STOCK  # table.STOCKS: only a section measured against it serves
    dtype: object = None  # the logits' dtype (an FP32 lm_head's over BF16); None: the weight's

    @property
    def logits_dtype(self):
        return self.dtype if self.dtype is not None else getattr(self.weight, "dtype", None)


def _device_name(device):
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def collective(stock):
    return all_to_all.AllToAll if stock == ALL_TO_ALL_STOCK else head_gather.HeadGather


def _build(group, device, tp, rank, shard_width, entries, budget_s, dtype=dtypes.DEFAULT, *,
           stock=NCCL_STOCK):
    """The serving gather of the enabled ``entries`` in place of ``stock``: a give-up stops
    the GPU context, so no step with missing data reaches the engine's sampler."""
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
    """Every fact one rank read alone, brought to the agreement."""

    agreed: object  # _View.agreed, or None with ``reason``
    key: object
    reason: object  # (Reason label, text): why this rank cannot serve, or None
    force: bool
    settings: object = None
    broken: bool = False  # this host's user table is broken
    fallback: object = None


def install(site, ranks, rows=None, *, measure):
    """Route ``site`` over ``ranks`` (``outcome.Ranks``) for the table's enabled rows, limited
    to ``rows`` (None: the table's; ``settings.DEFAULT_ROWS`` for first-use tuning); an
    ``Outcome``, the same on every rank. ``measure``: first-use tuning, collective.
    Raises only for a failure of this rank alone (``_alone``)."""
    group, tp, rank, device, dcp = ranks.group, ranks.tp, ranks.rank, ranks.device, ranks.dcp
    what = _words(site.stock)
    say = partial(kept, where=what)
    lp, where = site.processor, site.where
    installed = getattr(lp, "head_gather", None)
    if installed is not None:
        return Outcome.serving(installed.rows, dtype=gather_dtype(installed))
    if tp <= 1:
        return say(Reason.NO_GATHER, f"tp={tp} has no logits gather to replace")
    why = _site_refuses(site, tp)
    if why is not None:
        return say(Reason.SITE, why)
    shard_width = site.weight.shape[0]
    vocab = tp * shard_width
    dtype = dtypes.name(site.logits_dtype)
    # the engine's own callable, read before routing: what first-use tuning times
    stock_kind, stock_gather = site.stock, getattr(lp, site.attr)
    name, view, vote = _bounded_vote(tp, dcp, device, rows, vocab, stock_kind, dtype)
    # The one agreement: every rank gets here, whatever it read or failed at.
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
    healing = any(v.broken for v in votes)
    if len({v.fallback if healing else v.agreed for v in votes}) > 1:
        return say(Reason.PLANS_DIFFER, "the TP ranks resolved different HEAD_GATHER plans "
                     "(different tables or environments, first-use tuning settings or the "
                     "engine's gather kind included)")
    keys = [v.key for v in votes]
    shared = None if None in keys else len(set(keys)) < tp  # several ranks on one GPU
    why = view.broken
    if healing:  # some host's user table is broken: every rank reads the other layers only
        view = view.fallback
    choice, entries = _choose(view, shared)
    off = _switched_off(view, choice, name, tp, dcp, vocab)
    if off:
        choice = "switched-off"
    unwritable = False
    if healing:  # collective; what follows does not depend on its outcome, only the line
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
        try:  # collective, fail-stop
            outcome = measure(ranks.timing_group, device, tp, rank, dcp, shard_width, view.rows,
                              shared, name, stock=stock_gather, stock_kind=stock_kind,
                              dtype=dtype)
        except Exception as exc:
            _alone(exc, "first-use tuning")
            return say(Reason.TUNING_FAILED,
                         f"first-use tuning failed: {type(exc).__name__}: {exc}")
        if getattr(outcome, "unsaved", None) is not None and not unwritable:
            # An unwritable cache costs the table, not this start (unless the line said so).
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
            # the agreed setting: the environment may have changed on one rank meanwhile
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
    try:  # collective, fail-stop
        gather = _build(group, device, tp, rank, shard_width, entries, view.budget_s, dtype,
                        stock=stock_kind)
    except Exception as exc:
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
    return replace(kept(reason, message, what), measured=measured)


def _words(stock_kind):
    return "all-to-all" if stock_kind == ALL_TO_ALL_STOCK else "logits gather"


def kept(reason, message, where=None):
    """``Outcome.kept(reason, message)`` and its one line at the reason's level."""
    what = where or "logits gather"
    form = ("lamport-head: %s stays stock: %s [%s]" if reason.level >= logging.WARNING
            else "lamport-head: stock %s: %s [%s]")
    logger.log(reason.level, form, what, message, reason.label)
    return Outcome.kept(reason, message)


def _alone(exc, what):
    """Re-raise ``exc`` unless every rank raised it at the same step: this rank alone may
    have left its peers in a collective (docs/design.md, "Together or alone")."""
    if not raised_together(exc):
        logger.error("lamport-head: %s failed on this rank alone (%s: %s): its peers may be "
                     "inside a collective it cannot join; stopping this worker (fail-stop)",
                     what, type(exc).__name__, exc)
        raise exc


def _site_refuses(site, tp, shard_width=None, dtype=None):
    """Why ``site`` cannot take a gather over ``tp`` ranks (of ``shard_width`` and ``dtype``,
    when given), or None. Site facts only, the same on every rank: no collective needed."""
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
    return dtypes.name(getattr(gather, "dtype", dtypes.DEFAULT))


def _route(site, gather, shared=False):
    """Route ``site``'s attribute (on the instance) through ``gather``; the serving ``Outcome``."""
    engine = getattr(site.processor, site.attr)
    site.processor.head_gather = gather
    setattr(site.processor, site.attr, partial(gather, stock=engine))
    return Outcome.serving(gather.rows, shared=shared, dtype=gather_dtype(gather))


def reroute(site, gather, *, label=None):
    """Route a new processor (a replaced model; with ``label``, a drafter of the target's
    shard width) through the ``gather`` built at install; an ``Outcome``, never raises.
    No collective: ``gather`` was agreed at install and ``site``'s facts are the same on
    every rank. A processor with its own gather keeps it (FORCE was agreed for another)."""
    installed = getattr(site.processor, "head_gather", None)
    if installed is gather:  # weights updated in place: still routed
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
    """The row counts decode steps gather: 1 .. ``requests`` x ``per_request`` (1 + draft
    tokens), capped at ``MAX_ROWS``; ``requests`` None (not resolved yet): up to the cap."""
    top = MAX_ROWS if requests is None else min(int(requests) * int(per_request), MAX_ROWS)
    return tuple(range(1, top + 1))


def _others(view):
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
    """``_local_vote`` under the start-up deadline: a rank whose reading blocks still votes;
    the reading left behind touches nothing its peers see."""
    try:
        return within(mailbox.RENDEZVOUS_WAIT_S, "reading the tables and settings (install's vote)",
                      _local_vote, tp, dcp, device, rows, vocab, stock, dtype)
    except TimeoutError as exc:
        return None, None, _Vote(None, None, (Reason.RANK.label, f"TimeoutError: {exc}"),
                                 settings.forced())


def _local_vote(tp, dcp, device, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """``(device name, _View or None, _Vote)`` of this rank; a failure is the vote's reason."""
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
    if view is None:
        reason = (Reason.RANK.label, reason or "the tables could not be read")
    if settings.disabled():
        view, reason = None, (Reason.DISABLED.label, f"disabled by {settings.DISABLE_ENV}")
    return name, view, _Vote(view and view.agreed, view and view.key, reason, force,
                             view and view.settings, bool(view and view.broken is not None),
                             view and view.fallback.agreed)


def _agree_force(votes, why):
    """None when every rank sets FORCE, else the stock ``Outcome`` (some: ``FORCE_PARTIAL``)."""
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
    emulated_entries: dict
    real: str  # table.section_status of the real-rank section
    emulated: str
    autotune: bool
    serve_emulated: bool
    rows: tuple  # the rows first-use tuning measures among
    key: object  # mailbox.device_key: equal keys mean ranks sharing one GPU
    budget_s: float
    stock: str
    vocabs: tuple = ()  # vocabs, stocks, dtypes: the tables' other keys, for the log
    stocks: tuple = ()
    broken: object = None  # why this host's user table cannot be read whole, or None
    dtype: str = dtypes.DEFAULT
    dtypes: tuple = ()
    switch: object = None
    fallback: object = None  # the same reading of every layer but the user table (a _View)

    @property
    def settings(self):
        """What every rank must set alike, whatever its tables hold."""
        return (self.autotune, self.serve_emulated, self.rows, self.budget_s, self.stock,
                self.dtype, self.switch)

    @property
    def agreed(self):
        """What every rank must see alike when every host's user table reads whole."""
        return (Plan.of(self.entries), Plan.of(self.emulated_entries), self.real,
                self.emulated) + self.settings


def _local_view(tp, dcp, device, name, rows, vocab, stock, dtype=dtypes.DEFAULT):
    """(_View, None) or (None, why); a section at another V, stock or dtype reads as missing."""
    try:
        table = load_table()
        for problem in table.problems:
            if not problem.aside:  # a table set aside has its own line, after the agreement
                logger.warning("lamport-head: HEAD_GATHER table: %s", problem.line)
        others = table.without_user if table.without_user is not None else table
        on = settings.autotune_enabled()
        if on:  # picks which environment's version of a key serves
            table.facts = others.facts = provenance.facts()
        key = None
        try:
            key = mailbox.device_key(device)
        except Exception:  # first-use tuning will not guess
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
    """The ``_View`` of ``table`` for this key; ``same``: the fields the tables do not set."""
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
    """Why a switched-off ``SWITCHED`` stock that no layer holds stays stock, or None."""
    if (choice not in ("tune", "unknown") or view.stock not in SWITCHED or view.switch
            or view.real != "missing" or view.emulated != "missing"):
        return None
    return (f"first-use tuning of the all-to-all is switched off ({settings.ALL_TO_ALL_ENV}=0) "
            f"and no table holds a section for {name}, tp={tp}, dcp={dcp}, vocab={vocab}, "
            f"stock={view.stock}, dtype={view.dtype}; to turn it on, unset "
            f"{settings.ALL_TO_ALL_ENV} on every rank (first-use tuning then measures it) or "
            "tune it into a table (`lamport-head tune --all-to-all` under torchrun)")


def _next(view, choice, entries, what, unwritable):
    """What happens next on this start, for a broken user table's line."""
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
    """('table' | 'tune' | 'emulated' | 'unserved' | 'unknown', the enabled entries to
    serve), from the agreed view."""
    if view.real != "missing" and (shared or not view.autotune or view.real == "current"):
        return "table", view.entries  # processes sharing a GPU cannot re-measure real ranks
    if view.autotune and (not shared or view.emulated != "current"):
        return ("unknown", {}) if shared is None else ("tune", {})
    if shared and view.emulated != "missing":
        return ("emulated", view.emulated_entries) if view.serve_emulated else ("unserved", {})
    return "table", {}
