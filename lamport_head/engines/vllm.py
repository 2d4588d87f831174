"""vLLM adapter: the general plugin (entry point ``vllm.general_plugins`` ->
``lamport_head``), the explicit ``install_logits_gather`` on a loaded vLLM model, and
which LogitsProcessor of that model to route.

``register()`` wraps the GPU worker's ``load_model`` so that, once the model is
loaded (before any CUDA graph capture), every TP worker calls
``install_logits_gather`` with the TP device group, TP size and rank, its device,
the DCP size and the rows its decode steps gather (``rows_from_vllm``: 1 ..
max_num_seqs x (1 + num_speculative_tokens), capped: ``install.decode_rows``). vLLM
loads general plugins in every process and possibly more than once: wrapping is
idempotent, and vLLM is imported only here, lazily. Install's outcome (stock
included) is agreed by every TP rank; an exception out of it is never swallowed,
since the rank it left would enter vLLM's collectives out of step with its peers.
The ``lamport_head`` logger is routed through vLLM's handlers
(``attach_to_vllm``), so each worker's lines reach the server's output; rank 0
adds a one-line summary naming every routed path.

Speculative decoding: the runner's ``load_model`` loads the drafter's model too (V1
``drafter.load_model``, V2 ``speculator.load_model``: EAGLE, EAGLE3, MTP, draft-model
speculation), so once the target is installed every rank installs on the drafter's
model (``install_drafter_gather``): its processor (``find_drafter_target``: on the
model as for a target, or an MTP drafter's nested one) served by the target's gather
when its head has the target's shard width (EAGLE and MTP heads vLLM shares; no
second mailbox, no collective), else by its own install (another vocabulary, e.g. an
EAGLE3 head; collective, agreed, fail-stop as the target's: a failure leaves the
drafter stock on every rank and the target as it was). Rows: a draft step's requests
(``drafter_rows``: 1 .. max_num_seqs, times the draft tokens with parallel drafting).
With ``use_local_argmax_reduction`` greedy drafts take ``get_top_tokens`` (candidates,
not logits: no logits gather is built for the drafter, ``drafter_paths``); its all-gather
of fp32 (value, index) pairs is routed instead (``install_candidate_gather``, issue 32
item 2): the pairs packed so that the kernel moves them bitwise
(``lamport_head.candidates``), a gather of packed width 8 built by the install core (its
own table section, V = TP x 8; agreed, fail-stop), serving the drafter's and the target's
LogitsProcessor. vLLM's reduction code runs unchanged: the processors' candidate methods
(instance attributes) mark their routes active while they run, and the LogitsProcessor
module's ``tensor_model_parallel_all_gather``, replaced once by a dispatcher, sends a
routed (cols, dtype) through the packed gather there and calls vLLM's otherwise. The
decision is by the processor, shape and dtype only, the same on every rank. Drafters
whose ``compute_candidates`` calls ``get_top_k_tokens`` (DFlash2, DFlash2 beam,
LiLiCorr: the one table ``CANDIDATE_CALLERS`` says which processor and k) get its
values / ids / log-partition gathers routed the same way (``install_drafter_candidates``,
rows ``candidate_rows``), decided by the model's class and config alone.

Which processor (``find_gather_target``), found the way vLLM's own code finds a
model's head:

- Multimodal wrappers (``KimiK3ForConditionalGeneration``,
  ``KimiK25ForConditionalGeneration``, ...) hold the LogitsProcessor and lm_head
  under ``get_language_model()``; the language model's pair is preferred, then the
  model's own (as vLLM's speculators look up the target's lm_head).
- LoRA: ``LogitsProcessorWithLoRA`` calls ``self.base_layer._gather_logits``, so the
  base layer is the one routed; a LoRA-wrapped lm_head is read through its
  ``base_layer`` too.
- A processor whose class overrides ``_gather_logits`` (vLLM's DeepSeek V4.1
  ``SpecializedDecodeLogitsProcessor`` runs its own one-shot all-gather) keeps it
  unless ``LAMPORT_HEAD_FORCE=1``; forced, its own gather still serves the rows our
  table does not. The variable is one process's environment: the adapter looks the
  processor up with ``force=True`` and hands the core the text saying why it would
  keep its gather; the core decides only once every rank said whether it is set (a
  rank deciding alone would leave its peers in a collective).

vLLM is not imported at module level: the stock class is recognized by its module
and name.
"""

import functools
import logging
import threading
from typing import NamedTuple

