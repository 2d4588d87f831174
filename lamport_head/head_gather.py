"""``HeadGather``: the vocab-parallel lm_head's gather ``[M, V/TP] -> [M, V]``; its base,
``mailbox_collective``, holds what it shares with the all-to-all."""

from .mailbox_collective import MailboxCollective


class HeadGather(MailboxCollective):
    """``gather(logits, stock)``: Lamport for the plan's row counts, else ``stock(logits)``."""

    all_to_all = False

    def __call__(self, logits, stock):
        self.poll()
        shape = logits.shape
        if (len(shape) != 2 or shape[1] != self.shard_width or logits.dtype != self.dtype):
            return stock(logits)
        launch = self._launch.get(shape[0])
        if launch is None:
            return stock(logits)
        logits = self._ready(logits)
        stream = self._follow_stream()
        out = logits.new_empty((shape[0], self.width))  # under capture: the graph's own
        launch(logits, out.data_ptr(), self.peers_address, self.rank, self._ctas[shape[0]],
               self.budget_ns, self.status_address, stream)
        return out

    def launch(self, logits, out, ctas):
        """The bare launch into ``out`` on the current stream, unchecked (tests, tuning)."""
        launch = self._launch[logits.shape[0]]
        launch(logits, out.data_ptr(), self.peers_address, self.rank, ctas, self.budget_ns,
               self.status_address, self._stream_handle())
