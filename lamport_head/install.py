"""The engine-neutral install core: route one engine's logits gather through a
HeadGather for the rows the HEAD_GATHER table enables on this GPU model and (TP, DCP).

It knows no engine. An adapter (``lamport_head.engines.vllm``, ``.sglang``) finds the
processor and lm_head and hands a ``GatherSite`` (the object and attribute to route,
the head's weight and TP size, where it sits, the engine's own facts) and the
first-use measuring (``measure``, injected: the runtime never imports the tuner).
``decode_rows`` is the engines' one bound on the rows (requests x rows per request,
capped); ``reroute`` routes an engine's replacement model through the gather already
built, with no collective.

Fail-stop order: the site checks (the same on every rank by construction) need no
collective; then each rank reads alone what may differ or fail on it alone (its
device's name, the tables, LAMPORT_HEAD_DISABLE and LAMPORT_HEAD_FORCE, first-use
tuning settings) into its vote, and every rank, whatever it read, meets at the
agreement on the entries to serve (one all-gather: a rank whose reading failed or
differs takes every rank to stock). Only then the HeadGather is built, itself collective and fail-stop (local
part, agree, map the peers' mailboxes, agree, arm, barrier): every rank serves the
rows or every rank stays stock. When no layer holds a real-rank section for this
GPU model, TP, DCP and vocabulary (V = TP x the head's shard width: a section measured
at another V is none) or the user table's is stale, the agreed view says so on
every rank alike, and first-use tuning (``measure``, collective and fail-stop)
measures, writes the user table and hands back the entries to build; what follows it
reads the agreed view, never the environment again. A missing table entry, a
non-CUDA device or a build or measurement every rank failed together leaves the stock
gather with one log line. No rank switches to stock alone: the stock path is itself a
collective, so a failure of this rank alone (``collective.raised_together`` false)
raises and stops the worker (fail-stop: the engine stops every rank).
"""

import logging
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from . import settings
from .collective import all_gather_objects, raised_together
from .table import NCCL_STOCK

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


def _device_name(device):
    """The GPU model of ``device``; None when it is not a usable CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def _build(group, device, tp, rank, shard, entries, budget_s):
    """The serving gather of ``entries`` (``{rows: table.TableRow}``, the enabled ones):
    its plan is their configs. A give-up stops the GPU context (``mode="serving"``: its
    launch flag, ``build.launch_flag``), so no step with missing data reaches the
    engine's sampler or its host. Built on ``build``'s one path: the kernel is the one
    the tuner timed for the row, under the tuner's occupancy limit."""
    from .head_gather import HeadGather
    from .status import SERVING

    plan = {m: e.config for m, e in entries.items()}
    gather = HeadGather(group, device, tp, rank, shard, plan, budget_s=budget_s, mode=SERVING,
                        clamp=True)
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
    reason: object  # why this rank cannot serve (a local failure, DISABLE), or None
    force: bool  # LAMPORT_HEAD_FORCE as this rank's environment reads it


