"""What to route in a loaded vLLM model and its config: the LogitsProcessor whose gather
the model really calls (target, drafter), the row counts its steps gather, the paths
its steps take through or around that gather, the drafters' candidate callers, and the
callers of vLLM 0.34's all-to-all of vocab shards a step takes (``exchange_paths``).

Pure functions of the model's classes, its config-set attributes and the vLLM config
(``exchange_paths`` also reads the DSpark speculator's own load-time decision, which
vLLM's step needs alike on every rank): every rank answers alike, so no answer here
needs a collective. vLLM is not imported: its classes are recognized by module and name.
"""

import functools
import inspect
from typing import NamedTuple

import torch

from ... import install
from ...settings import FORCE_ENV, forced
from ...table import CUSTOM_STOCK, MAX_ROWS, NCCL_STOCK
from .release import CUSTOM_GATHER, DSPARK_EXCHANGE, DSPARK_SHARDED, TARGET_EXCHANGE
from .release import STOCK_PROCESSOR as _STOCK  # vLLM's own LogitsProcessor class

GATHER = "_gather_logits"  # vLLM LogitsProcessor's gather: [M, V/TP] -> [M, V]

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


def _names(code):
    """Every global and attribute name ``code`` and the code nested in it (closures,
    comprehensions) refer to."""
    found = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            found |= _names(const)
    return found


def gather_stock(processor):
    """The stock the route of ``processor``'s gather replaces (``table.STOCKS``), read off
    the code of vLLM's own ``LogitsProcessor._gather_logits``: ``CUSTOM_STOCK`` where it
    calls ``CudaCommunicator.custom_all_gather`` (no release does yet: vLLM PR 57856
    would), so only a section measured against that one-shot gather serves it and
    first-use tuning times it; else NCCL's all-gather. A processor whose class has its
    own gather (routed only when forced) is keyed by NCCL's, as before. A pure function
    of the processor's class: every rank answers alike."""
    owner = None if processor is None or owns_gather(processor) else _gather_owner(processor)
    gather = inspect.unwrap(vars(owner)[GATHER]) if owner is not None else None
    code = getattr(gather, "__code__", None)
    return CUSTOM_STOCK if code is not None and CUSTOM_GATHER in _names(code) else NCCL_STOCK


def find_gather_target(model, force=None):
    """``(processor, lm_head, text)``.

    ``processor``: the object whose ``_gather_logits`` the model really calls (set as
    an instance attribute to route it), or None to stay stock, ``text`` then saying
    why. When found, ``lm_head`` is the vocab-parallel head (unwrapped from LoRA) and
    ``text`` says where the processor sits and anything about how it is routed.
    ``force``: route a processor whose class has its own gather; None reads this
    process's ``LAMPORT_HEAD_FORCE``. A pure function of the model and ``force``."""
    found = _holder(model)
    if found is None:
        name = type(model).__name__
        where = f"{name} or its language model" if _language_model(model) is not None else name
        return None, None, f"no logits_processor on {where}"
    owner, path, head = found
    return _resolve(owner.logits_processor, head, path + ".logits_processor", force)


def _holder(model):
    """``(module, path, lm_head)``: the module holding the LogitsProcessor the model
    calls (its language model's first, then its own) and the head beside it (else the
    other's), or None when neither holds one."""
    name = type(model).__name__
    inner = _language_model(model)
    owners = [(m, path) for m, path in ((inner, f"{name}.get_language_model()"), (model, name))
              if m is not None]
    found = next(((m, path) for m, path in owners
                  if getattr(m, "logits_processor", None) is not None), None)
    if found is None:
        return None
    owner, path = found
    head = getattr(owner, "lm_head", None)
    if head is None:
        head = next((getattr(m, "lm_head") for m, _ in owners
                     if getattr(m, "lm_head", None) is not None), None)
    return owner, path, head


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
    if processor is not None or _holder(model) is not None:
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


def parallel_drafting(spec):
    """Whether one draft pass drafts every token: vLLM 0.33's
    ``speculative_config.parallel_drafting``; 0.34 deprecates that field (None) for the
    speculator's class attribute ``speculative_config.speculator_config.parallel_drafting``
    (DFlash and its kin)."""
    said = getattr(spec, "parallel_drafting", None)
    if said is None:
        said = getattr(getattr(spec, "speculator_config", None), "parallel_drafting", False)
    return bool(said)


