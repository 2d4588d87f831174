"""Lamport mailboxes (docs/design.md, "The mailbox"): per rank ``[2 parities, cap rows,
words]`` int32 words plus a control block; peers push, only the owner reads and re-arms.
Backends: ``ipc`` (the ranks of one host: cuMem boxes, ``peermem``), ``symmetric`` (torch
symmetric memory, hosts of one NVLink domain, forced only) and ``local`` (virtual ranks
in one process). Fail-stop: the constructor only allocates and ``connect()`` only
exchanges, the caller agreeing after each."""


import os
import socket

import torch
import torch.distributed as dist
from torch._C._autograd import DeviceType

from . import peermem  # through the module: tests replace segments_for and p2p_status
from .collective import all_gather_objects, attempt, barrier, within
from .kernels.protocol import (CONTROL_EPOCH, MAX_TP, PEER_CONTROL, PEER_ROWS, SENTINEL_I32,
                               box_words)
from .settings import MAILBOX_ENV, forced_backend

BACKENDS = ("symmetric", "ipc")
MULTICAST_OFF_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
RENDEZVOUS_WAIT_S = 60.0  # each start-up step's deadline (build.start_up)


def multicast_off(symm_mem, device):
    """Before torch symmetric memory's first use: switch multicast off, raise unless torch
    then reports none. A multicast object can take a shared host's GPUs out of service."""
    os.environ[MULTICAST_OFF_ENV] = "1"
    probe = getattr(getattr(symm_mem, "_SymmetricMemory", None), "has_multicast_support", None)
    if probe is None or torch.device(device).type != "cuda":
        return
    if probe(DeviceType.CUDA, torch.device(device).index):
        raise RuntimeError(f"torch symmetric memory still reports NVLink multicast on {device} "
                           f"with {MULTICAST_OFF_ENV}=1 (read before we could set it?): "
                           "refusing to allocate a mailbox that would bind a multicast object")


def _check(tp, cap, words):
    if not 2 <= tp <= MAX_TP:
        raise ValueError(f"a mailbox needs 2 <= tp <= {MAX_TP}, got {tp}")
    if cap < 1:
        raise ValueError(f"a mailbox needs cap >= 1 rows, got {cap}")
    if words < 4 or words % 4:
        raise ValueError(f"a row of {words} words is not whole 16-byte fragments")


def peer_table(bases, cap, words):
    parity = cap * words * 4
    rows = [[b + p * parity for b in bases] for p in range(2)]
    rows.insert(PEER_CONTROL, [b + 2 * parity for b in bases])
    assert len(rows) == PEER_ROWS
    return rows


class _Mailbox:
    emulated = False

    def _split(self, box):
        split = 2 * self.cap * self.words
        return box[..., :split], box[..., split:]

    def arm(self):
        """Every box word to the sentinel, every control word to 0 (this process's boxes; the
        caller orders it against peers' pushes)."""
        data, control = self._split(self.box)
        data.fill_(SENTINEL_I32)
        control.zero_()

    def armed(self) -> bool:
        """Every box word armed, no mark or missing rank recorded (synchronizes)."""
        data, control = self._split(self.box)
        return bool((data == SENTINEL_I32).all().item()
                    and (control[..., :CONTROL_EPOCH] == 0).all().item())

    def control(self, rank):
        box = self.box[rank] if self.box.dim() == 2 else self.box
        return self._split(box)[1]


class LocalMailbox(_Mailbox):
    """``tp`` virtual ranks' boxes on one device, one shared peer table."""

    emulated = True

    def __init__(self, device, tp: int, cap: int, words: int):
        _check(tp, cap, words)
        self.tp, self.cap, self.words, self.sharing = tp, cap, words, tp
        self.device = torch.device(device)
        self.box = torch.empty((tp, box_words(cap, words)), dtype=torch.int32, device=self.device)
        stride = self.box.stride(0) * 4
        bases = [self.box.data_ptr() + r * stride for r in range(tp)]
        self.peers = torch.tensor(peer_table(bases, cap, words), dtype=torch.int64,
                                  device=self.device)
        torch.cuda.synchronize(self.device)  # a block freed by an earlier gather: idle first
        self.arm()
        torch.cuda.synchronize(self.device)

    def barrier(self):
        pass  # one process: a device sync orders every virtual rank

    def close(self):
        torch.cuda.synchronize(self.device)


def exchange(export, group, tp=None, what="export"):
    """Collective: every rank's ``export()`` result, in rank order. A local failure travels
    with the results, so every rank issues the one all-gather, then every rank raises,
    naming the ranks that failed, or every rank returns."""
    mine, error = attempt(export)
    cause = None if error is None else f"{type(error).__name__}: {error}"
    sent = all_gather_objects((mine, None) if error is None else (None, cause), group)
    failed = [(r, why) for r, (_, why) in enumerate(sent) if why]
    if failed:
        named = "; ".join(f"rank {r}: {why}" for r, why in failed)
        raise RuntimeError(f"lamport-head: {len(failed)} rank(s) failed to {what}: {named}") \
            from error
    if tp is not None and len(sent) != tp:
        raise RuntimeError(f"the group has {len(sent)} ranks, expected tp={tp}")
    return [blob for blob, _ in sent]