import torch

from .. import install
from ..settings import FORCE_ENV, forced
from . import collect_log, measure_first_use

logger = logging.getLogger("lamport_head")
GATHER = "_gather_logits"  # vLLM LogitsProcessor's gather: [M, V/TP] -> [M, V]
_STOCK = ("vllm.model_executor.layers.logits_processor", "LogitsProcessor")
_MARK = "_lamport_head_wrapped"

def _language_model(model):
    """``model.get_language_model()`` when it names another module, else None."""
    get = getattr(model, "get_language_model", None)
    if not callable(get):
        return None
    try:
        inner = get()
    except Exception:  # vLLM raises NotImplementedError when none is marked
        return None
    return None if inner is None or inner is model else inner


def _gather_owner(processor):
    """The class in the processor's MRO that defines ``_gather_logits`` (None: none does)."""
    return next((c for c in type(processor).__mro__ if "_gather_logits" in vars(c)), None)


def owns_gather(processor) -> bool:
    """True when the processor's class overrides vLLM's stock ``_gather_logits``."""
    owner = _gather_owner(processor)
    return owner is not None and (owner.__module__, owner.__qualname__) != _STOCK


def find_gather_target(model, force=None):
    """``(processor, lm_head, text)``.

    ``processor``: the object whose ``_gather_logits`` the model really calls (set as
    an instance attribute to route it), or None to stay stock, ``text`` then saying
    why. When found, ``lm_head`` is the vocab-parallel head (unwrapped from LoRA) and
    ``text`` says where the processor sits and anything about how it is routed.
    ``force``: route a processor whose class has its own gather; None reads this
    process's ``LAMPORT_HEAD_FORCE``. A pure function of the model and ``force``."""
    name = type(model).__name__
    inner = _language_model(model)
    owners = [(m, path) for m, path in ((inner, f"{name}.get_language_model()"), (model, name))
              if m is not None]
    found = next(((m, path) for m, path in owners
                  if getattr(m, "logits_processor", None) is not None), None)
    if found is None:
        where = f"{name} or its language model" if inner is not None else name
        return None, None, f"no logits_processor on {where}"
    owner, path = found
    head = getattr(owner, "lm_head", None)
    if head is None:
        head = next((getattr(m, "lm_head") for m, _ in owners
                     if getattr(m, "lm_head", None) is not None), None)
    return _resolve(owner.logits_processor, head, path + ".logits_processor", force)


def _resolve(processor, head, path, force):
    """``find_gather_target``'s answer for a processor found at ``path`` with its head:
    LoRA's base layer, a class with its own gather (kept unless forced)."""
    head = getattr(head, "base_layer", head)  # a LoRA-wrapped lm_head
    notes = []
    base = getattr(processor, "base_layer", None)
    if base is not None and callable(getattr(base, "_gather_logits", None)):
        notes.append(f"the base layer of {type(processor).__name__}, which calls its gather")
        processor = base
        path += ".base_layer"
    if owns_gather(processor):
        own = _gather_owner(processor).__qualname__
        if not (forced() if force is None else force):
            return None, None, (f"{path} ({type(processor).__name__}) has its own _gather_logits "
                                f"({own}) and keeps it; {FORCE_ENV}=1 routes the table's rows "
                                "through lamport-head instead")
        notes.append(f"{FORCE_ENV}=1: replaces {own}._gather_logits for these rows; "
                     "it keeps the others")
    return processor, head, "; ".join([path] + notes)


def _is(module, name):
    """True when a class named ``name`` is in the module's MRO (vLLM is not imported)."""
    return any(c.__name__ == name for c in type(module).__mro__)


def find_drafter_target(model, force=None):
    """``find_gather_target`` for a speculative drafter's model. EAGLE / EAGLE3 /
    draft-model drafters hold ``logits_processor`` and ``lm_head`` on the model (or its
    language model), as targets do. MTP drafters (``DeepSeekMTP`` and its kin) hold
    the processor one level down (``model.model.logits_processor``) and call it with
    each MTP layer's ``shared_head.head``: found as the model's only LogitsProcessor,
    its head the model's ParallelLMHead(s), which must agree in shape and TP size (one
    shard width: one gather)."""
    processor, head, where = find_gather_target(model, force)
    if processor is not None or not where.startswith("no logits_processor"):
        return processor, head, where
    name = type(model).__name__
    found = [(n, m) for n, m in model.named_modules() if _is(m, "LogitsProcessor")]
    if len(found) != 1:
        return None, None, (f"{len(found)} LogitsProcessors in {name}" if found else where)
    heads = [(n, m) for n, m in model.named_modules() if _is(m, "ParallelLMHead")]
    kinds = {(tuple(getattr(getattr(m, "weight", None), "shape", ())), getattr(m, "tp_size", 1))
             for _, m in heads}
    if len(kinds) != 1:
        return None, None, (f"{name}.{found[0][0]}: its heads {[n for n, _ in heads]} do not "
                            "share one shape" if heads else f"{name}: no ParallelLMHead")
    return _resolve(found[0][1], heads[0][1], f"{name}.{found[0][0]}", force)


