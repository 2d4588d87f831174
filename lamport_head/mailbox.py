"""Lamport mailboxes: per rank, ``[2 parities, cap rows, words]`` int32 words, armed,
plus a control block (layout: ``kernels.protocol``; docs/design.md, the protocol).

Peers push into a box; only its own rank reads and re-arms it. ``peers`` is the
int64 ``[3, tp]`` device table of each rank's parity boxes and control block, as
mapped in this process.

Backends, one interface (``peers``, ``tp``, ``cap``, ``words``, ``sharing``,
``emulated``, ``arm()``, ``armed()``, ``barrier()``, ``close()``):

- ``ipc``: the ranks of one host, on distinct GPUs or sharing one: a cuMem box
  exported as a file descriptor and mapped by each peer in its own context
  (``peermem``: why). GPUs are named by UUID. No multicast object, ever.
- ``symmetric``: torch symmetric memory, only for ranks spanning hosts of one NVLink
  domain (forced); multicast is switched off before the first allocation, which
  refuses to go on if torch still reports it (``multicast_off``).
- ``local``: ``tp`` virtual ranks in one process (tests, emulation).

Invariants a change must keep (docs/design.md, the fail-stop rule):

- A local failure never strands a peer in a collective: the constructor only
  allocates, ``connect()`` exchanges; the caller agrees between the steps. Inside
  ``connect()`` a local step before a collective goes through ``exchange``, so
  every rank issues the same collectives and a failure raises on every rank.
- ``close()`` waits for every rank before the box is freed: a peer may still push.
- Torch's rendezvous runs in a helper thread given ``RENDEZVOUS_WAIT_S`` (a rank
  failing inside it would leave its peers in a phase no agreement reaches); one not
  back in time is that rank's failure, and every rank raises.
"""


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
MULTICAST_OFF_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"  # read by torch at rendezvous
RENDEZVOUS_WAIT_S = 60.0  # how long a rank waits for torch's rendezvous to return (start-up)


def multicast_off(symm_mem, device):
    """Before torch symmetric memory's first use in this process: no multicast. Sets
    torch's switch (the rendezvous reads it) and checks that torch now reports no
    multicast support for ``device``; raises otherwise (a rank failing here fails in
    the allocation step, which the ranks agree on), so the library never creates an
    NVLink multicast object (a program that does can take a shared host's GPUs out
    of service)."""
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
    """The ``[3, tp]`` address rows for boxes starting at ``bases`` (one per rank)."""
    parity = cap * words * 4
    rows = [[b + p * parity for b in bases] for p in range(2)]
    rows.insert(PEER_CONTROL, [b + 2 * parity for b in bases])
    assert len(rows) == PEER_ROWS
    return rows


class _Mailbox:
    """What every backend shares: the armed layout of one or more boxes."""

    emulated = False

    def _split(self, box):
        split = 2 * self.cap * self.words
        return box[..., :split], box[..., split:]

    def arm(self):
        """Every box word to the sentinel, every control word to 0 (this process's
        boxes only; the caller orders it against peers' pushes)."""
        data, control = self._split(self.box)
        data.fill_(SENTINEL_I32)
        control.zero_()

    def armed(self) -> bool:
        """True when every box word of this process is armed and no mark or missing
        rank is recorded (the epoch and CTA count may be anything) (synchronizes)."""
        data, control = self._split(self.box)
        return bool((data == SENTINEL_I32).all().item()
                    and (control[..., :CONTROL_EPOCH] == 0).all().item())

    def control(self, rank):
        """``rank``'s control block in this process (a box this process owns)."""
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
    """Collective: every rank's ``export()`` result, in rank order. ``export`` is local
    and may fail on one rank: its error travels with the results, so every rank
    issues the same one all-gather and then every rank raises, naming the ranks that
    failed (the failing rank's own exception chained), or every rank returns.
    ``tp``: the group size expected, checked when given."""
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
    """One box per process; ``connect()`` (collective) fills ``peers``."""

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
        """Local: this rank's box and mappings, freed after a build that failed (no
        gather ran, so no peer can still push; a peer's own mapping keeps the pages it
        holds)."""
        self._release()
        self.box = self.peers = None

    def _release(self):
        pass


