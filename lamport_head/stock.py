"""The stock gather on real ranks, as vLLM does it: an all-gather into
``[TP*M, V/TP]`` (rank-major), then the reorder copy to ``[M, V]``.

On NCCL that is NCCL's all-gather. On gloo (several processes sharing one GPU, where
NCCL refuses) the shard travels as a host copy and the result comes back to the
device: the same bytes, at gloo's speed, so only correctness can be read from it.
"""

import torch
import torch.distributed as dist


def all_gather_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> ``[M, V]`` (rank r's shard at columns r * V/TP)."""
    tp = dist.get_world_size(group)
    rows, shard = logits.shape
    if dist.get_backend(group) == "gloo" and logits.is_cuda:
        parts = [torch.empty(rows, shard, dtype=logits.dtype) for _ in range(tp)]
        dist.all_gather(parts, logits.cpu(), group=group)
        return torch.cat(parts, dim=1).to(logits.device)
    out = torch.empty(tp * rows, shard, dtype=logits.dtype, device=logits.device)
    dist.all_gather_into_tensor(out, logits.contiguous(), group=group)
    return out.view(tp, rows, shard).movedim(0, 1).reshape(rows, tp * shard)