def rows_from_vllm(vllm_config):
    """The row counts a vLLM server's decode steps can gather: 1 .. max running
    requests x (1 + speculative tokens per request), capped (``install.decode_rows``); None when
    the config does not say."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not isinstance(seqs, int) or seqs < 1:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = (getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0
    return install.decode_rows(seqs, 1 + int(k))


def install_logits_gather(model, group, tp, rank, device, dcp=1, rows=None, *,
                          device_group=None):
    """Route the vLLM model's LogitsProcessor ``_gather_logits`` (an instance
    attribute: other LogitsProcessors keep theirs) through a HeadGather for the
    table's enabled rows; which processor is ``find_gather_target``'s to say.
    ``rows``: the row counts the server's decode steps gather (``rows_from_vllm``);
    None: the table's rows. Returns the rows served; ``()`` means the stock gather.
    Collective over ``group`` once a processor is found (``install.install``: every
    rank takes the same outcome); raises only for a failure of this rank alone, which
    must stop the worker (``install``'s fail-stop). ``group``: where the ranks agree (a
    CPU group where there is one); ``device_group``: the stock all-gather's group,
    which first-use tuning times (default ``group``)."""
    lp, head, where = find_gather_target(model, force=True)  # FORCE is decided agreed
    if lp is None:
        logger.info("lamport-head: stock logits gather: %s", where)
        return ()
    site = _site(model, lp, head, where, find_gather_target)
    return install.install(site, group, tp, rank, device, dcp, rows, measure=measure_first_use,
                           device_group=device_group)


def _site(model, lp, head, where, finder):
    """The install core's view of the processor ``finder`` found in ``model``."""
    return install.GatherSite(
        processor=lp, attr=GATHER, weight=getattr(head, "weight", None),
        head_tp=getattr(head, "tp_size", 1), where=where,
        plain=(getattr(lp, "use_all_gather", False) and not getattr(lp, "logits_as_input", False)
               and getattr(lp, "head_dtype", None) in (None, torch.bfloat16)),
        facts=(f"use_all_gather={getattr(lp, 'use_all_gather', None)}, "
               f"logits_as_input={getattr(lp, 'logits_as_input', None)}, "
               f"head_dtype={getattr(lp, 'head_dtype', None)}"),
        kept=finder(model, force=False)[2] if owns_gather(lp) else None)


class Drafter(NamedTuple):
    """What the drafter's install did, for the summary line (the same on every rank)."""

    name: str  # the drafter model's class
    served: tuple  # rows its draft steps take through a Lamport gather (() = stock)
    shared: bool  # through the target's gather (the same shard width), not its own
    vocab: int  # its head's full (padded) vocabulary, TP x shard width (0: no head found)
    through: tuple  # its paths through the gather ("drafter compute_logits x k")
    around: tuple  # its paths that skip the gather, with the setting that sends vLLM there
    why: str  # why it stays stock ("" when served)


def draft_model(runner):
    """The drafter's model the runner loaded (V1 ``drafter.model``, V2
    ``speculator.model``; vLLM unwraps CUDA-graph wrappers), or None: no speculative
    decoding, or a drafter with no model (n-gram, suffix decoding)."""
    get = getattr(runner, "get_draft_model", None)
    return get() if callable(get) else None