def install(site, group, tp, rank, device, dcp=1, rows=None, *, measure, device_group=None):
    """Route ``site`` through a HeadGather for the table's enabled rows; returns the
    rows served, ``()`` meaning the engine's stock gather.
    ``group``: where the ranks agree and the mailboxes are exchanged: the engine's
    CPU (gloo) group where it has one, so a rank whose CUDA context broke still
    reaches every agreement; ``device_group`` (default ``group``): the engine's
    device group, on which first-use tuning times the stock all-gather it competes
    with.
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
    lp, where = site.processor, site.where
    installed = getattr(lp, "head_gather", None)
    if installed is not None:  # an earlier call installed one: keep it
        return tuple(sorted(installed.rows))
    if tp <= 1:
        logger.info("lamport-head: tp=%d has no logits gather to replace", tp)
        return ()
    why = _site_refuses(site, tp)
    if why is not None:
        logger.info("lamport-head: stock logits gather: %s", why)
        return ()
    shard = site.weight.shape[0]
    vocab = tp * shard  # the full (padded) vocabulary: a table section is measured at one V
    # the gather the route replaces: what a section must have been measured against, and
    # what first-use tuning times (the engine's own callable, before routing)
    stock, stock_gather = site.stock, getattr(lp, site.attr)
    name, view, vote = _bounded_vote(tp, dcp, device, rows, vocab, stock)
    # Collective 1: agree on the entries and on whether to measure first. Every rank gets
    # here, whatever it read or failed at: a rank deciding alone would be missing from
    # the mailbox's (or the sweep's) collectives its peers enter next.
    votes = [_Vote(*v) for v in all_gather_objects(tuple(vote), group)]
    if site.kept is not None and not _agree_force(votes, site.kept):
        return ()
    reasons = [(r, v.reason) for r, v in enumerate(votes) if v.reason]
    if reasons:
        mine = vote.reason or f"rank {reasons[0][0]}: {reasons[0][1]}"
        logger.warning("lamport-head: logits gather stays stock: %s", mine)
        return ()
    if len({v.agreed for v in votes}) > 1:
        logger.warning("lamport-head: logits gather stays stock: the TP ranks resolved "
                       "different HEAD_GATHER plans (different tables or environments, "
                       "first-use tuning settings or the engine's gather kind included)")
        return ()
    keys = [v.key for v in votes]
    if view.broken is not None:  # agreed: every rank's user table is broken; none serves it
        from .table import user_path
        from .tablefile import set_aside_agreed

        set_aside_agreed(user_path(), view.broken, keys, rank, group)
    shared = None if None in keys else len(set(keys)) < tp  # several ranks on one GPU
    choice, entries = _choose(view, shared)
    if choice == "unknown":
        logger.warning("lamport-head: logits gather stays stock: first-use tuning cannot tell "
                       "whether the TP ranks share a GPU (no device key)")
        return ()
    if choice == "tune":
        try:  # collective, fail-stop: every rank gets the same outcome or every rank raises
            outcome = measure(device_group if device_group is not None else group, device, tp,
                              rank, dcp, shard, view.rows, shared, name, stock=stock_gather,
                              stock_kind=stock)
        except Exception as exc:
            _alone(exc, "first-use tuning")
            logger.warning("lamport-head: logits gather stays stock: first-use tuning failed: "
                           "%s: %s", type(exc).__name__, exc)
            return ()
        logger.info("lamport-head: first-use tuning on %s (tp=%d, dcp=%d, %s): measured rows "
                    "%s in %.1f s, wrote %s%s; vocab=%d%s", name, tp, dcp, view.real,
                    [r.rows for r in outcome.results], outcome.seconds,
                    outcome.path if getattr(outcome, "unsaved", None) is None
                    else f"nothing (could not save {outcome.path})",
                    " (emulated: true)" if outcome.emulated else "", vocab, _others(view))
        entries = outcome.entries
        if outcome.emulated:
            # The agreed view's setting, never a fresh read of the environment: it may
            # have changed on one rank while the ranks measured.
            choice = "emulated" if view.serve_emulated else "unserved"
    if choice == "unserved":
        logger.info("lamport-head: stock logits gather: the ranks share one GPU, so the %s "
                    "section for %s, tp=%d, dcp=%d is emulated: true, never served (%s=1 "
                    "serves it, to test this mode only)", name, name, tp, dcp,
                    settings.SERVE_EMULATED_ENV)
        return ()
    if choice == "emulated":
        logger.warning("lamport-head: serving an emulated section (processes sharing one GPU: "
                       "not performance) because %s is set", settings.SERVE_EMULATED_ENV)
    if not entries:
        logger.info("lamport-head: no enabled HEAD_GATHER rows for %s, tp=%d, dcp=%d, vocab=%d, "
                    "stock=%s%s; stock logits gather", name, tp, dcp, vocab, stock, _others(view))
        return ()
    try:  # collective, fail-stop: every rank gets a gather or every rank raises
        gather = _build(group, device, tp, rank, shard, entries, view.budget_s)
    except Exception as exc:  # a capability fallback, taken by every rank together
        _alone(exc, "building the gather")
        logger.warning("lamport-head: logits gather stays stock: %s: %s",
                       type(exc).__name__, exc)
        return ()
    served = _route(site, gather)
    logger.info("lamport-head: Lamport logits gather on %s (tp=%d, dcp=%d) for rows %s, "
                "routed at %s; spin budget %g s (%s), agreed by every rank; a give-up stops "
                "the GPU context", name, tp, dcp, served, where, view.budget_s,
                settings.BUDGET_ENV)
    return served


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


def _site_refuses(site, tp, shard=None):
    """Why ``site`` cannot take a gather over ``tp`` ranks (of ``shard`` columns when
    given), or None. Facts of the site only, the same on every rank by construction:
    no collective needed to act on the answer."""
    weight = site.weight
    if (weight is None or weight.dim() != 2 or weight.dtype != torch.bfloat16
            or site.head_tp != tp or not site.plain):
        return (f"{site.where} is not a BF16 vocab-parallel head gathered by all-gather over "
                f"tp={tp} (lm_head weight "
                f"{None if weight is None else f'{tuple(weight.shape)} {weight.dtype}'}, "
                f"tp_size {site.head_tp}{f'; {site.facts}' if site.facts else ''})")
    if weight.shape[0] % 8:
        return f"shard width {weight.shape[0]} is not a multiple of 8"
    if shard is not None and weight.shape[0] != shard:
        return f"shard width {weight.shape[0]}, the gather's is {shard}"
    return None


def _route(site, gather):
    """Route ``site``'s gather attribute through ``gather`` (an instance attribute: other
    processors keep theirs); the rows served."""
    stock = getattr(site.processor, site.attr)
    site.processor.head_gather = gather
    setattr(site.processor, site.attr, partial(gather, stock=stock))
    return tuple(sorted(gather.rows))


def reroute(site, gather, *, label=None):
    """Route a new processor (the engine replaced its model, e.g. after a weight update)
    through the ``gather`` its first model was served by; the rows served, ``()``
    meaning the engine's stock gather, with one line either way. ``label``: what the
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
        return tuple(sorted(gather.rows))
    why = site.kept or _site_refuses(site, gather.tp, gather.shard)
    if why is not None:
        logger.info("lamport-head: stock logits gather on %s: %s", label or "the new model", why)
        return ()
    served = _route(site, gather)
    if label is None:
        logger.info("lamport-head: the new model's gather routed again at %s: the gather built "
                    "at install serves rows %s", site.where, served)
    else:
        logger.info("lamport-head: %s routed at %s through the gather already built (the same "
                    "shard width: no second mailbox, no collective); it serves rows %s", label,
                    site.where, served)
    return served


