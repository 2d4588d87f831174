"""The gather's and the all-to-all's exact expected results, in plain torch (any device).

``reference_gather(shards)``: the shards concatenated along the vocab axis (NCCL
all-gather's layout), with every 32-bit word equal to the sentinel replaced by 0, the
one change the Lamport protocol makes to the bytes: the BF16 pair (+0, -0) becomes
(+0, +0), the FP32 -0.0 becomes +0.0 (``lamport_head.dtypes``). BF16 and FP32 shards
alike: the protocol moves words, whatever the values.
``reference_all_to_all(shards, send_splits)``: rank q's rows of every shard, so
concatenated, with the same one change.
"""

import torch

from lamport_head.dtypes import served
from lamport_head.kernels.protocol import SENTINEL_I32 as SENTINEL


def scrub(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (BF16 with an even last dim, or FP32) with sentinel words made 0."""
    words = logits.contiguous().view(torch.int32)
    return words.masked_fill(words == SENTINEL, 0).view(logits.dtype)


def reference_gather(shards) -> torch.Tensor:
    """``[M, V]`` from the ranks' ``[M, V/TP]`` shards (BF16 or FP32, all one dtype),
    sentinel words scrubbed."""
    shards = list(shards)
    if not shards:
        raise ValueError("reference_gather needs at least one shard")
    for s in shards:
        if (not served(s.dtype) or s.dtype != shards[0].dtype or s.dim() != 2
                or s.shape != shards[0].shape):
            raise ValueError("shards must be equal-shaped 2-D tensors of one served dtype "
                             "(bfloat16 or float32)")
        if s.shape[1] * s.element_size() % 4:
            raise ValueError("shard rows must be whole 32-bit words")
    return scrub(torch.cat(shards, dim=1))


def offsets_of(send_splits) -> list:
    """The row offsets of ``send_splits`` (its prefix sums, from 0): rank q's rows of
    every shard are ``offsets[q]:offsets[q + 1]``; the all-to-all kernel's argument."""
    offsets = [0]
    for n in send_splits:
        if int(n) != n or n < 0:
            raise ValueError(f"send_splits must be non-negative ints, got {list(send_splits)}")
        offsets.append(offsets[-1] + int(n))
    return offsets


def reference_all_to_all(shards, send_splits) -> list:
    """Rank q's ``[send_splits[q], V]`` output for every q, from the ranks' ``[M, V/TP]``
    shards (BF16 or FP32, as ``reference_gather``'s) (``M = sum(send_splits)``, the same splits on every rank): rows
    ``offsets[q]:offsets[q + 1]`` of every shard, in rank order along the vocab axis,
    sentinel words scrubbed (vLLM's ``all_to_all_vocab_shards``)."""
    shards = list(shards)
    if len(send_splits) != len(shards):
        raise ValueError(f"{len(send_splits)} splits for {len(shards)} ranks")
    offsets = offsets_of(send_splits)
    full = reference_gather(shards)  # checks the shards
    if offsets[-1] != full.shape[0]:
        raise ValueError(f"send_splits {list(send_splits)} sum to {offsets[-1]}, the shards "
                         f"hold {full.shape[0]} rows")
    return [full[offsets[q]:offsets[q + 1]] for q in range(len(shards))]


SPECIAL = (SENTINEL, 0x00008000, -0x80000000 | 0x3F80, 0x3F808000, 0, 0x7FC07FC0,
           0x7F80FF80, -0x00800000 | 0x7FC0, 0x7FFF7FFF, 0x00010001, -0x7FFF0000 | 0x007F)
"""Planted BF16 words: the sentinel, -0 in the low half, -0 high with 1.0 low, -0 low
with 1.0 high, (+0, +0), NaN pairs, (+Inf, -Inf), (NaN, -Inf), (max NaN payloads),
(smallest denormal, smallest denormal), (-smallest denormal high, largest denormal low)."""

SPECIAL_FP32 = (SENTINEL, 0, 0x7FC00000, 0x7FFFFFFF, -0x003FFFFF, 0x7F800000, -0x00800000,
                0x00000001, -0x7FFFFFFF, 0x007FFFFF, -0x7F800001, 0x00008000, 0x3F800000,
                0x00800000, 0x7F7FFFFF)
"""Planted FP32 words: the sentinel (-0.0), +0.0, quiet NaN, the max NaN payload, a
negative NaN (0xFFC00001), +Inf, -Inf, the smallest denormal, minus it (0x80000001),
the largest denormal, minus it (0x807FFFFF), the BF16 word (-0, +0) read as FP32 (a
denormal), 1.0, the smallest normal, the largest finite."""

PLANTED = {torch.bfloat16: SPECIAL, torch.float32: SPECIAL_FP32}  # per dtype served


def planted(*shape, generator=None, device="cpu", dtype=torch.bfloat16) -> torch.Tensor:
    """Random ``dtype`` values (BF16, last dim even; or FP32) of ``shape`` with the words
    a gather must get right planted at random places: every one of ``PLANTED[dtype]``,
    about 1 word in 64.

    Deterministic for a seeded ``generator`` on any device (elementwise choices, no
    scatter whose duplicate indices a GPU may resolve either way): processes that
    share a seed build the same shards, so each can check a gather on its own."""
    specials = PLANTED[dtype]
    data = torch.randn(*shape, generator=generator, device=device).to(dtype)
    words = data.view(torch.int32).view(-1)
    n = words.numel()
    special = torch.tensor(specials, dtype=torch.int32, device=device)
    pick = torch.randint(0, 64 * len(specials), (n,), generator=generator, device=device)
    hit = pick < len(specials)
    words.copy_(torch.where(hit, special[pick.clamp(max=len(specials) - 1)], words))
    if n >= len(specials):  # the first words hold every special for certain
        words[: len(specials)] = special
    return data