def drafter_rows(vllm_config):
    """The row counts one draft step's ``compute_logits`` gathers: the requests of a
    step (1 .. ``max_num_seqs``), times the draft tokens with parallel drafting (one
    pass drafts every token), capped (``install.decode_rows``); None when the config
    does not say."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not isinstance(seqs, int) or seqs < 1:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", None) or 1)
    return install.decode_rows(seqs, k if getattr(spec, "parallel_drafting", False) else 1)


def drafter_paths(vllm_config):
    """``(through, around)`` for the drafter's logits in vLLM 0.33 (V1
    ``llm_base_proposer._greedy_sample`` / ``_sample_draft_tokens``, V2
    ``speculator.sample_draft``): ``compute_logits`` once per draft token (once per
    step with parallel drafting), unless ``use_local_argmax_reduction`` sends greedy
    drafting to ``get_top_tokens``, an all-gather of (value, index) candidates, not of
    logits (routed by ``install_candidate_gather``); probabilistic draft sampling
    (``draft_sample_method``) still takes ``compute_logits`` for batches that are not
    all greedy."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", None) or 1)
    calls = 1 if getattr(spec, "parallel_drafting", False) else k
    logits = f"drafter compute_logits x {calls}"
    if not getattr(spec, "use_local_argmax_reduction", False):
        return (logits,), ()
    top = (f"drafter get_top_tokens x {calls} (use_local_argmax_reduction: (value, index) "
           "candidates, not logits)")
    if getattr(spec, "draft_sample_method", "greedy") == "greedy":
        return (), (top,)
    return (logits + " (probabilistic drafting of batches not all greedy)",), (top,)


def install_drafter_gather(draft, target, group, tp, rank, device, dcp=1, rows=None,
                           paths=(("drafter compute_logits x 1",), ()), *, device_group=None):
    """Route the drafter's LogitsProcessor after the target's install (every TP rank,
    the same order): a ``Drafter`` saying how.

    - No path of the drafter gathers logits (``paths``: ``drafter_paths``): nothing is
      built (no mailbox, no first-use tuning), one line.
    - Its head has the shard width of the gather the target was served by (EAGLE and
      MTP share the target's lm_head; a drafter of the same vocabulary): the target's
      gather serves it too (``install.reroute``: no collective; the gather was agreed
      by every rank, the site's facts are the same on every rank).
    - Else its own install (another vocabulary, e.g. an EAGLE3 head of 32000, or the
      target stayed stock): ``install.install`` with the drafter's ``rows``,
      collective over ``group``, agreed, fail-stop as the target's: every rank serves
      the drafter's rows or every rank keeps its stock gather; the target's outcome is
      not touched either way (its gather and mailbox are its own).

    Raises only as ``install_logits_gather`` does (a failure of this rank alone)."""
    name = type(draft).__name__
    through, around = (tuple(p) for p in paths)
    lp, head, where = find_drafter_target(draft, force=True)  # FORCE is decided agreed
    weight = getattr(head, "weight", None)
    vocab = tp * weight.shape[0] if getattr(weight, "dim", lambda: 0)() == 2 else 0
    if not through:
        why = f"no draft step gathers logits: {around[0] if around else 'see the config'}"
        logger.info("lamport-head: drafter %s not routed: %s", name, why)
        return Drafter(name, (), False, vocab, through, around, why)
    if lp is None:
        logger.info("lamport-head: stock logits gather for the drafter: %s", where)
        return Drafter(name, (), False, vocab, through, around, where)
    site = _site(draft, lp, head, where, find_drafter_target)
    target_lp = find_gather_target(target, force=True)[0] if target is not None else None
    gather = getattr(target_lp, "head_gather", None)
    with collect_log() as lines:
        if gather is not None and weight is not None and weight.shape[0] == gather.shard:
            served, shared = install.reroute(site, gather, label=f"the drafter {name}"), True
        else:
            served, shared = install.install(site, group, tp, rank, device, dcp, rows,
                                             measure=measure_first_use,
                                             device_group=device_group), False
    routed, why = served, ""
    if rows is not None:
        served = tuple(m for m in served if m in rows)  # the target's rows may reach further
    if routed and not served:
        why = f"the gather's rows {list(routed)} hold none of its rows 1..{max(rows)}"
    elif not served:
        why = (lines[-1].removeprefix("lamport-head: ").removeprefix("stock logits gather: ")
               if lines else "see the lines above")
    return Drafter(name, served, shared and bool(served), vocab, through, around, why)


# ---- the candidate gathers (issue 32 item 2) ------------------------------------------

CANDIDATE_METHODS = ("get_top_tokens", "get_top_k_tokens")  # LogitsProcessor's candidate
# reductions: each all-gathers small payloads through the module global below
_LP_MODULE = "vllm.model_executor.layers.logits_processor"
_ALL_GATHER = "tensor_model_parallel_all_gather"
_ROUTES = "_lamport_candidates"  # a processor's {(cols, dtype): SmallGather}
_ACTIVE = threading.local()  # .routes: the routes of the candidate method running now


