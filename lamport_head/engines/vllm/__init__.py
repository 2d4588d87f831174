"""vLLM adapter: the general plugin (entry point ``vllm.general_plugins`` ->
``lamport_head``: ``register``), the explicit ``install_logits_gather`` on a loaded vLLM
model, and which LogitsProcessor of that model to route.

Modules, one job each (imports point down the list; vLLM is imported only in this
package, lazily):

- ``release``: the releases tested (``RELEASES``) and the names the adapter relies on,
  checked against the running vLLM before any collective: one missing, every rank keeps
  vLLM's gathers (one WARNING line); a release outside the window with every name
  present serves, with one WARNING line.
- ``find``: what to route in a loaded model and its config (the processor whose
  ``_gather_logits`` the model really calls, for the target and the drafter; the rows
  its steps gather; the paths its steps take through and around that gather; the
  drafters' candidate callers; the logits collectives of other kinds, not routed).
- ``candidates``: the candidate gathers (``get_top_tokens``, ``get_top_k_tokens``).
- ``vocab_shards``: vLLM 0.34's all-to-all of vocab shards (batch-sharded sampling,
  DSpark's sharded drafting) on Lamport all-to-alls, each caller's module global routed.
- ``summary``: rank 0's line, from the installs' ``Outcome`` values.
- ``route``: the installs and the worker hook (``register``, ``wrap_worker``), and our
  log lines through vLLM's handlers (``attach_to_vllm``).

``register()`` wraps the GPU worker's ``load_model`` so that, once the model is loaded
(before any CUDA graph capture), every TP worker installs with the TP group (one
``outcome.Ranks``: vLLM's gloo group for agreement, its device group for timing the
stock gather), its device, the DCP size and the rows its decode steps gather
(``rows_from_vllm``: 1 .. max_num_seqs x (1 + num_speculative_tokens), capped). vLLM
loads general plugins in every process and possibly more than once: wrapping is
idempotent. Install's outcome (stock included) is agreed by every TP rank; an
exception out of it is never swallowed, since the rank it left would enter vLLM's
collectives out of step with its peers. Rank 0 adds a one-line summary naming the
release and every logits collective of a step.

Speculative decoding: the runner's ``load_model`` loads the drafter's model too
(``speculator.load_model``: EAGLE, EAGLE3, MTP, draft-model speculation), so once the
target is installed every rank installs on the drafter's model
(``install_drafter_gather``): served by the target's gather when its head has the
target's shard width (no second mailbox, no collective), else by its own install
(agreed, fail-stop as the target's). With ``use_local_argmax_reduction`` greedy drafts
take ``get_top_tokens`` (candidates, not logits), routed by the candidate gathers, as
are the drafters' ``compute_candidates`` (``CANDIDATE_CALLERS``).

Batch-sharded sampling (``enable_batch_sharded_sampling``): each rank samples its share
of the requests from an all-to-all of vocab-local logits, not a gather. On vLLM 0.34
every rank then installs Lamport all-to-alls (``install_exchanges``) for the callers of
``all_to_all_vocab_shards`` a step takes (``exchange_paths``: ``GPUModelRunner.sample``,
DSpark's sharded sequential sampling), one per shard width and dtype, agreed and
fail-stop as the gather's; on 0.33 (``all_to_all_logits``) that path stays vLLM's.

Which processor (``find_gather_target``), found the way vLLM's own code finds a model's
head: multimodal wrappers' ``get_language_model()`` first; LoRA's base layer; a
processor whose class overrides ``_gather_logits`` (DeepSeek V4.1's) keeps it unless
``LAMPORT_HEAD_FORCE=1`` on every rank (decided agreed by the install core).

vLLM's out-of-tree layer seam (``PluggableLayer.register_oot`` for
"logits_processor") replaces a layer class by its registered name when the model is
built; it is not used: it would replace vLLM's whole LogitsProcessor, not its gather,
and model-specific subclasses (DeepSeek V4.1's, LoRA's wrapper, a drafter's own) are
other classes it does not cover, while the routing here reaches the instance the model
really calls, whatever its class.
"""

from .candidates import (CANDIDATE_METHODS, Candidates, install_candidate_gather,
                         install_drafter_candidates, install_pair_candidates)
from .find import (CANDIDATE_CALLERS, GATHER, TOP_K_PATH, CandidateCaller, ExchangePath,
                   batch_sharded, candidate_caller, candidate_path, candidate_rows, draft_model,
                   drafter_paths, drafter_rows, dspark_rows, exchange_paths, find_drafter_target,
                   find_gather_target, logits_paths, other_collectives, owns_gather,
                   pair_payloads, rows_from_vllm, top_k_payloads)
from .release import RELEASES
from .route import (Drafter, attach_to_vllm, install_drafter_gather, install_logits_gather,
                    register, wrap_worker)
from .summary import summary
from .vocab_shards import Exchange, install_exchanges

__all__ = [
    "CANDIDATE_CALLERS", "CANDIDATE_METHODS", "GATHER", "RELEASES", "TOP_K_PATH",
    "CandidateCaller", "Candidates", "Drafter", "Exchange", "ExchangePath", "attach_to_vllm",
    "batch_sharded", "candidate_caller", "candidate_path", "candidate_rows", "draft_model",
    "drafter_paths", "drafter_rows", "dspark_rows", "exchange_paths", "find_drafter_target",
    "find_gather_target", "install_candidate_gather", "install_drafter_candidates",
    "install_drafter_gather", "install_exchanges", "install_logits_gather",
    "install_pair_candidates", "logits_paths", "other_collectives", "owns_gather",
    "pair_payloads", "register", "rows_from_vllm", "summary", "top_k_payloads", "wrap_worker",
]
