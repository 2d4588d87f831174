"""One rank's lm_head shard, the kernel that precedes the gather in a decode step:
``[M, hidden] x [hidden, V/TP]`` BF16 with ``torch.mm`` into a preallocated output.

Invariant: a call allocates nothing (the output is the one buffer, overwritten), so it
can be captured in a CUDA graph and timed beside the gather without allocator noise;
the gather reads that output, so it depends on the GEMM as it does in a model.
torch is imported inside the class, so the CLI reads ``KIMI_K2_HIDDEN`` cheaply.
"""

KIMI_K2_HIDDEN = 7168  # Kimi K2's hidden size: the lm_head's input width
_SCALE = 0.02  # keeps the products finite (no inf/NaN in the logits the gather moves)


class LmHead:
    """``lm_head()`` -> ``[rows, shard]`` of ``dtype`` (BF16, or FP32 accumulated from the
    BF16 operands as an FP32 lm_head does) on the current stream: ``x @ w`` into
    ``self.out``. Each rank has its own weight (nothing shared in L2 between ranks)."""

    def __init__(self, rows, hidden, shard, device, seed=0, dtype=None):
        import torch

        g = torch.Generator(device=device)
        g.manual_seed(seed)
        bf16 = torch.bfloat16
        dtype = bf16 if dtype is None else dtype
        self.x = (torch.randn(rows, hidden, device=device, generator=g) * _SCALE).to(bf16)
        self.w = (torch.randn(hidden, shard, device=device, generator=g) * _SCALE).to(bf16)
        self.out = torch.empty(rows, shard, dtype=dtype, device=device)
        self._mm = torch.mm
        self._more = {} if dtype == bf16 else {"out_dtype": dtype}

    def __call__(self):
        return self._mm(self.x, self.w, out=self.out, **self._more)
