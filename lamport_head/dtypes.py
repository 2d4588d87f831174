"""The logits dtypes a gather serves, by name: the one mapping the tables, the install
core, the build and the tools read.

A gather moves 32-bit words in 16-byte fragments (``kernels.protocol.FRAGMENT_BYTES``)
whatever the values are: a row of ``shard`` values of a dtype is ``shard x itemsize / 4``
words, and the shard width must be a whole number of fragments (8 BF16 or 4 FP32
values). Bitwise but for the armed word ``SENTINEL`` (0x80000000), which arrives as 0:
a BF16 pair (+0.0, -0.0) arrives as (+0.0, +0.0), an FP32 -0.0 as +0.0 (equal values;
only the sign of that zero is lost). One gather serves one dtype; a call of another
takes stock on every rank alike (the decision reads the call's dtype only).

Names, not torch dtypes, are what tables and votes carry (this module imports no torch
until a torch dtype is asked for).
"""

from .kernels.protocol import FRAGMENT_BYTES, WORD_BYTES

ITEMSIZE = {"bfloat16": 2, "float32": 4}  # bytes per value of each dtype served, by name
NAMES = tuple(ITEMSIZE)
BFLOAT16, FLOAT32 = NAMES
DEFAULT = BFLOAT16  # a gather built without one; a table section written without one


def name(dtype) -> str:
    """``dtype`` (a torch dtype or its name, ``"bfloat16"``/``"torch.float32"``) as the
    name tables carry; ValueError for a dtype no gather serves."""
    text = str(dtype).removeprefix("torch.")
    if text not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not served (one of {', '.join(NAMES)})")
    return text


def served(dtype) -> bool:
    """Whether ``dtype`` (a torch dtype, a name or None) is one a gather serves."""
    return dtype is not None and str(dtype).removeprefix("torch.") in ITEMSIZE


def torch_dtype(dtype):
    """The torch dtype of ``dtype`` (a name or a torch dtype)."""
    import torch  # lazy: tables and the CLI's help read this module without torch

    return getattr(torch, name(dtype))


def itemsize(dtype) -> int:
    return ITEMSIZE[name(dtype)]


def fragment(dtype) -> int:
    """Values of ``dtype`` per 16-byte fragment: a shard width must be a multiple."""
    return FRAGMENT_BYTES // itemsize(dtype)


def words(shard, dtype) -> int:
    """32-bit mailbox words a row of ``shard`` values of ``dtype`` takes (the kernel's
    ``shard_words``); ValueError when the row is not whole fragments."""
    if shard <= 0 or shard % fragment(dtype):
        raise ValueError(f"shard width {shard} is not a positive multiple of {fragment(dtype)} "
                         f"({name(dtype)}: one 16-byte fragment)")
    return shard * itemsize(dtype) // WORD_BYTES
