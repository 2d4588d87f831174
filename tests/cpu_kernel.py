"""A CPU stand-in of the kernel's all-to-all mode, over real mailboxes (``IpcMailbox`` on
the CPU device: memfd shared memory mapped by every rank's process), so the host's
``AllToAll`` runs end to end on gloo processes with no GPU: its splits, offsets, plan,
stock fallbacks and output shapes, with the protocol's addressing and re-arm.

What it models of ``kernels.gather.Gather(all_to_all=True)``, per call: the parity is
the rank's epoch (its control block); rows ``offsets[q]..offsets[q + 1]`` of the shard,
sentinel words made 0, go to rows 0.. of rank q's box of that parity at this rank's
columns (its own rows straight to the output); a rank q of 0 rows gets one token
fragment (the epoch in every word) from every peer instead (row 0, the peer's first
column); then this rank polls its box for its rows (or the tokens) of every peer as
the kernel does, fragment by fragment
(16 bytes, ``WORDS`` words): a fragment is taken, copied out and re-armed as soon as no
word of it is the sentinel, whatever its neighbours hold; then it advances its epoch.
A poll past the budget raises ``TimeoutError`` (the give-up, the mark and NaN
delivery are the GPU tests').

It is not the kernel: what it proves is the host's side and the addressing rule; the
kernel's own bytes are tests/test_gpu_all_to_all.py's.
"""

import ctypes
import time
import types

import torch

from lamport_head import build, mailbox, mailbox_collective
from lamport_head.kernels.protocol import (CONTROL_EPOCH, CONTROL_WORDS, EPOCH_SPAN, PEER_CONTROL,
                                           PEER_PARITY0, PEER_PARITY1, PEER_ROWS,
                                           SENTINEL_I32, WORDS)


def _ints(address, count, ctype=ctypes.c_int32, dtype=torch.int32):
    """``count`` words at ``address`` of this process, as a tensor (no copy)."""
    return torch.frombuffer((ctype * count).from_address(address), dtype=dtype)


class Launch:
    """One rank's launcher: ``launch(shard, out, peers, rank, ctas, budget, status,
    stream, offsets)``, as ``DriverLaunch``'s. ``calls``: the offsets of every launch
    (a list the caller may share between launchers).
    A box's rows (its cap) are read off the peer table: parity 1 lies one parity's
    ``cap x tp x words`` words after parity 0 (``kernels.protocol``)."""

    def __init__(self, tp, words, calls=None):
        self.tp, self.words = tp, words
        self.calls = [] if calls is None else calls

    def __call__(self, shard, out, peers, rank, ctas, budget, status, stream, offsets=()):
        tp, words = self.tp, self.words
        self.calls.append(tuple(offsets))
        table = _ints(peers, PEER_ROWS * tp, ctypes.c_int64, torch.int64).view(PEER_ROWS, tp)
        span = int(table[PEER_PARITY1, rank]) - int(table[PEER_PARITY0, rank])
        cap = span // (4 * tp * words)
        control = _ints(int(table[PEER_CONTROL, rank]), CONTROL_WORDS)
        epoch = int(control[CONTROL_EPOCH])
        parity = epoch & 1

        def box(q):
            return _ints(int(table[PEER_PARITY0 + parity, q]), cap * tp * words).view(
                cap, tp * words)

        mine = offsets[rank + 1] - offsets[rank]
        target = _ints(out, max(mine, 1) * tp * words)[:mine * tp * words].view(mine, tp * words)
        rows = shard.shape[0]
        source = shard.contiguous().view(torch.int32).view(rows, words)
        source = source.masked_fill(source == SENTINEL_I32, 0)
        columns = slice(rank * words, (rank + 1) * words)
        for step in range(tp):  # push order: this rank, then rank + 1, ...
            q = (rank + step) % tp
            part = source[offsets[q]:offsets[q + 1]]
            if q == rank:
                target[:, columns] = part
            elif part.shape[0]:
                box(q)[:part.shape[0], columns] = part
            else:
                box(q)[0, rank * words:rank * words + WORDS] = epoch  # the token: never the sentinel
        own, end = box(rank), time.monotonic_ns() + budget
        for p in range(tp):
            if p == rank:
                continue
            # the kernel's polls (``steps.locate``): row-major over a row's peer
            # fragments; a 0-row rank polls the token, the first fragment of row 0
            spots = ([(m, p * words + j) for m in range(mine) for j in range(0, words, WORDS)]
                     if mine else [(0, p * words)])
            for m, c in spots:
                fragment = own[m, c:c + WORDS]
                while bool((fragment == SENTINEL_I32).any()):  # ``armed``: any word
                    if time.monotonic_ns() > end:
                        raise TimeoutError(f"rank {rank}, epoch {epoch}: rank {p}'s rows "
                                           "never came")
                    time.sleep(0)
                if mine:  # ``take``: copied out, then re-armed; a token only re-armed
                    target[m, c:c + WORDS] = fragment
                fragment.fill_(SENTINEL_I32)
        control[CONTROL_EPOCH] = (epoch + 1) % EPOCH_SPAN


class Toolchain(build.Toolchain):
    """``build.TOOLCHAIN`` on the CPU: the all-to-all's launcher is ``Launch`` (the
    gather has none here); every plan fits. ``launches``: every launcher built;
    ``calls``: the offsets of every launch of any of them, in order."""

    def __init__(self):
        self.launches, self.calls = [], []

    def arch(self, device):
        return "cpu"

    def pdl(self, arch):
        return True  # as on Hopper

    def compiled(self, tp, words, config, pdl, arch, all_to_all=False):
        if not all_to_all:
            raise NotImplementedError("the CPU stand-in models the all-to-all only")
        return types.SimpleNamespace(tp=tp, words=words)

    def launcher(self, compiled, device, serving):
        launch = Launch(compiled.tp, compiled.words, self.calls)
        self.launches.append(launch)
        return launch

    def resident(self, compiled, device):
        return 1 << 20


def use(gpu="the one GPU"):
    """This process's builds on the CPU stand-in (a process of spawned ranks: nothing to
    restore): the toolchain, real ipc mailboxes of memfd memory, this rank on the "GPU"
    named ``gpu`` of one host (every rank the same name: ranks sharing one GPU; a name
    per rank: a GPU each, what an engine's ranks are), no CUDA stream or sync. Returns
    the toolchain."""
    toolchain = Toolchain()
    build.TOOLCHAIN = toolchain
    mailbox.device_key = lambda device: ("host", gpu)
    mailbox_collective._raw_stream = lambda index: 0
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(
        wait_stream=lambda other: None)
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.is_current_stream_capturing = lambda: False
    return toolchain