class _ProcessMailbox(_Mailbox):
    def __init__(self, group, device, tp: int, rank: int, cap: int, words: int):
        _check(tp, cap, words)
        self.group, self.tp, self.rank, self.cap, self.words = group, tp, rank, cap, words
        self.device = torch.device(device)
        self.box = self._allocate(box_words(cap, words))
        self.peers = None

    def _set_bases(self, bases):
        self.peers = torch.tensor(peer_table(bases, self.cap, self.words), dtype=torch.int64,
                                  device=self.device)

    def barrier(self):
        barrier(self.group, self.device)

    def close(self):
        """Collective: no rank frees its box while a peer may still push into it."""
        torch.cuda.synchronize(self.device)
        self.barrier()
        self.discard()

    def discard(self):
        """Local: free this rank's box after a failed build (no gather ran: no peer pushes)."""
        self._release()
        self.box = self.peers = None

    def _release(self):
        pass


class IpcMailbox(_ProcessMailbox):
    """A cuMem box exported as a file descriptor, mapped by each peer (``peermem``)."""

    name = "ipc"

    def _allocate(self, count):
        # the inbox first: a socket closes itself when dropped, a cuMem box does not
        self._channel = peermem.FdChannel()
        self._segments = peermem.segments_for(self.device)
        self._mapped = {}
        self._own = self._segments.create(count * 4)
        return self._segments.tensor(self._own, count)

    def connect(self):
        """Collective: two ``exchange``s, inbox names and sizes, then whether every descriptor
        went out; receiving and mapping are local, and the caller agrees on them."""
        facts = exchange(lambda: (self._channel.name, self._own.size), self.group, self.tp,
                         "describe its mailbox")
        peers = [r for r in range(self.tp) if r != self.rank]

        def send():
            self._channel.send_all({r: facts[r][0] for r in peers}, self.rank, self._own.fd,
                                   peermem.RECEIVE_WAIT_S)

        exchange(send, self.group, self.tp, "send its mailbox's file descriptor to its peers")
        fds = self._channel.receive(peers, peermem.RECEIVE_WAIT_S)
        try:
            for r in peers:
                self._mapped[r] = self._segments.open(fds[r], facts[r][1])
        finally:
            for fd in fds.values():  # an import holds its own reference
                os.close(fd)
        self._set_bases([self._own.ptr if r == self.rank else self._mapped[r].ptr
                         for r in range(self.tp)])

    def peer_view(self, peer):
        if peer == self.rank:
            return self.box
        return self._segments.tensor(self._mapped[peer], self.box.numel())

    def _release(self):
        self.box = self.peers = None  # no tensor of ours over the mappings
        channel, self._channel = getattr(self, "_channel", None), None
        if channel is not None:
            channel.close()
        for segment in list(getattr(self, "_mapped", {}).values()) + [getattr(self, "_own", None)]:
            if segment is not None:
                self._segments.close(segment)
        self._mapped, self._own = {}, None


def symmetric_bases(buffer_ptrs, own_ptr: int, rank: int):
    """Each rank's address of this box from a handle's ``buffer_ptrs``, which torch versions
    point at the segment's base or at the tensor: this rank's offset, applied to every peer."""
    ptrs = [int(p) for p in buffer_ptrs]
    offset = own_ptr - ptrs[rank]
    if offset < 0:
        raise RuntimeError(f"symmetric memory handle points past this box ({ptrs[rank]:#x} > "
                           f"{own_ptr:#x}); cannot derive peer addresses")
    return [p + offset for p in ptrs]


