"""The stock gather on real ranks, as vLLM does it: an all-gather into
``[TP*M, V/TP]`` (rank-major), then the reorder copy to ``[M, V]``. And the stock
all-to-all of vocab shards, as vLLM 0.34's ``all_to_all_vocab_shards`` does it: an
all-to-all (``all_to_all_single``, ``send_splits[q]`` rows to rank q) into
``[TP*n, V/TP]`` (n: this rank's rows, from every rank), then the permute to ``[n, V]``.

On NCCL that is NCCL's all-gather. On gloo (several processes sharing one GPU, where
NCCL refuses) the shard travels as a host copy and the result comes back to the
device: the same bytes, at gloo's speed, so only correctness can be read from it.
"""

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every call) in favour
# of all_gather_single, the same collective under its new name (the deprecated one
# forwards to it); older torch (2.9-2.12, in our range) has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class StockGather:
    """The stock gather for one row count with every buffer allocated up front.

    Invariant: a call allocates nothing, so the only thing that can fail in it is the
    collective itself (the backend's to report); a caller that must keep ranks in step
    builds it as a local step, agrees, and then calls it on every rank. The result is
    one buffer, overwritten by the next call."""

    def __init__(self, rows, shard, group=None, device=None, dtype=torch.bfloat16):
        self.group, self.tp = group, dist.get_world_size(group)
        self.rows, self.shard, self.dtype = rows, shard, dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.host = dist.get_backend(group) == "gloo" and device.type == "cuda"
        self.out = torch.empty(rows, self.tp * shard, dtype=dtype, device=device)
        if self.host:  # gloo moves host tensors: stage the shard and the parts there
            self.staged = torch.empty(rows, shard, dtype=dtype, pin_memory=True)
            self.parts = [torch.empty(rows, shard, dtype=dtype) for _ in range(self.tp)]
        else:
            self.gathered = torch.empty(self.tp * rows, shard, dtype=dtype, device=device)

    def __call__(self, logits):
        """``[rows, V/TP]`` contiguous on every rank -> ``[rows, V]`` (rank r's shard
        at columns ``r * V/TP``)."""
        if (tuple(logits.shape) != (self.rows, self.shard) or logits.dtype != self.dtype
                or not logits.is_contiguous()):
            raise ValueError(f"stock gather built for contiguous [{self.rows}, {self.shard}] "
                             f"{self.dtype}, got {list(logits.shape)} {logits.dtype}")
        if self.host:
            self.staged.copy_(logits)
            dist.all_gather(self.parts, self.staged, group=self.group)
            for r, part in enumerate(self.parts):
                self.out[:, r * self.shard:(r + 1) * self.shard].copy_(part)
        else:
            _all_gather_single(self.gathered, logits, group=self.group)
            self.out.view(self.rows, self.tp, self.shard).copy_(
                self.gathered.view(self.tp, self.rows, self.shard).movedim(0, 1))
        return self.out


class StockAllToAll:
    """The stock all-to-all for one split of M rows (``splits``, the same on every rank)
    with every buffer allocated up front: ``[M, V/TP]`` on every rank -> this rank's
    ``[splits[rank], V]`` (rank q's columns at ``q * V/TP``). The same invariant as
    ``StockGather``: a call allocates nothing (vLLM's permute allocates its result; here
    the same copy lands in ``out``), and the result is one buffer, overwritten by the
    next call."""

    def __init__(self, splits, shard, group=None, device=None, dtype=torch.bfloat16):
        self.group, self.tp = group, dist.get_world_size(group)
        self.splits, self.shard, self.dtype = list(splits), shard, dtype
        self.rows, self.local = sum(self.splits), self.splits[dist.get_rank(group)]
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.host = dist.get_backend(group) == "gloo" and device.type == "cuda"
        self.out = torch.empty(self.local, self.tp * shard, dtype=dtype, device=device)
        # gloo moves host tensors: stage the shard and the received rows there
        where = "cpu" if self.host else device
        self.staged = (torch.empty(self.rows, shard, dtype=dtype, pin_memory=True)
                       if self.host else None)
        self.received = torch.empty(self.tp * self.local, shard, dtype=dtype, device=where)

    def __call__(self, logits):
        """``[M, V/TP]`` contiguous on every rank -> ``[splits[rank], V]``."""
        if (tuple(logits.shape) != (self.rows, self.shard) or logits.dtype != self.dtype
                or not logits.is_contiguous()):
            raise ValueError(f"stock all-to-all built for contiguous [{self.rows}, {self.shard}] "
                             f"{self.dtype}, got {list(logits.shape)} {logits.dtype}")
        sent = self.staged.copy_(logits) if self.host else logits
        dist.all_to_all_single(self.received, sent, output_split_sizes=[self.local] * self.tp,
                               input_split_sizes=self.splits, group=self.group)
        self.out.view(self.local, self.tp, self.shard).copy_(
            self.received.view(self.tp, self.local, self.shard).movedim(0, 1))
        return self.out


def all_gather_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> a fresh ``[M, V]`` (rank r's shard at columns
    r * V/TP): ``StockGather`` built for this call."""
    rows, shard = logits.shape
    return StockGather(rows, shard, group, logits.device, logits.dtype)(logits.contiguous())


def all_to_all_logits(logits: torch.Tensor, send_splits, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> a fresh ``[send_splits[rank], V]`` (vLLM's
    ``all_to_all_vocab_shards``): ``StockAllToAll`` built for this call."""
    return StockAllToAll(send_splits, logits.shape[1], group, logits.device,
                         logits.dtype)(logits.contiguous())
