"""SGLang DSpark drafts' base-logits gathers (SGLang 0.5.23; docs/sglang.md, "DSpark drafts":
the paths, and what stays SGLang's). ``compute_base_logits`` gathers outside any LogitsProcessor,
by a path fixed when SGLang attaches the head: ``GATHER`` (routed by its caller module's global),
``MULTIMEM`` (routed as the target's gatherer) or ``LOCAL`` (nothing gathered). Each served path
is keyed by the stock it replaces, which first-use tuning times. The ranks agree once on the path
and on sharing the target's gather before any install, so no rank enters one alone."""

import functools
import importlib
import logging
import weakref
from typing import NamedTuple

import torch

from .. import dtypes, install
from ..collective import all_gather_objects
from ..outcome import Ranks, Reason
from ..table import MAX_ROWS, NCCL_STOCK
from . import measure_first_use
from . import sglang as adapter

logger = logging.getLogger("lamport_head")

# SGLang 0.5.23's DSpark names we rely on (docs/sglang.md)
BASE_LOGITS = "compute_base_logits"
ATTACH = "attach_shared_modules"
MARKOV = "markov_head"
VOCAB_SHARD = "vocab_shard"
BASE_GATHERER = "_base_logits_gatherer"
LOCAL_FLAG = "_opt_markov_w2_tp_shard"
FP32_FLAG = "_use_fp32_lm_head"
FC_GATHERER = "_fc_gatherer"
CROP = "gather_and_crop_vocab"
ALL_GATHER = "tensor_model_parallel_all_gather"
ORG_VOCAB = "org_vocab_size"
GAMMA = "gamma"
DRAFT_TOKENS = "speculative_num_draft_tokens"
DP_ATTENTION = "attn_dp_enabled"
TP_SHARD_ENV = "SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD"  # SGLang's switch: named, never read
NVLINK_ENV = "SGLANG_DSPARK_NVLINK_VOCAB_GATHER"

GATHER, MULTIMEM, LOCAL = CROP, BASE_GATHERER, "local"
PATH_WORDS = {GATHER: f"{BASE_LOGITS}'s {CROP}", MULTIMEM: f"{BASE_LOGITS}'s {BASE_GATHERER}"}

# {lm_head: _Holder}: the routes the dispatchers consult
_ROUTES = weakref.WeakKeyDictionary()
_MARK = "_lamport_head_wrapped"


def is_dspark(model):
    """Whether ``model`` is an SGLang DSpark draft."""
    return all(callable(getattr(model, n, None)) for n in (BASE_LOGITS, ATTACH)) and \
        hasattr(model, MARKOV)


def _caller(model):
    """The module of the class defining ``compute_base_logits`` (it calls ``CROP``), or None."""
    owner = next((c for c in type(model).__mro__ if BASE_LOGITS in vars(c)), None)
    return None if owner is None else importlib.import_module(owner.__module__)


def base_path(model):
    """``(kind, what)``: ``(LOCAL, why)``, ``(MULTIMEM, gatherer)``, ``(GATHER, caller module)``
    or ``(None, why)`` where this SGLang lacks the name; a fact of the model as attached."""
    if (getattr(getattr(model, MARKOV, None), VOCAB_SHARD, None) is not None
            or getattr(model, LOCAL_FLAG, False)):
        return LOCAL, (f"its Markov head is TP-sharded ({TP_SHARD_ENV}): the base logits stay "
                       "vocab-local, not gathered")
    gatherer = getattr(model, BASE_GATHERER, None)
    if gatherer is not None:
        return MULTIMEM, gatherer
    module = _caller(model)
    if module is None or not callable(getattr(module, CROP, None)):
        return None, (f"this SGLang's {getattr(module, '__name__', type(model).__name__)} has "
                      f"no {CROP} (not 0.5.23's)")
    return GATHER, module


def _not_routed(model):
    """``[(path, words), ...]``: the DSpark collectives no Lamport gather serves."""
    name, out = type(model).__name__, []
    markov = getattr(model, MARKOV, None)
    shard = getattr(markov, VOCAB_SHARD, None)
    if shard is not None:
        vocab_gather = f"{type(markov).__name__}'s {type(getattr(shard, 'gather', None)).__name__}"
        own = (f"SGLang's VocabGather, its own Lamport push on its NVLink plane ({NVLINK_ENV}; "
               "NCCL without multicast)")
        out.append((f"{vocab_gather} candidate exchange",
                    f"each draft step's per-block candidates, rank-stacked [TP x rows, 2 x "
                    f"blocks] FP32 (value, index bits), not logits, through {own}"))
        out.append((f"{vocab_gather} step-logits gather (drafting not greedy)",
                    f"the kept step logits [rows, V/TP] through {own}: no table section is "
                    "measured against it"))
    if getattr(model, FC_GATHERER, None) is not None:
        out.append((f"{FC_GATHERER}", "it gathers fc's hidden columns of the target's context "
                                      "features, not logits"))
    return [(f"drafter {name} {path}", f"not routed ({why})") for path, why in out]


