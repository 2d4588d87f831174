"""Lamport mailboxes: ``[2 parities, cap rows, words]`` int32 per rank, armed.

Every word starts as ``SENTINEL`` (the BF16 pair (+0, -0)). Peers write into a box
with pushes; only the box's own rank reads and re-arms it (the gather kernel does
that per fragment). ``peers`` is an int64 ``[2, tp]`` device tensor: ``peers[p, r]``
is the address of rank r's parity-p box, the table the kernel pushes through.

Two kinds, one interface (``peers``, ``words``, ``cap``, ``tp``, ``arm()``):

- ``LamportRows``: one box per process on symmetric memory over a process group
  (``torch.distributed._symmetric_memory`` ``empty`` + ``rendezvous``; peer
  pointers only, multicast never requested). Construction arms and then barriers,
  so no rank pushes into a peer's box before that peer armed it.
- ``LocalRows``: ``tp`` virtual ranks' boxes in one device tensor, for one-GPU
  emulation; every virtual rank shares the one peer table. Construction arms and
  synchronizes the device.
"""

import torch

SENTINEL = -0x80000000  # 0x80000000 as a signed int32


def _check(tp, cap, words):
    if tp < 2:
        raise ValueError(f"a mailbox needs tp >= 2, got {tp}")
    if cap < 1:
        raise ValueError(f"a mailbox needs cap >= 1 rows, got {cap}")
    if words < 4 or words % 4:
        raise ValueError(f"a row of {words} words is not whole 16-byte fragments")


class LamportRows:
    """This rank's box on symmetric memory, and the group's peer table."""

    emulated = False

    def __init__(self, group, device, tp: int, cap: int, words: int):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        _check(tp, cap, words)
        self.tp, self.cap, self.words = tp, cap, words
        self.device = torch.device(device)
        group = group if group is not None else dist.group.WORLD
        self.box = symm_mem.empty((2, cap, words), dtype=torch.int32, device=self.device)
        handle = symm_mem.rendezvous(self.box, group)
        if handle.world_size != tp:
            raise RuntimeError(f"symmetric memory spans {handle.world_size} ranks, expected tp={tp}")
        parity_bytes = cap * words * 4
        bases = [int(p) for p in handle.buffer_ptrs]
        self.peers = torch.tensor([[b + p * parity_bytes for b in bases] for p in range(2)],
                                  dtype=torch.int64, device=self.device)
        self.handle = handle
        self.arm()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)

    def arm(self):
        """Every word back to the sentinel (the caller orders it against peers)."""
        self.box.fill_(SENTINEL)

    def boxes(self):
        return [self.box]


class LocalRows:
    """``tp`` virtual ranks' boxes on one device, one shared peer table."""

    emulated = True

    def __init__(self, device, tp: int, cap: int, words: int):
        _check(tp, cap, words)
        self.tp, self.cap, self.words = tp, cap, words
        self.device = torch.device(device)
        self.box = torch.empty((tp, 2, cap, words), dtype=torch.int32, device=self.device)
        base, parity_bytes = self.box.data_ptr(), cap * words * 4
        self.peers = torch.tensor(
            [[base + (r * 2 + p) * parity_bytes for r in range(tp)] for p in range(2)],
            dtype=torch.int64, device=self.device)
        self.arm()
        torch.cuda.synchronize(self.device)

    def arm(self):
        self.box.fill_(SENTINEL)

    def boxes(self):
        return list(self.box)
