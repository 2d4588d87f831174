"""Small payloads of any dtype through the BF16 logits gather, bitwise (issue 32 item 2):
the candidate all-gathers of vocab-parallel argmax / top-k (vLLM's ``get_top_tokens``
gathers fp32 ``(value, global index)`` pairs ``[M, 2]``; ``get_top_k_tokens`` gathers
``values [M, k]`` in the logits' dtype, ``ids [M, k]`` int64 and, with log-probs, a
``log_partition [M, 1]`` fp32), with no kernel of their own.

The gather (``HeadGather``) moves BF16 rows ``[M, shard]`` (``shard`` a multiple of
``FRAGMENT_BF16``: one 16-byte fragment) bitwise, but for one 32-bit word: the mailbox's
``SENTINEL`` (``kernels.protocol``: 0x80000000, the BF16 pair (+0, -0)) means "not yet
published" and arrives as (+0, +0). A raw fp32 ``-0.0`` or an int64 holding
0x80000000 in a half would be that word. So ``pack`` widens every 16-bit half of a row
into a 32-bit word of its own whose high half is zero (little-endian: the even BF16
column holds the half, the odd one +0) and pads the words with zero words to a whole
fragment; ``unpack`` takes the low halves back.

Invariants a change must keep:

- No packed word is the sentinel: every word's high 16 bits are zero, the sentinel's
  are 0x8000 (so the gather is bitwise for every payload: -0.0, NaN payloads, +-Inf,
  any integer). Tested over all 65536 halves.
- ``unpack(gather(pack(x)))`` is ``torch.cat`` of the ranks' ``x`` along the last
  dimension: ``all_gather(x, dim=-1)``'s layout, rank-major blocks of ``cols``.
- ``SmallGather`` decides between the gather and the engine's ``stock`` from the shape
  and dtype only (rows served, ``cols``, ``dtype``), so every rank takes the same path,
  as ``HeadGather`` does; it never falls back alone.
"""

import torch
import torch.nn.functional as F

from .kernels.protocol import WORDS

_DECLINED = object()  # what the gather's stock hands back when it did not serve the rows


def packed_width(cols, dtype):
    """The BF16 shard width ``pack`` makes of a row of ``cols`` values of ``dtype``:
    two BF16 (one 32-bit word) per 16-bit half, padded to a whole fragment. Payloads
    whose rows are not whole 16-bit halves (1-byte dtypes, odd counts) are refused."""
    size = dtype.itemsize * int(cols)
    if cols < 1 or size % 2 or dtype.is_complex:
        raise ValueError(f"cannot pack rows of {cols} x {dtype}: not whole 16-bit halves")
    halves = size // 2
    words = -(-halves // WORDS) * WORDS
    return 2 * words


def pack(x):
    """``x`` ``[M, cols]`` -> BF16 ``[M, packed_width(cols, x.dtype)]``: each 16-bit
    half of a row in the low half of a word of its own (even column), +0 above it (odd
    column), zero words after. No word is the sentinel (module docstring)."""
    m, cols = x.shape
    width = packed_width(cols, x.dtype)
    halves = _dense(x).view(torch.int16).view(m, -1, 1)
    packed = F.pad(halves, (0, 1, 0, width // 2 - halves.shape[1]))  # one kernel
    return packed.view(m, width).view(torch.bfloat16)


def unpack(gathered, tp, cols, dtype):
    """The gathered ``[M, tp x packed_width]`` BF16 -> ``[M, tp x cols]`` of ``dtype``:
    ``torch.cat`` of the ranks' payloads (``all_gather(x, dim=-1)``'s layout)."""
    m = gathered.shape[0]
    width = packed_width(cols, dtype)
    halves = dtype.itemsize * cols // 2
    low = _dense(gathered).view(torch.int16).view(m, tp, width // 2, 2)[:, :, :halves, 0]
    return _dense(low).view(dtype).view(m, tp * cols)


def _dense(t):
    """``t`` with row-major strides: a dtype view needs a unit last stride, which
    ``contiguous()`` leaves out for size-1 dimensions."""
    standard, step = [], 1
    for size in reversed(t.shape):
        standard.append(step)
        step *= size
    if t.stride() == tuple(reversed(standard)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class SmallGather:
    """``small(x, stock)``: ``x`` ``[M, cols]`` of ``dtype`` gathered across ``tp``
    ranks to ``[M, tp x cols]`` through ``gather`` (a ``HeadGather``-like callable
    ``gather(bf16 [M, packed_width], stock)``, served for the rows it serves); any
    other shape or dtype, and rows the gather does not serve, take ``stock(x)``: the
    engine's own all-gather of the original tensor. Decided by shape and dtype only."""

    def __init__(self, gather, tp, cols, dtype):
        self.gather, self.tp, self.cols, self.dtype = gather, int(tp), int(cols), dtype
        self.width = packed_width(cols, dtype)

    def __call__(self, x, stock):
        if x.dim() != 2 or x.shape[1] != self.cols or x.dtype != self.dtype:
            return stock(x)
        rows = getattr(self.gather, "rows", None)
        if rows is not None and x.shape[0] not in rows:
            return stock(x)  # no packing for rows the gather would decline
        out = self.gather(pack(x), stock=lambda packed: _DECLINED)
        if out is _DECLINED:
            return stock(x)
        return unpack(out, self.tp, self.cols, self.dtype)

    def __repr__(self):
        return (f"SmallGather({self.cols} x {self.dtype} over {self.tp} ranks, packed width "
                f"{self.width})")

