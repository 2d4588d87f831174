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
    """``lm_head()`` -> ``[rows, shard]`` BF16 on the current stream: ``x @ w`` into
    ``self.out``. Each rank has its own weight (nothing shared in L2 between ranks)."""

    def __init__(self, rows, hidden, shard, device, seed=0):
        import torch

        g = torch.Generator(device=device)
        g.manual_seed(seed)
        bf16 = torch.bfloat16
        self.x = (torch.randn(rows, hidden, device=device, generator=g) * _SCALE).to(bf16)
        self.w = (torch.randn(hidden, shard, device=device, generator=g) * _SCALE).to(bf16)
        self.out = torch.empty(rows, shard, dtype=bf16, device=device)
        self._mm = torch.mm

    def __call__(self):
        return self._mm(self.x, self.w, out=self.out)