def _why_stock(model, head):
    """Why the base logits skip the plain TP all-gather of the head's group (None: they take it)."""
    if head is None:
        return f"{type(model).__name__} has no lm_head attached"
    if getattr(head, "use_attn_tp_group", False):
        return "--enable-dp-lm-head: the head is sharded over the attention TP group"
    try:
        context = importlib.import_module(adapter.CONTEXT)
        dp = bool(getattr(context.get_parallel(), DP_ATTENTION, False))
    except Exception:
        dp = False
    if dp:
        return "DP attention: the draft's base logits may gather in its own TP layout"
    return None


class _NcclAllGather:
    """``CROP``'s all-gather as SGLang calls it, looked up in its module at each call."""

    def __init__(self, namespace):
        self.namespace = namespace

    def __call__(self, x):
        return self.namespace[ALL_GATHER](x, dim=-1)


class _Holder:
    """The install core's processor for one lm_head; its stock ``all_gather`` is SGLang's."""

    def __init__(self, stock):
        self.all_gather = stock


def _dispatching(module):
    """Replace ``CROP`` in ``module`` once: a routed lm_head's all-gather takes its route, then
    SGLang's crop; every other call is SGLang's function, unchanged."""
    original = getattr(module, CROP)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def gather_and_crop_vocab(local_logits, lm_head):
        holder = _ROUTES.get(lm_head)
        if holder is None:
            return original(local_logits, lm_head)
        return holder.all_gather(local_logits)[..., : int(getattr(lm_head, ORG_VOCAB))]

    setattr(gather_and_crop_vocab, _MARK, True)
    setattr(module, CROP, gather_and_crop_vocab)


def _site(model, head, kind, what):
    """The install core's view of the draft's ``kind`` gather, and a ``GATHER`` route's holder."""
    name = type(model).__name__
    fp32 = bool(getattr(model, FP32_FLAG, False)) and getattr(head.weight, "is_floating_point",
                                                               lambda: False)()
    if kind == MULTIMEM:
        holder, processor, attr, stock = None, model, BASE_GATHERER, adapter.stock_kind(what)
    else:
        original = getattr(what, CROP)
        holder = _ROUTES.get(head) or _Holder(_NcclAllGather(
            getattr(original, "__wrapped__", original).__globals__))
        processor, attr, stock = holder, "all_gather", NCCL_STOCK
    site = install.GatherSite(processor=processor, attr=attr, weight=getattr(head, "weight", None),
                              head_tp=getattr(head, "tp_size", 1),
                              where=f"{name}.{PATH_WORDS[kind]}", stock=stock,
                              dtype=torch.float32 if fp32 else None)
    return site, holder


def rows_from_sglang(model):
    """``bs x gamma`` for bs = 1 .. max running requests (to the cap while unsized), gamma
    ``speculative_num_draft_tokens`` - 1 where set, else the draft's. None: SGLang did not say."""
    try:
        context = importlib.import_module(adapter.CONTEXT)
        requests = getattr(context.get_schedule(), adapter.REQUESTS)
        tokens = getattr(getattr(context, adapter.SPEC)(), DRAFT_TOKENS, None)
    except Exception as exc:
        logger.debug("lamport-head: SGLang's DSpark rows unknown (%s: %s)", type(exc).__name__,
                     exc)
        return None
    gamma = tokens - 1 if isinstance(tokens, int) and tokens >= 2 else getattr(model, GAMMA, None)
    if not isinstance(gamma, int) or gamma < 1 or (
            requests is not None and (not isinstance(requests, int) or requests < 1)):
        return None
    top = MAX_ROWS // gamma if requests is None else min(requests, MAX_ROWS // gamma)
    return tuple(gamma * b for b in range(1, top + 1)) or None


class DSpark(NamedTuple):
    """What the DSpark draft's install did, for the summary."""

    name: str
    routes: tuple  # ((path, Outcome), ...)
    others: tuple  # ((path, words), ...): paths no install decides
    rank: int
    tp: int
    dcp: int

    @property
    def served(self):
        return any(outcome.served for _, outcome in self.routes)


