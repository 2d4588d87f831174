"""What to route in a loaded vLLM model and its config. Pure functions of the models' classes,
config-set attributes and the vLLM config: every rank answers alike, so no answer here needs a
collective. vLLM is not imported: its classes are recognized by module and name."""

import functools
import inspect
from typing import NamedTuple

import torch

from ... import install
from ...settings import FORCE_ENV, forced
from ...table import CUSTOM_STOCK, MAX_ROWS, NCCL_STOCK
from .release import CUSTOM_GATHER, DSPARK_EXCHANGE, DSPARK_SHARDED, TARGET_EXCHANGE
from .release import STOCK_PROCESSOR as _STOCK

GATHER = "_gather_logits"

def _language_model(model):
    get = getattr(model, "get_language_model", None)
    if not callable(get):
        return None
    try:
        inner = get()
    except Exception:  # vLLM raises NotImplementedError when none is marked
        return None
    return None if inner is None or inner is model else inner


def _gather_owner(processor):
    return next((c for c in type(processor).__mro__ if "_gather_logits" in vars(c)), None)


def owns_gather(processor) -> bool:
    """True when the processor's class overrides vLLM's stock ``_gather_logits``."""
    owner = _gather_owner(processor)
    return owner is not None and (owner.__module__, owner.__qualname__) != _STOCK


def _names(code):
    found = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            found |= _names(const)
    return found


def gather_stock(processor):
    """The stock ``processor``'s route replaces: ``CUSTOM_STOCK`` where vLLM's own
    ``_gather_logits`` calls ``custom_all_gather`` (no release does yet), else NCCL's."""
    owner = None if processor is None or owns_gather(processor) else _gather_owner(processor)
    gather = inspect.unwrap(vars(owner)[GATHER]) if owner is not None else None
    code = getattr(gather, "__code__", None)
    return CUSTOM_STOCK if code is not None and CUSTOM_GATHER in _names(code) else NCCL_STOCK


def find_gather_target(model, force=None):
    """``(processor, lm_head, text)``: the processor whose ``_gather_logits`` the model calls
    (None: stock, ``text`` says why), its head (LoRA unwrapped) and where it sits. ``force``:
    route a class with its own gather (None: this process's ``LAMPORT_HEAD_FORCE``)."""
    found = _holder(model)
    if found is None:
        name = type(model).__name__
        where = f"{name} or its language model" if _language_model(model) is not None else name
        return None, None, f"no logits_processor on {where}"
    owner, path, head = found
    return _resolve(owner.logits_processor, head, path + ".logits_processor", force)


def _holder(model):
    """``(module, path, lm_head)`` holding the processor the model calls (its language
    model's first), or None."""
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
    """``find_gather_target``'s answer: LoRA's base layer; an own gather kept unless forced."""
    head = getattr(head, "base_layer", head)
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
    return any(c.__name__ == name for c in type(module).__mro__)


def find_drafter_target(model, force=None):
    """``find_gather_target`` for a drafter. MTP drafters (``DeepSeekMTP`` and kin) hold the
    processor one level down and call it with each layer's ``shared_head.head``: found as the
    only LogitsProcessor, with heads that must share one shape and TP size."""
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
    """Whether one draft pass drafts every token: 0.33's ``spec.parallel_drafting``; 0.34
    deprecates it (None) for ``spec.speculator_config.parallel_drafting``."""
    said = getattr(spec, "parallel_drafting", None)
    if said is None:
        said = getattr(getattr(spec, "speculator_config", None), "parallel_drafting", False)
    return bool(said)


def max_num_seqs(vllm_config):
    """``scheduler_config.max_num_seqs``, or None where it is not a positive int."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    return seqs if isinstance(seqs, int) and seqs >= 1 else None


def draft_tokens(spec):
    """Tokens a draft step proposes (``num_speculative_tokens``; 1 when unset or 0)."""
    return int(getattr(spec, "num_speculative_tokens", None) or 1)


def rows_from_vllm(vllm_config):
    """Decode-step row counts: 1 .. max_num_seqs x (1 + speculative tokens), capped
    (``install.decode_rows``); None when the config does not say."""
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = (getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0
    return install.decode_rows(seqs, 1 + int(k))



def draft_model(runner):
    """The drafter's model the runner loaded, or None (no drafter, or n-gram/suffix decoding)."""
    get = getattr(runner, "get_draft_model", None)
    return get() if callable(get) else None