def pair_payloads():
    """``get_top_tokens``' all-gather: fp32 ``(value, global index)`` pairs, ``[M, 2]``."""
    return ((2, torch.float32),)


def top_k_payloads(k, dtype, log_probs=False):
    """``get_top_k_tokens``' all-gathers: ``values [M, k]`` in the logits' ``dtype``,
    ``ids [M, k]`` int64, and with ``return_log_probs`` ``log_partition [M, 1]`` fp32."""
    return ((int(k), dtype), (int(k), torch.int64)) + (((1, torch.float32),) if log_probs
                                                      else ())


class Candidates(NamedTuple):
    """What the candidate gathers' install did, for the summary line (the same on
    every rank)."""

    path: str  # the path vLLM takes ("drafter get_top_tokens x 2")
    served: tuple  # ((packed width, rows served), ...) per gather built, () = stock
    why: str  # why it stays stock ("" when served)


class _Packed:
    """The install core's processor for one packed width's gather: ``gather`` (routed
    by install, ``head_gather`` once served) is, stock, the engine's all-gather of the
    packed BF16 rows, bitwise what the Lamport gather returns."""

    def __init__(self, all_gather):
        self.gather = functools.partial(all_gather, dim=-1)


def install_candidate_gather(processors, group, tp, rank, device, dcp=1, rows=None,
                             payloads=None, *, path="get_top_tokens", device_group=None):
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
    from vllm.distributed import tensor_model_parallel_all_gather

    from ..candidates import SmallGather, packed_width

    payloads = tuple(payloads or pair_payloads())
    widths = {}
    for cols, dtype in payloads:
        widths.setdefault(packed_width(cols, dtype), []).append((cols, dtype))
    names = [type(p).__name__ for p in processors]
    routes, served, lines = {}, [], []
    for width in sorted(widths):
        holder = _Packed(tensor_model_parallel_all_gather)
        what = ", ".join(f"[M, {c}] {str(d).removeprefix('torch.')}" for c, d in widths[width])
        site = install.GatherSite(
            processor=holder, attr="gather", head_tp=tp,
            weight=torch.empty((width, 0), dtype=torch.bfloat16, device="meta"),
            where=f"the {path} all-gather of {what} ({' and '.join(names)}), packed to "
                  f"{width} BF16 a rank")
        with collect_log() as said:
            rows_served = install.install(site, group, tp, rank, device, dcp, rows,
                                          measure=measure_first_use, device_group=device_group)
        lines += said
        if rows_served:
            served.append((width, rows_served))
            for cols, dtype in widths[width]:
                routes[(cols, dtype)] = SmallGather(holder.head_gather, tp, cols, dtype)
    for processor in processors:
        _route_candidates(processor, routes)
    why = "" if served else (lines[-1].removeprefix("lamport-head: ")
                             .removeprefix("stock logits gather: ")
                             .removesuffix("; stock logits gather") if lines
                             else "see the lines above")
    return Candidates(path, tuple(served), why)


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
    import importlib

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


