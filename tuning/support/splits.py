"""The send splits an all-to-all of vocab shards is verified and timed with: a step's M
logits rows split over the TP ranks the way vLLM's batch-sharded sampling splits them
(``BatchSharder.shard_sampler_inputs``, vLLM 0.34), drawn deterministically per (M, TP,
draw), so every rank draws the same splits with no collective (the engine's ranks
agree the same way: every rank computes them from the batch it holds).

How vLLM's arise: whole requests go to ranks, request i of the batch to rank i % TP
(``shard_owners``), or, with a sharded draft-logits cache, to the rank that drafted it
(the batch positions of the step that drafted, which requests finishing and joining
since have shifted: a rotation of round-robin); a request's rows are its logits, 1 plus
its draft tokens (under adaptive verification the admitted ones, so one step's requests
differ); a rank's split (``num_logits_per_rank``) is the sum of its requests' rows.
Hence splits that differ by whole request sizes, and ranks of 0 rows when a step has
fewer requests than ranks (always at M < TP).
"""

import random

# A request's logits rows: 1 plus its admitted draft tokens, of up to 3 drafted (a usual
# num_speculative_tokens).
REQUEST_ROWS = (1, 2, 3, 4)


def vllm_splits(rows, tp, draw=0):
    """``rows`` rows over ``tp`` ranks as vLLM's batch sharding makes them (module
    docstring): requests of ``REQUEST_ROWS`` rows each (the last cut to what is left)
    dealt round-robin from a drawn first rank. A list of ``tp`` non-negative ints
    summing to ``rows``, the same for the same arguments in every process (``random``'s
    string seeding hashes the string itself: no per-process hash salt); ``draw`` picks
    another step of the same M."""
    rng = random.Random(f"lamport-head splits: rows {rows}, tp {tp}, draw {draw}")
    splits, left = [0] * tp, rows
    owner = rng.randrange(tp)
    while left:
        request = min(rng.choice(REQUEST_ROWS), left)
        splits[owner] += request
        owner, left = (owner + 1) % tp, left - request
    return splits
