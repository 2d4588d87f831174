"""``AllToAll``: ``[M, V/TP]`` on every rank -> ``[splits[rank], V]`` on each (vLLM's
``all_to_all_vocab_shards``), the kernel's all-to-all mode (docs/design.md, "The
all-to-all: the same call, addressed by rank"). The splits are launch parameters: a
captured call replays its capture's. The mailbox holds the plan's largest M: any split fits."""

from itertools import accumulate
from operator import index

from .mailbox_collective import MailboxCollective
from .launch import check_offsets


def offsets(send_splits, tp, rank, local, rows):
    """The kernel's row offsets of a call of ``rows`` rows; ValueError unless ``send_splits``
    are ``tp`` non-negative ints summing to ``rows`` and give this rank ``local`` rows."""
    at = check_offsets(accumulate(map(index, send_splits), initial=0), tp, rows)
    if at[rank + 1] - at[rank] != local:
        raise ValueError(f"lamport-head: rank {rank} of an all-to-all with splits "
                         f"{list(send_splits)} receives {at[rank + 1] - at[rank]} rows, "
                         f"asked for {local}")
    return at


class AllToAll(MailboxCollective):
    """``a2a(shard, send_splits, num_local_rows, stock)``: ``send_splits[q]`` rows, in order,
    to rank q, this rank's ``[num_local_rows, V]`` back; ``stock(...)`` for an M not in the
    plan, another dtype or width. A rank of 0 rows still launches."""

    all_to_all = True

    def __call__(self, shard, send_splits, num_local_rows, stock):
        self.poll()
        shape = shard.shape
        if len(shape) != 2 or shape[1] != self.shard_width or shard.dtype != self.dtype:
            return stock(shard, send_splits, num_local_rows)
        launch = self._launch.get(shape[0])
        if launch is None:
            return stock(shard, send_splits, num_local_rows)
        at = offsets(send_splits, self.tp, self.rank, num_local_rows, shape[0])
        shard = self._ready(shard)
        stream = self._follow_stream()
        out = shard.new_empty((num_local_rows, self.width))  # under capture: the graph's own
        launch(shard, out.data_ptr(), self.peers_address, self.rank, self._ctas[shape[0]],
               self.budget_ns, self.status_address, stream, at)
        return out

    def launch(self, shard, out, ctas, send_splits=None):
        """The bare launch into ``out`` (tests, tuning); ``send_splits`` None: an even split."""
        rows = shard.shape[0]
        if send_splits is None:
            send_splits = even_splits(rows, self.tp)
        at = offsets(send_splits, self.tp, self.rank, send_splits[self.rank], rows)
        self._launch[rows](shard, out.data_ptr(), self.peers_address, self.rank, ctas,
                           self.budget_ns, self.status_address, self._stream_handle(), at)


def even_splits(rows, tp):
    """``rows`` over ``tp`` ranks as evenly as possible, the first ranks one more."""
    return [rows // tp + (q < rows % tp) for q in range(tp)]