def max_num_seqs(vllm_config):
    """The server's most running requests (``scheduler_config.max_num_seqs``), or None
    when the config does not say (not a positive int)."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    return seqs if isinstance(seqs, int) and seqs >= 1 else None


def draft_tokens(spec):
    """Tokens a draft step proposes (``num_speculative_tokens``; 1 when unset or 0)."""
    return int(getattr(spec, "num_speculative_tokens", None) or 1)


def rows_from_vllm(vllm_config):
    """The row counts a vLLM server's decode steps can gather: 1 .. max running
    requests x (1 + speculative tokens per request), capped (``install.decode_rows``); None when
    the config does not say."""
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = (getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0
    return install.decode_rows(seqs, 1 + int(k))



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
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = draft_tokens(spec)
    return install.decode_rows(seqs, k if parallel_drafting(spec) else 1)


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
    k = draft_tokens(spec)
    calls = 1 if parallel_drafting(spec) else k
    logits = f"drafter compute_logits x {calls}"
    if not getattr(spec, "use_local_argmax_reduction", False):
        return (logits,), ()
    top = (f"drafter get_top_tokens x {calls} (use_local_argmax_reduction: (value, index) "
           "candidates, not logits)")
    if getattr(spec, "draft_sample_method", "greedy") == "greedy":
        return (), (top,)
    return (logits + " (probabilistic drafting of batches not all greedy)",), (top,)



def pair_payloads():
    """``get_top_tokens``' all-gather: fp32 ``(value, global index)`` pairs, ``[M, 2]``."""
    return ((2, torch.float32),)


def top_k_payloads(k, dtype, log_probs=False):
    """``get_top_k_tokens``' all-gathers: ``values [M, k]`` in the logits' ``dtype``,
    ``ids [M, k]`` int64, and with ``return_log_probs`` ``log_partition [M, 1]`` fp32."""
    return ((int(k), dtype), (int(k), torch.int64)) + (((1, torch.float32),) if log_probs
                                                      else ())