def install_sglang_dspark_gathers(model, dcp=1, rows=None, target=None):
    """Route the draft's base-logits gather once SGLang attached its head: a ``DSpark``. After
    the one agreement, every rank alike takes the target's gather (same group, shard width,
    dtype and stock; only where every rank can), its own install, or stock."""
    target = adapter._target if target is None else target
    name = type(model).__name__
    group, tp, rank, device_group = adapter._sglang_tp()
    head = getattr(model, "lm_head", None)
    kind, what = base_path(model)
    others = tuple(_not_routed(model))
    path = f"drafter {name} {PATH_WORDS.get(kind, BASE_LOGITS)}"
    if kind in (GATHER, MULTIMEM):
        path += f" ({NCCL_STOCK if kind == GATHER else adapter.stock_kind(what)})"
    words = f"SGLang DSpark drafter {name}'s base-logits gather"
    why = what if kind is None else None if kind == LOCAL else _why_stock(model, head)
    site = holder = shared = None
    if kind in (GATHER, MULTIMEM) and why is None:
        site, holder = _site(model, head, kind, what)
        g, weight = getattr(target, "gather", None), site.weight
        if (g is not None and torch.is_tensor(weight) and weight.dim() == 2
                and target.group is group and g.tp == tp and g.shard_width == weight.shape[0]
                and dtypes.name(site.logits_dtype) == install.gather_dtype(g)
                and target.stock == site.stock):
            shared = g
    # A rank on another path (its SGLang settings differ) or unable to share must neither
    # leave its peers in an install's collectives nor skip one alone: all agree first.
    view = (str(kind), why is None, shared is not None)
    views = all_gather_objects(view, group) if tp > 1 else [view]
    if len({v[:2] for v in views}) > 1:
        outcome = install.kept(Reason.PLANS_DIFFER, "the TP ranks took different DSpark "
                                f"base-logits paths ({', '.join(sorted({v[0] for v in views}))}"
                                "): SGLang's DSpark settings differ between ranks", words)
        return DSpark(name, ((path, outcome),), others, rank, tp, dcp)
    if kind == LOCAL:
        return DSpark(name, (), ((f"drafter {name} {BASE_LOGITS}", what),) + others, rank, tp,
                      dcp)
    if why is not None:
        reason = Reason.ENGINE if kind is None else Reason.SITE
        return DSpark(name, ((path, install.kept(reason, why, words)),), others, rank, tp, dcp)
    if all(v[2] for v in views):
        outcome = install.reroute(site, shared, label=f"the SGLang DSpark drafter {name}")
    else:
        outcome = install.install(site, Ranks(group, tp, rank, site.weight.device
                                              if torch.is_tensor(site.weight) else "cpu",
                                              dcp, device_group), rows,
                                  measure=measure_first_use)
    if outcome.served and kind == GATHER:
        _ROUTES[head] = holder
        _dispatching(what)
    return DSpark(name, ((path, outcome.within(rows)),), others, rank, tp, dcp)


def served_gather(model):
    """The HeadGather serving this draft's base logits (its path's: ``base_path``), or None."""
    kind = base_path(model)[0]
    if kind == MULTIMEM:
        return getattr(model, "head_gather", None)
    if kind == GATHER:
        return getattr(_ROUTES.get(getattr(model, "lm_head", None)), "head_gather", None)
    return None


def summary(target, dspark):
    """Rank 0's line for a DSpark server: the target's outcome, then a clause per path."""
    head = f"SGLang speculative decoding (DSpark), tp={dspark.tp}, dcp={dspark.dcp}: "
    clauses = [adapter.target_clause(target)]
    for path, outcome in dspark.routes:
        if outcome.served:
            whose = (" (the target's: the same shard width and stock)" if outcome.shared
                     else "")
            kind = "" if outcome.dtype == dtypes.DEFAULT else f" ({outcome.dtype} logits)"
            clauses.append(f"{path}: Lamport logits gather{whose} for rows "
                           f"{list(outcome.rows)}{kind}")
        else:
            clauses.append(f"{path}: SGLang's gather ({outcome.reason.label}: "
                           f"{outcome.message})")
    clauses += [f"{path}: {words}" for path, words in dspark.others]
    routed = [p for p, on in (("target logits gather", target is not None and target.served),
                              ("drafter base-logits gather", dspark.served)) if on]
    return head + "; ".join(clauses) + f"; routed on all {dspark.tp} TP ranks: " + (
        ", ".join(routed) if routed else "none (SGLang's own gathers)")


def on_attach(runner, dcp=1):
    """Install once the draft holds its head: now (DeepSeek V4's own head), else right after
    SGLang's ``attach_shared_modules``, before draft graph capture. The ``DSpark`` if it did now."""
    model = runner.model

    def run():
        done = install_sglang_dspark_gathers(model, dcp, rows_from_sglang(model))
        gather = served_gather(model)
        if gather is not None:
            adapter.poll_before_forward(runner, gather)
        if done.rank == 0:
            logger.info("lamport-head summary: %s", summary(adapter._target, done))
        return done

    if getattr(model, "lm_head", None) is not None:
        return run()
    attach = getattr(model, ATTACH)
    if getattr(attach, _MARK, False):
        return None

    @functools.wraps(attach)
    def attach_shared_modules(*args, **kwargs):
        result = attach(*args, **kwargs)
        run()
        return result

    setattr(attach_shared_modules, _MARK, True)
    setattr(model, ATTACH, attach_shared_modules)
    return None