class SymmetricMailbox(_ProcessMailbox):
    name = "symmetric"

    def _allocate(self, count):
        """Local: also what ``connect`` needs before the rendezvous, so a rank fails here, in an
        agreed step, never while its peers sit in the rendezvous."""
        # lazy: only this backend loads torch's symmetric memory
        import torch.distributed._symmetric_memory as symm_mem

        multicast_off(symm_mem, self.device)
        self._symm_mem = symm_mem
        self._symm_group = self.group if self.group is not None else dist.group.WORLD
        return symm_mem.empty(count, dtype=torch.int32, device=self.device)

    def connect(self):
        """Collective: torch's rendezvous (bounded, nothing local before it), then one
        ``exchange`` every rank reaches, carrying each rank's peer addresses or failure."""
        def rendezvous():  # in its own thread: the current device is per thread
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            return self._symm_mem.rendezvous(self.box, self._symm_group)

        self.handle, failed = attempt(within, RENDEZVOUS_WAIT_S,
                                      "torch's symmetric-memory rendezvous", rendezvous,
                                      why=" (a peer failed inside it?)")

        def derive():
            if failed is not None:
                raise failed
            return self._derive()

        derived = exchange(derive, self.group, self.tp, "rendezvous and derive peer addresses "
                           "from its symmetric memory handle")
        offsets = [offset for _, offset in derived]
        if len(set(offsets)) > 1:
            raise RuntimeError(f"symmetric memory places the box at different offsets on the "
                               f"ranks ({offsets} words): cannot derive peer addresses")
        bases, self._offset = derived[self.rank]
        self._set_bases(bases)

    def _derive(self):
        if self.handle.world_size != self.tp:
            raise RuntimeError(f"symmetric memory spans {self.handle.world_size} ranks, "
                               f"expected tp={self.tp}")
        bases = symmetric_bases(self.handle.buffer_ptrs, self.box.data_ptr(), self.rank)
        return bases, (bases[self.rank] - int(self.handle.buffer_ptrs[self.rank])) // 4

    def peer_view(self, peer):
        return self.handle.get_buffer(peer, self.box.shape, torch.int32,
                                      storage_offset=self._offset)

    def _release(self):
        self.handle = None


# A build looks the constructor up here each time: a fault-injection harness replaces
# an entry (benches/diagnostics/ranks.py --fail-alloc-rank), not private methods.
MAILBOXES = {"ipc": IpcMailbox, "symmetric": SymmetricMailbox}


def device_key(device):
    """``(host, NVML UUID)``: what names this GPU to other processes (a local index does not)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        raise RuntimeError(f"torch reports no UUID for {device}: cannot name this GPU to "
                           "the other ranks")
    return socket.gethostname(), peermem.nvml_uuid(uuid)


def _symmetric_available():
    try:  # lazy: a probe; some torch builds lack symmetric memory
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401

        return hasattr(symm_mem, "rendezvous") and hasattr(symm_mem, "empty")
    except Exception:
        return False


def decide(keys, symmetric, forced=None):
    """The backend, a pure function of gathered facts (every rank returns or raises alike):
    ipc for one host; several hosts raise unless every rank forced ``symmetric`` (vouching
    for one NVLink domain, which these facts cannot tell from separate hosts)."""
    if forced and forced not in BACKENDS:
        raise ValueError(f"{MAILBOX_ENV}={forced!r}: expected one of {', '.join(BACKENDS)}")
    hosts = sorted({str(host) for host, _ in keys})
    if len(hosts) > 1 and forced != "symmetric":
        raise RuntimeError(f"lamport-head: the TP ranks span {len(hosts)} hosts "
                           f"({', '.join(hosts)}); a Lamport mailbox maps peers' memory "
                           f"within one host, or one multi-node NVLink domain with "
                           f"{MAILBOX_ENV}=symmetric on every rank")
    if forced == "symmetric" and not all(symmetric):
        lacking = [r for r, ok in enumerate(symmetric) if not ok]
        raise RuntimeError(f"lamport-head: {MAILBOX_ENV}=symmetric, but rank(s) {lacking} "
                           "have no torch symmetric memory")
    return forced or "ipc"


def choose_backend(group, device, backend=None):
    """Collective: ``(backend, ranks on this GPU)``, the same on every rank; a rank whose
    facts fail takes part, then every rank raises."""
    forced = backend or forced_backend()
    facts = exchange(lambda: (device_key(device), _symmetric_available(), forced), group,
                     what="describe its GPU")
    asked = {f for _, _, f in facts}
    if len(asked) > 1:
        raise ValueError(f"ranks disagree on the mailbox backend: {sorted(map(str, asked))}")
    keys = [k for k, _, _ in facts]
    me = torch.distributed.get_rank(group)
    kind = decide(keys, [s for _, s, _ in facts], forced)
    if kind == "ipc" and torch.device(device).type == "cuda":
        # the verdicts travel together: a pair without peer access fails every rank alike
        exchange(lambda: check_peer_reach(keys, me), group,
                 what="reach its TP peers' GPUs (CUDA peer access)")
    return kind, keys.count(keys[me])


def check_peer_reach(keys, me):
    """Raise unless this GPU can store into (and do atomics on) every other GPU its host's
    ranks use, asked of NVML by UUID; a pair NVML cannot tell about is left to the mapping."""
    host, gpu = keys[me]
    for r, (h, g) in enumerate(keys):
        if h == host and g != gpu:
            ok, why = peermem.p2p_status(gpu, g)
            if ok is False:
                raise RuntimeError(f"GPU {gpu} (rank {me}) cannot reach GPU {g}'s memory "
                                   f"(rank {r}): {why}")


__all__ = ["LocalMailbox", "IpcMailbox", "SymmetricMailbox", "MAILBOXES", "choose_backend",
           "check_peer_reach", "decide", "device_key", "exchange", "peer_table",
           "symmetric_bases"]
