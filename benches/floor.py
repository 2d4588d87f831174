"""The HBM floor of one step of a collective: the bytes every rank on a GPU reads and
writes, over the device-to-device copy bandwidth measured in the same run.

The gather's (``step_bytes``) counts the protocol's own traffic: per rank and step
(S = M x V/TP BF16 values, one shard), every byte the protocol moves through a GPU's
memory once:

- its shard, read once: 1 S
- its pushes into each peer's box: TP - 1 S (they land in the peers' memory, and the
  peers' pushes land in this rank's: symmetric, so counted once per rank)
- its own box, read (polled) once: TP - 1 S
- the ``[M, V]`` output, written: TP S
- the re-arm of what it read: TP - 1 S

Total ``(4 TP - 2) S`` per rank = ``M x V x 2 B x (4 - 2/TP)``. On one GPU hosting
TP virtual ranks every rank's bytes cross the same memory, so the floor counts them
all; on real ranks a GPU sees one rank's. The bandwidth is a large ``copy_``'s bytes
read plus bytes written per second, the same convention as the byte count.

The all-to-all of vocab shards (``all_to_all_bytes``; vLLM's ``all_to_all_vocab_shards``,
M rows split ``splits`` over the ranks), what the collective itself must move: rank r
sends its ``[M, V/TP]`` shard (read once) and receives its ``[splits[r], V]`` (written
once), ``(M x V/TP + splits[r] x V) x itemsize`` bytes. On one GPU hosting every rank
that sums to ``2 x M x V x itemsize`` whatever the splits; on real ranks the floor is
the busiest rank's, ``(M x V/TP + max(splits) x V) x itemsize``: the step ends when the
rank receiving the most rows has them. It counts no protocol pass (push, poll,
re-arm), so an all-to-all's ratio to its floor is not comparable with a gather's to
its own: compare the two collectives by their GPU times, in the same run.
"""

import statistics

import torch

BF16_BYTES = 2
COPY_MIB = 512  # big enough that launch and L2 (50 MB on H200) do not matter


def step_bytes(rows: int, tp: int, vocab: int, ranks_here: int, itemsize: int = BF16_BYTES) -> int:
    """Bytes read plus written per step in the memory of a GPU hosting ``ranks_here``
    of the ``tp`` ranks (``tp``: emulated; 1: one GPU per rank), of values of
    ``itemsize`` bytes (2: BF16, 4: FP32)."""
    shard = rows * (vocab // tp) * itemsize
    per_rank = shard * (1 + (tp - 1) + (tp - 1) + tp + (tp - 1))  # see the module docstring
    return ranks_here * per_rank


def all_to_all_bytes(splits, vocab: int, ranks_here: int, itemsize: int = BF16_BYTES) -> int:
    """Bytes read plus written per all-to-all step (M = ``sum(splits)`` rows, rank r
    receiving ``splits[r]``) in the memory of a GPU hosting ``ranks_here`` of the
    ``len(splits)`` ranks: every rank (emulated, ``ranks_here`` = TP), or one (real
    ranks: the busiest's), of values of ``itemsize`` bytes (see the module docstring)."""
    tp, rows = len(splits), sum(splits)
    if ranks_here not in (1, tp):
        raise ValueError(f"a GPU hosts 1 or every one of the {tp} ranks, not {ranks_here}")
    per_rank = [(rows * (vocab // tp) + n * vocab) * itemsize for n in splits]
    return sum(per_rank) if ranks_here == tp else max(per_rank)


def floor_us(nbytes: int, bandwidth_gbs: float) -> float:
    """µs to move ``nbytes`` at ``bandwidth_gbs`` GB/s (10^9 bytes per second)."""
    return nbytes / (bandwidth_gbs * 1e9) * 1e6


def copy_bandwidth_gbs(device, mib=COPY_MIB, copies=5, reps=7) -> float:
    """Median device-to-device copy bandwidth, GB/s of bytes read plus written, of
    ``copies`` back-to-back ``copy_`` of ``mib`` MiB on the device's current stream
    (events recorded on that stream, named explicitly)."""
    device = torch.device(device)
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream(device)
    dst.copy_(src)  # warm-up: first touch of both buffers
    figures = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(copies):
            dst.copy_(src)
        end.record(stream)
        end.synchronize()
        figures.append(2 * n * copies / (start.elapsed_time(end) * 1e-3) / 1e9)
    del src, dst
    return statistics.median(figures)