class IpcMailbox(_ProcessMailbox):
    """A cuMem allocation of this rank's GPU, shared with every peer of the host as a
    POSIX file descriptor and mapped by each peer in its own context
    (``lamport_head.peermem`` says why; on the CPU device, memfd shared memory)."""

    name = "ipc"

    def _allocate(self, count):
        """Local: this rank's box (mapped here, exported) and its descriptor inbox."""
        # the inbox first: a socket closes itself when dropped, a cuMem box does not
        self._channel = peermem.FdChannel()
        self._segments = peermem.segments_for(self.device)
        self._mapped = {}
        self._own = self._segments.create(count * 4)
        return self._segments.tensor(self._own, count)

    def connect(self):
        """Collective: every rank maps every peer's box; ``peers`` holds the mappings.
        Two collectives (``exchange``), each reached by every rank whatever failed
        before it on one: the inboxes' names and the boxes' sizes, then whether every
        rank sent its descriptor to every peer. What follows (receiving and mapping)
        is local; the caller agrees on it."""
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
        """``peer``'s whole box as a tensor of this process (tests of late pushes)."""
        if peer == self.rank:
            return self.box
        return self._segments.tensor(self._mapped[peer], self.box.numel())

    def _release(self):
        """This process's mappings and references (after ``close``'s barrier, or at a
        failed build's end); a dead peer's pages go with the last one."""
        self.box = self.peers = None  # no tensor of ours over the mappings
        channel, self._channel = getattr(self, "_channel", None), None
        if channel is not None:
            channel.close()
        for segment in list(getattr(self, "_mapped", {}).values()) + [getattr(self, "_own", None)]:
            if segment is not None:
                self._segments.close(segment)
        self._mapped, self._own = {}, None


def symmetric_bases(buffer_ptrs, own_ptr: int, rank: int):
    """Each rank's address of *this box*, from a symmetric-memory handle's
    ``buffer_ptrs``. PyTorch versions point those at the allocation segment's base
    or at the tensor itself; the box sits at the same offset on every rank, so that
    offset is taken from this rank's own pointer and applied to every peer's."""
    ptrs = [int(p) for p in buffer_ptrs]
    offset = own_ptr - ptrs[rank]
    if offset < 0:
        raise RuntimeError(f"symmetric memory handle points past this box ({ptrs[rank]:#x} > "
                           f"{own_ptr:#x}); cannot derive peer addresses")
    return [p + offset for p in ptrs]


class SymmetricMailbox(_ProcessMailbox):
    """A torch symmetric-memory allocation (ranks on distinct GPUs)."""

    name = "symmetric"

    def _allocate(self, count):
        """Local: also everything ``connect`` needs before torch's rendezvous (the
        module, the group), so that a rank failing at it fails here, in the step the
        ranks agree on, never in ``connect`` while its peers sit in the rendezvous."""
        # lazy: only this backend loads torch's symmetric memory (``_symmetric_available``)
        import torch.distributed._symmetric_memory as symm_mem

        multicast_off(symm_mem, self.device)
        self._symm_mem = symm_mem
        self._symm_group = self.group if self.group is not None else dist.group.WORLD
        return symm_mem.empty(count, dtype=torch.int32, device=self.device)

    def connect(self):
        """Collective: torch's rendezvous first (nothing local before it; bounded in
        time, so a peer failing inside it cannot strand this rank), then
        ``exchange``'s one all-gather, which every rank reaches whatever its
        rendezvous did and which carries each rank's derivation of the peer
        addresses, or its failure, to every rank."""
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
        if len(set(offsets)) > 1:  # the derivation assumes one offset on every rank
            raise RuntimeError(f"symmetric memory places the box at different offsets on the "
                               f"ranks ({offsets} words): cannot derive peer addresses")
        bases, self._offset = derived[self.rank]
        self._set_bases(bases)

    def _derive(self):
        """``(every rank's address of this box, its offset in words into the handle's
        buffer)`` from the rendezvous' handle (local; may fail on this rank alone)."""
        if self.handle.world_size != self.tp:
            raise RuntimeError(f"symmetric memory spans {self.handle.world_size} ranks, "
                               f"expected tp={self.tp}")
        bases = symmetric_bases(self.handle.buffer_ptrs, self.box.data_ptr(), self.rank)
        return bases, (bases[self.rank] - int(self.handle.buffer_ptrs[self.rank])) // 4

    def peer_view(self, peer):
        """``peer``'s whole box as a tensor of this process (tests of late pushes)."""
        return self.handle.get_buffer(peer, self.box.shape, torch.int32,
                                      storage_offset=self._offset)

    def _release(self):
        self.handle = None