def decode_rows(requests, per_request):
    """The row counts an engine's decode steps gather: 1 .. ``requests`` x ``per_request``
    (logits rows per request: 1 + its draft tokens), capped at ``table.MAX_ROWS``.
    ``requests`` None (the engine resolves it later, from memory): up to the cap."""
    from .table import MAX_ROWS

    top = MAX_ROWS if requests is None else min(int(requests) * int(per_request), MAX_ROWS)
    return tuple(range(1, top + 1))


def _others(view):
    """For the log: what the tables hold real-rank sections for instead (other
    vocabularies; this vocabulary measured against another stock)."""
    if view is None:
        return ""
    said = []
    if view.stocks:
        said.append(f"this vocab measured against {', '.join(view.stocks)}")
    if view.vocabs:
        said.append(f"vocab {', '.join(map(str, view.vocabs))}")
    return f" (the tables hold sections for {'; '.join(said)} only)" if said else ""


def _bounded_vote(tp, dcp, device, rows, vocab, stock):
    """``_local_vote`` under the start-up deadline (``mailbox.RENDEZVOUS_WAIT_S``): a
    rank whose reading blocks (a table on a hung file system, a device query) still
    reaches the agreement in time, its vote's reason saying so, and every rank stays
    stock; the reading left behind touches nothing its peers see."""
    from .collective import within
    from .mailbox import RENDEZVOUS_WAIT_S

    try:
        return within(RENDEZVOUS_WAIT_S, "reading the tables and settings (install's vote)",
                      _local_vote, tp, dcp, device, rows, vocab, stock)
    except TimeoutError as exc:
        return None, None, _Vote(None, None, f"TimeoutError: {exc}", settings.forced())


