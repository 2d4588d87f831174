"""The logits dtypes served, by name (what tables and votes carry; torch is imported only
for a torch dtype). A row is 32-bit words in whole 16-byte fragments, bitwise but for the
sentinel word (docs/design.md, "The mailbox")."""

from .kernels.protocol import FRAGMENT_BYTES, WORD_BYTES

ITEMSIZE = {"bfloat16": 2, "float32": 4}
NAMES = tuple(ITEMSIZE)
BFLOAT16, FLOAT32 = NAMES
DEFAULT = BFLOAT16  # a gather or a table section given none


def name(dtype) -> str:
    """``dtype`` (a torch dtype or a name) as tables spell it; ValueError if not served."""
    text = str(dtype).removeprefix("torch.")
    if text not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not served (one of {', '.join(NAMES)})")
    return text


def served(dtype) -> bool:
    return dtype is not None and str(dtype).removeprefix("torch.") in ITEMSIZE


def torch_dtype(dtype):
    import torch  # lazy: tables and the CLI's help read this module without torch

    return getattr(torch, name(dtype))


def itemsize(dtype) -> int:
    return ITEMSIZE[name(dtype)]


def fragment(dtype) -> int:
    """Values of ``dtype`` per 16-byte fragment: a shard width must be a multiple."""
    return FRAGMENT_BYTES // itemsize(dtype)


def words(shard_width, dtype) -> int:
    """32-bit words a row of ``shard_width`` values takes; ValueError unless whole fragments."""
    if shard_width <= 0 or shard_width % fragment(dtype):
        raise ValueError(f"shard width {shard_width} is not a positive multiple of "
                         f"{fragment(dtype)} ({name(dtype)}: one 16-byte fragment)")
    return shard_width * itemsize(dtype) // WORD_BYTES