# The real-rank backends by name: what ``choose_backend`` answers, what HeadGather builds.
# The public seam of a box's construction: a build looks its backend's constructor up
# here each time (``build.build``: ``MAILBOXES[kind](group, device, tp, rank, cap,
# words)``, the local allocation step), so a fault-injection harness replaces an entry
# for its process (tuning/diagnostics/ranks.py ``--fail-alloc-rank``: one that raises,
# as a refused allocation does) instead of patching a backend's private methods.
MAILBOXES = {"ipc": IpcMailbox, "symmetric": SymmetricMailbox}


def device_key(device):
    """``(host, GPU UUID)``: what names this rank's GPU to every other process (a local
    index names another GPU, or none, where each process sees its own devices)."""
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
    """The backend every rank uses, from every rank's (host, GPU) key and whether it
    has symmetric memory: a pure function of gathered facts, so ranks cannot differ
    (when it raises, every rank raises the same error).

    Both backends hand the kernel peer pointers. Ranks of one host take CUDA IPC
    (whether they share a GPU or not: it needs no multicast, and no symmetric-memory
    support); CUDA IPC maps memory of the ranks' own host only; symmetric memory
    reaches other hosts only inside one multi-node NVLink domain (GB200 NVL72), which
    these facts cannot tell from separate hosts. So ranks on several hosts get an
    error that names the hosts (install: every rank stock), unless every rank was
    told ``symmetric`` (the operator vouches for the NVLink domain; the rendezvous
    then decides)."""
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
    """Collective: ``(backend, ranks on this GPU)``, the backend the same on every
    rank. ``backend`` (or ``$LAMPORT_HEAD_MAILBOX``) forces one; else ipc (the ranks
    of one host, each GPU reaching its peers' GPUs); ranks on several hosts: none
    (``decide`` raises). A rank whose own facts fail still takes part, and then every
    rank raises."""
    forced = backend or forced_backend()
    facts = exchange(lambda: (device_key(device), _symmetric_available(), forced), group,
                     what="describe its GPU")
    asked = {f for _, _, f in facts}
    if len(asked) > 1:
        raise ValueError(f"ranks disagree on the mailbox backend: {sorted(map(str, asked))}")
    keys = [k for k, _, _ in facts]
    me = torch.distributed.get_rank(group)  # facts come in the group's rank order
    kind = decide(keys, [s for _, s, _ in facts], forced)
    if kind == "ipc" and torch.device(device).type == "cuda":
        # Every rank checks that its GPU reaches each other GPU its host's ranks use, by
        # UUID (a process's local indices name other GPUs, or none, in another process);
        # the verdicts travel together, so a pair without peer access makes every rank
        # raise the same error, naming it, and install leaves every rank stock.
        exchange(lambda: check_peer_reach(keys, me), group,
                 what="reach its TP peers' GPUs (CUDA peer access)")
    return kind, keys.count(keys[me])


def check_peer_reach(keys, me):
    """Raise unless this rank's GPU can store into (and do atomics on) the memory of
    every other GPU its host's ranks use, asked by UUID (``peermem.p2p_status``: NVML,
    which sees every GPU whatever this process sees). Ranks sharing this GPU need
    nothing; a pair NVML cannot tell about is left to the mapping, whose failure the
    ranks agree on, naming it."""
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