def candidate_path(vllm_config):
    """The drafter's candidate path vLLM 0.33 takes with ``use_local_argmax_reduction``
    ("drafter get_top_tokens x k": greedy drafting; ``drafter_paths`` names it too), or
    None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if not getattr(spec, "use_local_argmax_reduction", False):
        return None
    k = draft_tokens(spec)
    return f"drafter get_top_tokens x {1 if parallel_drafting(spec) else k}"


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
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    return install.decode_rows(seqs, draft_tokens(spec))



def logits_paths(model, vllm_config):
    """``(through, around)``: the entry points vLLM's runners call for this model's
    logits that go through the routed ``_gather_logits``, and those that skip it, each
    named with the setting that sends vLLM there.

    - ``compute_logits`` (sampling; speculative verification included) gathers the
      full-vocab logits: through, unless batch-sharded sampling takes sampling.
    - ``compute_logits_local``: with ``parallel_config.enable_batch_sharded_sampling``,
      the V2 runner (0.33: ``use_v2_model_runner``; 0.34 has no other runner and no such
      field) and a model that has it (``batch_sharded``), each rank samples its share of
      the requests from an all-to-all of vocab-local logits: no gather. That all-to-all
      is a path of its own (``exchange_paths``: 0.34's ``all_to_all_vocab_shards``).
    - ``get_top_tokens``: with ``speculative_config.use_local_argmax_reduction`` the
      drafter's greedy drafts all-gather (value, index) pairs, not logits."""
    spec = getattr(vllm_config, "speculative_config", None)
    sharded = batch_sharded(model, vllm_config)
    around = []
    if sharded:
        around.append("compute_logits_local (enable_batch_sharded_sampling: an all-to-all of "
                      "vocab-local logits, not a gather)")
    if getattr(spec, "use_local_argmax_reduction", False):
        around.append("the drafter's get_top_tokens (use_local_argmax_reduction: an argmax "
                      "reduced across ranks)")
    return ([] if sharded else ["compute_logits"]), around



def batch_sharded(model, vllm_config):
    """Whether the target samples batch-sharded (vLLM's ``batch_sharded_sampling_enabled``
    on the V2 runner): ``parallel_config.enable_batch_sharded_sampling``, a model with
    ``compute_logits_local``, and 0.33's ``use_v2_model_runner`` (0.34 has no such field:
    its only runner is the V2 one)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return (bool(getattr(parallel, "enable_batch_sharded_sampling", False))
            and bool(getattr(vllm_config, "use_v2_model_runner", True))
            and hasattr(model, "compute_logits_local"))


class ExchangePath(NamedTuple):
    """One caller of vLLM 0.34's ``all_to_all_vocab_shards`` a step takes: it exchanges
    the vocab-local logits of ``processor`` (computed with ``head``: the shard width)
    for ``rows`` row counts M (the rows of a call: ``sum(send_splits)``, the same on
    every rank)."""

    path: str  # the caller (a key of release.EXCHANGE_CALLERS)
    processor: object  # the LogitsProcessor whose logits it exchanges (None: not found)
    head: object  # that processor's vocab-parallel lm_head (None: not found)
    rows: object  # the row counts M of its calls (tuple), or None when the config does not say
    where: str  # where the processor sits (or why none was found), for the lines


def exchange_paths(model, draft, speculator, vllm_config, tp):
    """``[ExchangePath, ...]``: the callers of the all-to-all of vocab shards a step takes,
    the target's first.

    - ``GPUModelRunner.sample``: the target samples batch-sharded (``batch_sharded``):
      M is the step's logits rows, as the gather's (``rows_from_vllm``).
    - ``DSparkSpeculator._sample_sequential_sharded``: DSpark drafting (``method``
      "dspark") on a batch-sharded target, its draft model with
      ``compute_draft_logits_local``, and the speculator's own load-time decision to shard
      (``release.DSPARK_SHARDED`` set; it keeps sampling replicated, e.g. without PyNCCL
      or with the acceptance estimator, and vLLM's step itself needs that decision alike
      on every rank): M = TP x capacity x num_speculative_tokens (``dspark_rows``).
    """
    if not batch_sharded(model, vllm_config):
        return []
    lp, head, where = find_gather_target(model, force=True)
    out = [ExchangePath(TARGET_EXCHANGE, lp, head, rows_from_vllm(vllm_config), where)]
    spec = getattr(vllm_config, "speculative_config", None)
    if (draft is not None and str(getattr(spec, "method", "") or "") == "dspark"
            and hasattr(draft, "compute_draft_logits_local")
            and getattr(speculator, DSPARK_SHARDED, None) is not None):
        lp, head, where = find_drafter_target(draft, force=True)
        out.append(ExchangePath(DSPARK_EXCHANGE, lp, head, dspark_rows(vllm_config, tp),
                                f"the drafter {type(draft).__name__}: {where}"))
    return out


def dspark_rows(vllm_config, tp):
    """The row counts of DSpark's sharded all-to-all: every rank sends ``capacity =
    ceil(requests / TP)`` requests' ``num_speculative_tokens`` rows to each rank (padding
    included), so M = TP x capacity x k for 1 <= capacity <= ceil(max_num_seqs / TP),
    capped at ``table.MAX_ROWS``; None when the config does not say."""
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = draft_tokens(spec)
    rows = tuple(tp * c * k for c in range(1, -(-seqs // tp) + 1))
    return tuple(m for m in rows if m <= MAX_ROWS) or None


def _mro(obj):
    return [c.__name__ for c in type(obj).__mro__]


def other_collectives(model, draft, vllm_config):
    """``[(path, why), ...]``: the logits collectives of a step that no Lamport gather
    serves, each with why it is not routed (the summary names them, never as routed).
    From the models' classes and attributes and the config, the same on every rank.

    - Kimi K3's specialized drafter (``SpecializedK3DSparkForCausalLM``): its draft
      logits go through its own multicast mailbox (``comm.gather_logits``, built at
      load: ``_drafter_comm.logits``) for the shapes it accepts; the others fall to the
      LogitsProcessor's gather, which the drafter's install routes.
    - Muse Spark's Markov sampler (``VocabParallelMarkovHead`` with a vocab-sharded
      ``markov_w2``): its own all-gather of the draft vocabulary shard
      (``sp_all_gather``), outside any LogitsProcessor.
    - XPress drafts gather 3-D logits ``[requests, 1 + k, V/TP]``; the Lamport gather
      serves 2-D logits, so vLLM's own gather serves those.
    DeepSeek V4.1's processor, whose class has its own gather, is the target's
    outcome (``Reason.OWN_GATHER``), not repeated here; the all-to-alls of vocab shards
    (batch-sharded sampling, DSpark's sharded sequential sampling) are paths of their own
    (``exchange_paths``), each with its outcome."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(spec, "method", "") or "")
    out = []
    if draft is None:
        return out
    name = type(draft).__name__
    comm = getattr(draft, "_drafter_comm", None)
    if "SpecializedK3DSparkForCausalLM" in _mro(draft) or getattr(comm, "logits", None):
        out.append((f"drafter {name} comm.gather_logits",
                    "Kimi K3's own multicast mailbox for the rows it accepts; its other rows "
                    "fall to the LogitsProcessor's gather"))
    head = getattr(getattr(draft, "model", None), "markov_head", None)
    if (type(head).__name__ == "VocabParallelMarkovHead"
            and getattr(getattr(head, "markov_w2", None), "tp_size", 1) > 1):
        out.append((f"drafter {name} Markov sampler sp_all_gather",
                    "Muse Spark's own all-gather of the draft vocabulary shard, outside any "
                    "LogitsProcessor"))
    if method == "xpress":
        out.append((f"drafter {name} compute_draft_logits",
                    "3-D logits [requests, 1 + k, V/TP]: vLLM's own gather (the Lamport "
                    "gather serves 2-D logits)"))
    return out
