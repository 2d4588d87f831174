"""Which LogitsProcessor of a loaded vLLM model to route, found the way vLLM's own code
finds a model's head, and whether routing it is ours to do.

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
  table does not. The variable is one process's environment: install looks the
  processor up with ``force=True`` and decides only once every rank said whether it
  is set (a rank deciding alone would leave its peers in a collective).

vLLM is not imported here: the stock class is recognized by its module and name.
"""

import os

FORCE_ENV = "LAMPORT_HEAD_FORCE"
_STOCK = ("vllm.model_executor.layers.logits_processor", "LogitsProcessor")


def forced() -> bool:
    return os.environ.get(FORCE_ENV, "") not in ("", "0")


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
    processor = owner.logits_processor
    path += ".logits_processor"
    head = getattr(owner, "lm_head", None)
    if head is None:
        head = next((getattr(m, "lm_head") for m, _ in owners
                     if getattr(m, "lm_head", None) is not None), None)
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