def candidate_path(vllm_config):
    """The drafter's candidate path vLLM 0.33 takes with ``use_local_argmax_reduction``
    ("drafter get_top_tokens x k": greedy drafting; ``drafter_paths`` names it too), or
    None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if not getattr(spec, "use_local_argmax_reduction", False):
        return None
    k = int(getattr(spec, "num_speculative_tokens", None) or 1)
    return f"drafter get_top_tokens x {1 if getattr(spec, 'parallel_drafting', False) else k}"


class CandidateCaller(NamedTuple):
    """One drafter model whose ``compute_candidates`` calls ``get_top_k_tokens``: the
    model-specific knowledge of ``drafter_candidates``, checked against the real vLLM
    modules by tests/test_vllm_candidates.py (every name below must resolve there)."""

    model: str  # the draft model's class (matched along the model's MRO, nearest first)
    source: str  # the vLLM 0.33 file defining it (and its compute_candidates)
    processor: str  # the model's attribute holding the LogitsProcessor it calls
    k: str  # dotted attribute path, from the model, to the k it passes (set from its config)
    log_probs: bool  # the return_log_probs it passes (True: a log-partition gather too)


CANDIDATE_CALLERS = (
    CandidateCaller("DFlash2Qwen3ForCausalLM", "vllm/model_executor/models/qwen3_dflash2.py",
                    "candidate_logits_processor", "model.candidate_selector.top_k", False),
    CandidateCaller("LiLiCorrForCausalLM", "vllm/model_executor/models/lilicorr.py",
                    "candidate_logits_processor", "model.lilicorr.candidate_topk", True),
    CandidateCaller("DFlash2BeamForCausalLM", "vllm/models/beam/nvidia/dflash2.py",
                    "logits_processor", "model.candidate_selector.top_k", False),
)
TOP_K_PATH = "drafter get_top_k_tokens"  # the summary's name for compute_candidates' gathers


def candidate_caller(draft):
    """``(caller, processor, payloads, why)`` for a drafter model: its ``CANDIDATE_CALLERS``
    entry (None: not in the table, ``why`` says so), the LogitsProcessor its
    ``compute_candidates`` calls and the ``top_k_payloads`` it all-gathers (k from the
    model, the logits' dtype: the processor's ``head_dtype``, else the lm_head's), or
    None with ``why`` when the entry's names do not resolve on this model. A pure
    function of the model's class and config-set attributes: every rank answers alike."""
    mro = [c.__name__ for c in type(draft).__mro__]
    caller = next((c for name in mro for c in CANDIDATE_CALLERS if c.model == name), None)
    name = type(draft).__name__
    if caller is None:
        return None, None, None, (f"{name} is not in CANDIDATE_CALLERS (compute_candidates: "
                                  f"{'yes' if hasattr(draft, 'compute_candidates') else 'no'})")
    processor = getattr(draft, caller.processor, None)
    k = functools.reduce(lambda obj, attr: getattr(obj, attr, None), caller.k.split("."), draft)
    head = getattr(draft, "lm_head", None)
    head = getattr(head, "base_layer", head)
    weight = getattr(head, "weight", None)
    dtype = getattr(processor, "head_dtype", None) or getattr(weight, "dtype", None)
    where = f"{name}.{caller.processor} ({caller.source})"
    if not callable(getattr(draft, "compute_candidates", None)):
        return caller, None, None, f"{name} has no compute_candidates"
    if processor is None or not _is(processor, "LogitsProcessor"):
        return caller, None, None, f"no LogitsProcessor at {where}"
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return caller, None, None, f"{name}.{caller.k} is {k!r}, not a k"
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        return caller, None, None, f"the logits' dtype of {where} is not known ({dtype})"
    return caller, processor, top_k_payloads(k, dtype, caller.log_probs), where


def candidate_rows(vllm_config):
    """The row counts ``compute_candidates`` gathers: a draft step's requests times the
    draft tokens (vLLM 0.33's DFlash2 speculator: ``num_reqs x num_speculative_steps``),
    1 .. ``max_num_seqs`` x ``num_speculative_tokens``, capped (``install.decode_rows``);
    None when the config does not say."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not isinstance(seqs, int) or seqs < 1:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    return install.decode_rows(seqs, int(getattr(spec, "num_speculative_tokens", None) or 1))


def install_drafter_candidates(draft, group, tp, rank, device, dcp=1, rows=None, *,
                               device_group=None):
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
        logger.info("lamport-head: stock candidate all-gather for %s: %s", TOP_K_PATH, where)
        return Candidates(TOP_K_PATH, (), where)
    return install_candidate_gather([processor], group, tp, rank, device, dcp, rows, payloads,
                                    path=TOP_K_PATH, device_group=device_group)


def _cpu_group(coordinator):
    """A GroupCoordinator's CPU (gloo) group, or its device group when it has none."""
    cpu = getattr(coordinator, "cpu_group", None)
    return cpu if cpu is not None else coordinator.device_group


def _install_after_load(worker):
    from vllm.distributed import parallel_state as ps

    tp_group = ps.get_tp_group()
    try:
        dcp = ps.get_dcp_group().world_size
    except Exception:  # no DCP group in this configuration
        dcp = 1
    model = worker.model_runner.get_model()
    tp, rank = tp_group.world_size, tp_group.rank_in_group
    config = getattr(worker, "vllm_config", None)
    # The rows its decode steps gather: max running requests x (1 + draft tokens).
    rows = rows_from_vllm(config)
    cpu = _cpu_group(tp_group)  # agreement on vLLM's gloo group: a rank whose CUDA context
    # broke still reaches it
    with collect_log() as lines:
        served = install_logits_gather(model, cpu, tp, rank, worker.device, dcp, rows=rows,
                                       device_group=tp_group.device_group)
    # The drafter's model, loaded by the runner's load_model (V1 drafter.load_model, V2
    # speculator.load_model) before it returned: after the target's, on every rank.
    draft = draft_model(worker.model_runner)
    drafter = None
    if draft is not None:
        drafter = install_drafter_gather(draft, model, cpu, tp, rank, worker.device, dcp,
                                         rows=drafter_rows(config), paths=drafter_paths(config),
                                         device_group=tp_group.device_group)
    candidates = None
    path = candidate_path(config)
    if draft is not None and path is not None:
        candidates = [_install_candidates(draft, model, cpu, tp, rank, worker.device, dcp,
                                          drafter_rows(config), path, tp_group.device_group)]
    if draft is not None:  # the drafter's compute_candidates, on every rank alike
        top_k = install_drafter_candidates(draft, cpu, tp, rank, worker.device, dcp,
                                           rows=candidate_rows(config),
                                           device_group=tp_group.device_group)
        candidates = (candidates or []) + ([top_k] if top_k is not None else [])
    if rank == 0:
        through, around = logits_paths(model, config)
        logger.info("lamport-head summary: %s", summary(type(model).__name__, tp, dcp, served,
                                                        lines, through, around, drafter,
                                                        candidates))
    return served


def _install_candidates(draft, model, group, tp, rank, device, dcp, rows, path, device_group):
    """The drafter's ``get_top_tokens`` pairs routed (``install_candidate_gather``), on
    the drafter's LogitsProcessor and the target's (one gather serves both: routes are
    keyed by shape); every rank finds the same processors (the same models)."""
    found = [find_drafter_target(draft, force=True)[0], find_gather_target(model, force=True)[0]]
    processors = [p for i, p in enumerate(found) if p is not None and p not in found[:i]]
    if found[0] is None:
        why = f"no LogitsProcessor found on {type(draft).__name__}"
        logger.info("lamport-head: stock candidate all-gather for %s: %s", path, why)
        return Candidates(path, (), why)
    return install_candidate_gather(processors, group, tp, rank, device, dcp, rows,
                                    pair_payloads(), path=path, device_group=device_group)


def logits_paths(model, vllm_config):
    """``(through, around)``: the entry points vLLM 0.33's runners call for this model's
    logits that go through the routed ``_gather_logits``, and those that skip it, each
    named with the setting that sends vLLM there.

    - ``compute_logits`` (sampling; speculative verification included) gathers the
      full-vocab logits: through, unless batch-sharded sampling takes sampling.
    - ``compute_logits_local``: with ``parallel_config.enable_batch_sharded_sampling``,
      the V2 runner and a model that has it, each rank samples its share of the
      requests from an all-to-all of vocab-local logits: no gather.
    - ``get_top_tokens``: with ``speculative_config.use_local_argmax_reduction`` the
      drafter's greedy drafts all-gather (value, index) pairs, not logits."""
    parallel = getattr(vllm_config, "parallel_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    sharded = (bool(getattr(parallel, "enable_batch_sharded_sampling", False))
               and bool(getattr(vllm_config, "use_v2_model_runner", False))
               and hasattr(model, "compute_logits_local"))
    around = []
    if sharded:
        around.append("compute_logits_local (enable_batch_sharded_sampling: an all-to-all of "
                      "vocab-local logits)")
    if getattr(spec, "use_local_argmax_reduction", False):
        around.append("the drafter's get_top_tokens (use_local_argmax_reduction: an argmax "
                      "reduced across ranks)")
    return ([] if sharded else ["compute_logits"]), around


def summary(model_name, tp, dcp, served, lines, through=("compute_logits",), around=(),
            drafter=None, candidates=None):
    """Rank 0's one line for the whole TP group. Every rank takes the same outcome
    (the checks see the same inputs; the build is agreed by a MIN all-reduce).
    ``through``/``around``: ``logits_paths``; served rows are named only with the paths
    that really take the gather, and said unused when none does. ``drafter``: the
    drafter's ``Drafter`` (speculative decoding with a draft model): the target's paths
    are then named "target ...", and a clause names the drafter's paths, its rows and
    whose gather serves them (its own, or the target's), or why it stays stock.
    ``candidates``: the drafter's candidate paths' ``Candidates`` (one, or a sequence:
    ``get_top_tokens``, ``compute_candidates``' ``get_top_k_tokens``), each said in a
    clause of its own, in place of the drafter's words for that path."""
    candidates = ([candidates] if isinstance(candidates, Candidates)
                  else list(candidates or ()))
    if candidates and drafter is not None:
        paths = {c.path for c in candidates}
        drafter = drafter._replace(around=tuple(a for a in drafter.around
                                                if a.split(" (")[0] not in paths))
    if drafter is not None:
        through = [f"target {p}" for p in through]
        around = [a for a in around if not a.startswith("the drafter's")]  # said below
    head = f"{model_name}, tp={tp}, dcp={dcp}: "
    skip = f"{' and '.join(around)} skip{'s' if len(around) == 1 else ''}"
    if served and not through:
        line = head + (f"Lamport logits gather installed for rows {list(served)} on all {tp} TP "
                       f"ranks, but no step takes it: {skip} the gather")
    elif served:
        line = head + (f"Lamport logits gather for rows {list(served)} on all {tp} TP ranks, "
                       f"through {' and '.join(through)}" + (f"; {skip} it" if around else ""))
    else:
        why = (lines[-1].removeprefix("lamport-head: ").removeprefix("stock logits gather: ")
               if lines else "see the lines above")
        line = head + f"stock logits gather on all {tp} TP ranks ({why})"
    line = line if drafter is None else line + "; " + _drafter_clause(drafter)
    return "; ".join([line] + [_candidates_clause(c) for c in candidates])


def _candidates_clause(c):
    """The summary's words for a candidate path (``Candidates``)."""
    if not c.served:
        return f"{c.path}: stock candidate all-gather ({c.why})"
    gathers = ", ".join(f"rows {list(rows)} (packed width {width})" for width, rows in c.served)
    return f"{c.path}: Lamport candidate gather{'s' if len(c.served) > 1 else ''} for {gathers}"


def _drafter_clause(d):
    """The summary's words for the drafter (``Drafter``)."""
    skip = "".join(f"; {a} skips it" for a in d.around)
    if d.served:
        whose = ("the target's Lamport logits gather (its head has the target's shard width)"
                 if d.shared else f"its own Lamport logits gather (vocab {d.vocab})")
        return (f"drafter {d.name}: {whose} for rows {list(d.served)}, through "
                f"{' and '.join(d.through)}{skip}")
    if not d.through:
        return f"drafter {d.name}: no draft step gathers logits{skip}"
    return (f"drafter {d.name}: stock logits gather for {' and '.join(d.through)} "
            f"({d.why}){skip}")


def wrap_worker(worker_cls):
    """Make ``worker_cls.load_model`` install the gather afterwards (once)."""
    original = worker_cls.load_model
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # No catch-all here: install_logits_gather raises only when this rank failed
        # alone (every rank takes the agreed outcome, stock included): this rank could not
        # finish while its peers may wait in one of install's collectives. Swallowing
        # it would send this rank alone into vLLM's collectives; letting it stop the
        # worker is the fail-stop outcome (the engine stops every rank).
        _install_after_load(self)
        return result

    setattr(load_model, _MARK, True)
    worker_cls.load_model = load_model
    return True


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, at vLLM's level."""

    def emit(self, record):
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def attach_to_vllm() -> bool:
    """Route the ``lamport_head`` logger through vLLM's in this process (idempotent).

    vLLM configures only its ``vllm`` logger (handler, format, level, stream; or the
    user's ``VLLM_LOGGING_CONFIG_PATH``), so records of ours had no handler there and
    INFO lines were dropped. Each record goes to whatever the ``vllm`` logger's
    handlers are when it is emitted (a later reconfiguration is followed), at vLLM's
    level, without propagating twice; a user who configured ``lamport_head``
    themselves keeps their configuration. False when vLLM's logging is not importable
    or ours is configured already."""
    ours = logging.getLogger("lamport_head")
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return True
    if ours.handlers:
        return False
    try:
        import vllm.logger  # noqa: F401  (vLLM then configures "vllm" per process)
    except Exception:
        return False
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's level decides, in _ToVllm
    ours.propagate = False
    return True


def register():
    """The plugin entry point: harmless when called twice or without vLLM's GPU worker."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as exc:
        logger.debug("lamport-head: no vLLM GPU worker to hook (%s)", exc)
        return
    attach_to_vllm()
    if wrap_worker(Worker):
        logger.debug("lamport-head: logits gather hook registered on %s", Worker.__qualname__)
