"""AllToAll: the all-to-all of vocab shards on the mailbox, ``[M, V/TP]`` on every rank
-> ``[splits[rank], V]`` on each (vLLM's ``all_to_all_vocab_shards``: each rank samples
its own rows from full-vocabulary logits), the kernel's all-to-all mode
(``kernels.gather.Gather``, ``all_to_all``) on the same protocol as the gather.

Invariants a change must keep (beyond its base's, ``mailbox_collective``, which hold
here unchanged):

- The splits are a call's argument (they change every step) and the same on every
  rank: the engine computes them from the batch every rank holds. A call checks only
  what this rank can see (``offsets``: tp non-negative ints summing to M, its own
  split the rows it asked for); ranks whose splits differ are the engine's bug, and
  the kernel then finds a peer's rows missing or misplaced.
- Whether a call is served depends on M (the sum of the splits, the same everywhere),
  the shard's width and the dtype: every rank takes the same path, stock or Lamport.
- A rank of 0 rows still launches: every rank waits on every peer every call, so no
  rank runs more than a call ahead and the parity moves on every rank alike.
- The mailbox holds the plan's largest M: a rank's rows of a call (its split) are at
  most M.
- The offsets are launch parameters, taken by value: a captured call replays its
  capture's splits (DSpark's, a function of the captured batch size), and eager calls
  and replays share one parity sequence (the epoch is in device memory).
"""

from itertools import accumulate
from operator import index

from .mailbox_collective import MailboxCollective
from .launch import check_offsets


def offsets(send_splits, tp, rank, local, rows):
    """The kernel's row offsets of a call (prefix sums of ``send_splits``, from 0) of
    ``rows`` rows in which rank ``rank`` asked for ``local`` rows; ValueError unless the
    splits are ``tp`` non-negative ints summing to ``rows`` (``check_offsets``: rows
    past the last offset would land where no poll re-arms them) with ``local`` this
    rank's."""
    at = check_offsets(accumulate(map(index, send_splits), initial=0), tp, rows)
    if at[rank + 1] - at[rank] != local:
        raise ValueError(f"lamport-head: rank {rank} of an all-to-all with splits "
                         f"{list(send_splits)} receives {at[rank + 1] - at[rank]} rows, "
                         f"asked for {local}")
    return at


class AllToAll(MailboxCollective):
    """``a2a(shard, send_splits, num_local_rows, stock)``: the Lamport all-to-all for the
    plan's row counts M (``shard``: this rank's ``[M, V/TP]``; ``send_splits[q]`` rows,
    in order, go to rank q; returns this rank's ``[num_local_rows, V]``, columns in
    rank order, as vLLM's ``all_to_all_vocab_shards``), ``stock(shard, send_splits,
    num_local_rows)`` otherwise. The gather's sibling: constructed as ``MailboxCollective``
    says (the same arguments, ``default``, modes, ``poll``/``check``/``reset``/``close``);
    a plan is by M, the step's total rows."""

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
        """The bare kernel launch into ``out`` on the current stream (tests, tuning):
        ``send_splits`` checked as a call's (None: an even split of M)."""
        rows = shard.shape[0]
        if send_splits is None:
            send_splits = even_splits(rows, self.tp)
        at = offsets(send_splits, self.tp, self.rank, send_splits[self.rank], rows)
        self._launch[rows](shard, out.data_ptr(), self.peers_address, self.rank, ctas,
                           self.budget_ns, self.status_address, self._stream_handle(), at)


def even_splits(rows, tp):
    """``rows`` split over ``tp`` ranks as evenly as possible, the first ranks one more:
    a bare launch's split when none is given (the tuner draws vLLM's instead:
    ``tuning.support.splits``)."""
    return [rows // tp + (q < rows % tp) for q in range(tp)]

