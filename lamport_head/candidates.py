"""Small payloads of any dtype (vLLM's top-token candidates) through the BF16 logits gather,
bitwise, with no kernel of their own. The gather moves BF16 rows bitwise but for one word,
the mailbox's ``SENTINEL`` (0x80000000, arriving as (+0, +0)), which an fp32 ``-0.0`` or an
int64's half could be. So ``pack`` puts each 16-bit half of a row in the low half of a word
of its own, high half zero (never the sentinel), padded to a whole fragment; ``unpack``
takes the halves back in ``all_gather(x, dim=-1)``'s layout. ``SmallGather`` decides by
shape and dtype only, as ``HeadGather`` does.
"""

import torch
import torch.nn.functional as F

from .kernels.protocol import WORDS

_DECLINED = object()  # what the gather's stock hands back when it did not serve the rows


def packed_width(cols, dtype):
    """The BF16 shard width ``pack`` makes of ``cols`` values of ``dtype``; rows that are not
    whole 16-bit halves (1-byte dtypes, odd counts) are refused."""
    size = dtype.itemsize * int(cols)
    if cols < 1 or size % 2 or dtype.is_complex:
        raise ValueError(f"cannot pack rows of {cols} x {dtype}: not whole 16-bit halves")
    halves = size // 2
    words = -(-halves // WORDS) * WORDS
    return 2 * words


def pack(x):
    """``x`` ``[M, cols]`` -> BF16 ``[M, packed_width(cols, x.dtype)]`` (module docstring)."""
    m, cols = x.shape
    width = packed_width(cols, x.dtype)
    halves = _dense(x).view(torch.int16).view(m, -1, 1)
    packed = F.pad(halves, (0, 1, 0, width // 2 - halves.shape[1]))
    return packed.view(m, width).view(torch.bfloat16)


def unpack(gathered, tp, cols, dtype):
    """The gathered ``[M, tp x packed_width]`` BF16 -> ``[M, tp x cols]`` of ``dtype``."""
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
    """``small(x, stock)``: ``x`` ``[M, cols]`` of ``dtype`` gathered to ``[M, tp x cols]``
    through ``gather`` (``HeadGather``-like) for the rows it serves; else ``stock(x)``."""

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