def drafter_rows(vllm_config):
    """A draft step's ``compute_logits`` row counts: 1 .. max_num_seqs (times the draft
    tokens with parallel drafting), capped; None when the config does not say."""
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    k = draft_tokens(spec)
    return install.decode_rows(seqs, k if parallel_drafting(spec) else 1)


def drafter_paths(vllm_config):
    """``(through, around)`` for the drafter's logits (vLLM 0.33): ``compute_logits`` per draft
    token (once with parallel drafting), unless ``use_local_argmax_reduction`` sends greedy
    drafts to ``get_top_tokens``; non-greedy ``draft_sample_method`` still takes it."""
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
    """``get_top_k_tokens``' all-gathers: values ``[M, k]``, int64 ids, fp32 log-partition."""
    return ((int(k), dtype), (int(k), torch.int64)) + (((1, torch.float32),) if log_probs
                                                      else ())



def candidate_path(vllm_config):
    """The drafter's ``get_top_tokens`` path under ``use_local_argmax_reduction``, or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if not getattr(spec, "use_local_argmax_reduction", False):
        return None
    k = draft_tokens(spec)
    return f"drafter get_top_tokens x {1 if parallel_drafting(spec) else k}"


class CandidateCaller(NamedTuple):
    """A drafter model whose ``compute_candidates`` calls ``get_top_k_tokens``."""

    model: str  # matched along the model's MRO, nearest first
    source: str  # the vLLM 0.33 file defining it
    processor: str
    k: str  # dotted attribute path from the model
    log_probs: bool


CANDIDATE_CALLERS = (
    CandidateCaller("DFlash2Qwen3ForCausalLM", "vllm/model_executor/models/qwen3_dflash2.py",
                    "candidate_logits_processor", "model.candidate_selector.top_k", False),
    CandidateCaller("LiLiCorrForCausalLM", "vllm/model_executor/models/lilicorr.py",
                    "candidate_logits_processor", "model.lilicorr.candidate_topk", True),
    CandidateCaller("DFlash2BeamForCausalLM", "vllm/models/beam/nvidia/dflash2.py",
                    "logits_processor", "model.candidate_selector.top_k", False),
)
TOP_K_PATH = "drafter get_top_k_tokens"


def candidate_caller(draft):
    """``(caller, processor, payloads, text)``: the drafter's ``CANDIDATE_CALLERS`` entry (None:
    not listed), its processor and payloads (None where they do not resolve, ``text`` says why)."""
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
    """``compute_candidates``' row counts: 1 .. max_num_seqs x draft tokens, capped; None
    when the config does not say."""
    seqs = max_num_seqs(vllm_config)
    if seqs is None:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    return install.decode_rows(seqs, draft_tokens(spec))



def logits_paths(model, vllm_config):
    """``(through, around)``: the model's logits entry points that take the routed gather
    (``compute_logits``) and those that skip it, each named with the setting that sends
    vLLM there."""
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
    """vLLM's ``batch_sharded_sampling_enabled``; 0.34 lacks ``use_v2_model_runner`` (its only
    runner is V2)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return (bool(getattr(parallel, "enable_batch_sharded_sampling", False))
            and bool(getattr(vllm_config, "use_v2_model_runner", True))
            and hasattr(model, "compute_logits_local"))


class ExchangePath(NamedTuple):
    """One caller of ``all_to_all_vocab_shards`` a step takes; M is ``sum(send_splits)``."""

    path: str  # a key of release.EXCHANGE_CALLERS
    processor: object  # None: not found
    head: object
    rows: object  # M of its calls, or None when the config does not say
    where: str


def exchange_paths(model, draft, speculator, vllm_config, tp):
    """The callers of the all-to-all a step takes, the target's first; DSpark's only where its
    speculator chose at load to shard (``release.DSPARK_SHARDED``), a decision vLLM's step
    itself needs alike on every rank."""
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
    """DSpark's all-to-all row counts: M = TP x capacity x k, capacity 1 .. ceil(max_num_seqs
    / TP) (each rank sends padded rows to each), capped; None when the config does not say."""
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
    """``[(path, why), ...]``: a step's logits collectives that no Lamport gather serves and
    no install decides (the summary names each as not routed)."""
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