def _local_vote(tp, dcp, device, rows, vocab, stock):
    """``(device name, _View or None, _Vote)``: everything this rank reads alone before
    the agreement. Never raises: a failure here is the vote's reason, which every
    rank hears (each rank then stays stock together)."""
    force = settings.forced()
    try:
        name = _device_name(device)
    except Exception as exc:
        return None, None, _Vote(None, None, f"cannot name the GPU model of {device}: "
                                             f"{type(exc).__name__}: {exc}", force)
    if name is None:
        return None, None, _Vote(None, None, f"{device} is not a CUDA device", force)
    view, reason = _local_view(tp, dcp, device, name, rows, vocab, stock)
    if settings.disabled():
        # An environment variable may reach some ranks only: it travels with the vote.
        view, reason = None, f"disabled by {settings.DISABLE_ENV}"
    return name, view, _Vote(view and view.agreed, view and view.key, reason, force)


def _agree_force(votes, why):
    """For a processor whose class has its own gather (``why``: the site's text saying
    it keeps it): True when every rank's LAMPORT_HEAD_FORCE is set. Not set anywhere:
    the processor keeps its gather (one line). Set on some ranks only: every rank
    keeps it, with a warning naming them, as a LAMPORT_HEAD_DISABLE that reached some
    ranks only takes every rank to stock.
    The same answer on every rank: ``votes`` are the gathered ones."""
    on = [r for r, v in enumerate(votes) if v.force]
    if len(on) == len(votes):
        return True
    if not on:
        logger.info("lamport-head: stock logits gather: %s", why)
        return False
    off = [r for r, v in enumerate(votes) if not v.force]
    logger.warning("lamport-head: logits gather stays stock: %s=1 reached TP rank(s) %s but not "
                   "%s (every rank must say the same): %s", settings.FORCE_ENV, on, off, why)
    return False


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

    @property
    def agreed(self):
        """What every rank must see alike (setting the user table aside included)."""
        return (_digest(self.entries), _digest(self.emulated_entries), self.real, self.emulated,
                self.autotune, self.serve_emulated, self.rows, self.budget_s, self.stock,
                self.broken is not None)


def _local_view(tp, dcp, device, name, rows, vocab, stock):
    """(_View, None) or (None, why): this rank's reading of the tables, no collectives.
    Only sections measured at ``vocab`` (the model's V = TP x shard width) against
    ``stock`` (the engine's gather the route replaces) count: one measured at another
    V or against another stock reads as missing (first-use tuning measures this one)."""
    from .mailbox import device_key
    from .provenance import section_status
    from .table import TableError, load_table

    try:
        table = load_table()  # lenient: what it skipped is one line each, the rest serves
        for problem in table.problems:
            if not (table.broken and problem.line.startswith(table.broken)):  # set aside: its
                # own line (tablefile.set_aside_agreed) says it, after the agreement
                logger.warning("lamport-head: HEAD_GATHER table: %s", problem.line)
        on = settings.autotune_enabled()
        if on:  # which environment's version of a key serves (first use measures the rest)
            from .provenance import facts

            table.facts = facts()

        def read(emulated):
            section = table.section(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock)
            entries = table.entries(name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock)
            enabled = {m: e for m, e in entries.items()
                       if e.enabled and (rows is None or m in rows)}
            # Only first-use tuning asks whether a section is stale (it costs nvidia-smi).
            state = section_status(section) if on else ("missing" if section is None
                                                         else "current")
            return enabled, state

        (entries, real), (emulated_entries, emulated) = read(False), read(True)
        key = None
        try:
            key = device_key(device)
        except Exception:  # no device key: first-use tuning will not guess
            pass
        others = tuple(v for v in table.vocabs(name, tp, dcp) if v != vocab)
        stocks = tuple(k for k in table.stocks(name, tp, dcp, vocab) if k != stock)
        return _View(entries, emulated_entries, real, emulated, on, settings.serve_emulated(),
                     tuple(sorted(set(rows or settings.DEFAULT_ROWS))), key,
                     settings.spin_budget_s(), stock, others, stocks, table.broken), None
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
