"""The stock gather on real ranks, as vLLM does it: NCCL's all-gather into
``[TP*M, V/TP]`` (rank-major), then the reorder copy to ``[M, V]``."""

import torch
import torch.distributed as dist


def all_gather_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> ``[M, V]`` (rank r's shard at columns r * V/TP)."""
    tp = dist.get_world_size(group)
    rows, shard = logits.shape
    out = torch.empty(tp * rows, shard, dtype=logits.dtype, device=logits.device)
    dist.all_gather_into_tensor(out, logits.contiguous(), group=group)
    return out.view(tp, rows, shard).movedim(0, 1).reshape(rows, tp * shard)
