"""vLLM adapter (docs/engines.md, "vLLM"): release, find, candidates, vocab_shards, summary,
route, one job each, each importing only those before it.
vLLM is imported only in this package, lazily. vLLM may load the plugin more than once per
process: ``register`` is idempotent. vLLM's ``PluggableLayer.register_oot`` is not used: it
replaces the whole LogitsProcessor class, not its gather, and misses model-specific subclasses."""

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
