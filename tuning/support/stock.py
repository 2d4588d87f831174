"""The stock collectives on real ranks, as vLLM does them: the gather (``StockGather``),
an all-gather into ``[TP*M, V/TP]`` (rank-major), then the reorder copy to ``[M, V]``;
the all-to-all of vocab shards (``StockAllToAll``, vLLM 0.34's
``all_to_all_vocab_shards``), an all-to-all of the shard's rows by the send splits into
``[TP*n, V/TP]`` (rank-major, n this rank's rows), then the permute to ``[n, V]``.

On NCCL that is NCCL's collective. On gloo (several processes sharing one GPU, where
NCCL refuses) the shard travels as a host copy and the result comes back to the
device: the same bytes, at gloo's speed, so only correctness can be read from it.
"""

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every call) in favour
# of all_gather_single, the same collective under its new name (the deprecated one
# forwards to it); older torch (2.9-2.12, in our range) has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Stock:
    """What both stock collectives hold for one row count M: the group, the shapes, the
    output buffer ``[M, V]`` and, where gloo moves host tensors of a CUDA shard
    (``host``), the shard's pinned host copy (``staged``)."""

    def __init__(self, rows, shard, group, device, dtype):
        self.group, self.tp = group, dist.get_world_size(group)
        self.rows, self.shard_width, self.dtype = rows, shard, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.host = dist.get_backend(group) == "gloo" and self.device.type == "cuda"
        self.out = torch.empty(rows, self.tp * shard, dtype=dtype, device=self.device)
        self.staged = (torch.empty(rows, shard, dtype=dtype, pin_memory=True) if self.host
                       else None)


class StockGather(_Stock):
    """The stock gather for one row count with every buffer allocated up front.

    Invariant: a call allocates nothing, so the only thing that can fail in it is the
    collective itself (the backend's to report); a caller that must keep ranks in step
    builds it as a local step, agrees, and then calls it on every rank. The result is
    one buffer, overwritten by the next call."""

    def __init__(self, rows, shard, group=None, device=None, dtype=torch.bfloat16):
        super().__init__(rows, shard, group, device, dtype)
        if self.host:  # gloo moves host tensors: the parts land there
            self.parts = [torch.empty(rows, shard, dtype=dtype) for _ in range(self.tp)]
        else:
            self.gathered = torch.empty(self.tp * rows, shard, dtype=dtype, device=self.device)

    def __call__(self, logits):
        """``[rows, V/TP]`` contiguous on every rank -> ``[rows, V]`` (rank r's shard
        at columns ``r * V/TP``)."""
        if (tuple(logits.shape) != (self.rows, self.shard_width) or logits.dtype != self.dtype
                or not logits.is_contiguous()):
            raise ValueError(f"stock gather built for contiguous [{self.rows}, {self.shard_width}] "
                             f"{self.dtype}, got {list(logits.shape)} {logits.dtype}")
        if self.host:
            self.staged.copy_(logits)
            dist.all_gather(self.parts, self.staged, group=self.group)
            for r, part in enumerate(self.parts):
                self.out[:, r * self.shard_width:(r + 1) * self.shard_width].copy_(part)
        else:
            _all_gather_single(self.gathered, logits, group=self.group)
            self.out.view(self.rows, self.tp, self.shard_width).copy_(
                self.gathered.view(self.tp, self.rows, self.shard_width).movedim(0, 1))
        return self.out


class StockAllToAll(_Stock):
    """The stock all-to-all of vocab shards for one row count M (the step's total rows)
    with every buffer allocated up front: ``all_to_all_single`` with vLLM's splits (this
    rank sends ``send_splits[q]`` rows, in order, to rank q and receives
    ``num_local_rows`` from every rank), then vLLM's permute.

    Invariant: as ``StockGather``'s, a call allocates nothing (the buffers hold any
    split of M: a rank receives at most M rows of every rank), so only the collective
    itself can fail in it. The result is a view of one buffer, overwritten by the next
    call."""

    def __init__(self, rows, shard, group=None, device=None, dtype=torch.bfloat16):
        super().__init__(rows, shard, group, device, dtype)
        # gloo moves host tensors: the received rows land there
        self.received = torch.empty(self.tp * rows, shard, dtype=dtype,
                                    device="cpu" if self.host else self.device)

    def __call__(self, logits, send_splits, num_local_rows):
        """``[rows, V/TP]`` contiguous on every rank -> ``[num_local_rows, V]``: rows
        ``offsets[rank]:offsets[rank + 1]`` of every rank's shard (the splits' prefix
        sums), rank q's at columns ``q * V/TP`` (vLLM's ``all_to_all_vocab_shards``)."""
        if (tuple(logits.shape) != (self.rows, self.shard_width) or logits.dtype != self.dtype
                or not logits.is_contiguous() or not 0 <= num_local_rows <= self.rows):
            raise ValueError(f"stock all-to-all built for contiguous [{self.rows}, "
                             f"{self.shard_width}] {self.dtype} and at most {self.rows} rows a rank, "
                             f"got {list(logits.shape)} {logits.dtype}, {num_local_rows} rows")
        n, tp = num_local_rows, self.tp
        received = self.received[:tp * n]
        source = logits
        if self.host:
            self.staged.copy_(logits)
            source = self.staged
        dist.all_to_all_single(received, source, output_split_sizes=[n] * tp,
                               input_split_sizes=list(send_splits), group=self.group)
        out = self.out[:n]
        out.view(n, tp, self.shard_width).copy_(received.view(tp, n, self.shard_width).movedim(0, 1))
        return out


def all_gather_logits(logits: torch.Tensor, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> a fresh ``[M, V]`` (rank r's shard at columns
    r * V/TP): ``StockGather`` built for this call."""
    rows, shard = logits.shape
    return StockGather(rows, shard, group, logits.device, logits.dtype)(logits.contiguous())


def all_to_all_logits(logits: torch.Tensor, send_splits, group=None) -> torch.Tensor:
    """``[M, V/TP]`` on every rank -> a fresh ``[send_splits[rank], V]`` (vLLM's
    ``all_to_all_vocab_shards``): ``StockAllToAll`` built for this call."""
    rows, shard = logits.shape
    local = list(send_splits)[dist.get_rank(group)]
    return StockAllToAll(rows, shard, group, logits.device, logits.dtype)(
        logits.contiguous(), send_splits, local)
