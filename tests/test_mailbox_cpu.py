"""The real-rank mailboxes' connect() and the backend choice on gloo processes (CPU):
every rank issues the same collectives in the same order, whatever fails on one
rank. The IPC box is the real ``IpcMailbox`` (on the CPU device its boxes are memfd
shared memory, whose descriptors travel as a GPU box's do); symmetric memory is a stand-in module whose rendezvous is a gloo
collective, driving the real ``SymmetricMailbox.connect``. A rank stranded in a
collective fails the test at spawn's deadline."""

import sys
import types

import pytest
import torch
import torch.distributed as dist
from helpers import fake_symmetric_memory
from spawn import spawn

from lamport_head import mailbox
from lamport_head.collective import agree, attempt

CAP, WORDS = 2, 8


def _in_step():
    """The program's next collective: every rank must get here, in the same order."""
    t = torch.tensor([1])
    dist.all_reduce(t)
    return int(t.item())


def _connect_agreed(box):
    """HeadGather's connect step: connect (collective), then agree on its outcome."""
    _, error = attempt(box.connect)
    try:
        agree(error, None, "cpu", "to map the peers' mailboxes")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", error
    return None, error


# ---- ipc ----------------------------------------------------------------------------

def _ipc_worker(rank, nprocs, failing):
    from lamport_head import peermem

    if rank == failing:
        def refuse(*args, **kwargs):
            raise RuntimeError("injected: cannot send a descriptor")

        peermem.FdChannel.send = refuse
    box = mailbox.IpcMailbox(None, "cpu", nprocs, rank, CAP, WORDS)
    box.box.fill_(100 + rank)
    agreed, error = _connect_agreed(box)
    seen = None if agreed else [int(box.peer_view(p)[0]) for p in range(nprocs)]
    return {"agreed": agreed, "own": None if error is None else str(error), "seen": seen,
            "in_step": _in_step()}


def test_ipc_connect_maps_every_peers_box(tmp_path):
    for r in spawn(_ipc_worker, 3, tmp_path, -1, deadline_s=60):
        assert r["agreed"] is None and r["seen"] == [100, 101, 102] and r["in_step"] == 3


def test_ipc_send_failing_on_one_rank_raises_on_every_rank(tmp_path):
    """Rank 1 cannot send its box's descriptor: every rank learns it in the same
    collective (no peer waits for a descriptor that will not come) and raises."""
    for r in spawn(_ipc_worker, 3, tmp_path, 1, deadline_s=60):
        assert r["in_step"] == 3 and r["seen"] is None
        assert r["own"] == ("lamport-head: 1 rank(s) failed to send its mailbox's file "
                            "descriptor to its peers: rank 1: RuntimeError: injected: cannot "
                            "send a descriptor")
        assert r["agreed"] == f"RuntimeError: {r['own']}"  # connect raised on every rank


# ---- symmetric memory (a stand-in module) -----------------------------------------

def _fake_symmetric_memory(rank, past):
    """A ``torch.distributed._symmetric_memory`` whose rendezvous is a gloo all-gather
    of the boxes' addresses; on rank ``past`` the handle points past the box."""
    from lamport_head.collective import all_gather_objects

    def rendezvous(box, group):
        ptrs = all_gather_objects(box.data_ptr(), group)
        if rank == past:
            ptrs[rank] += 64
        return types.SimpleNamespace(world_size=len(ptrs), buffer_ptrs=ptrs)

    fake_symmetric_memory(rendezvous)


def _symmetric_worker(rank, nprocs, case):
    failing = int(case.split("@")[1])
    _fake_symmetric_memory(rank, failing if case.startswith("past@") else -1)
    box = mailbox.SymmetricMailbox(None, "cpu", nprocs, rank, CAP, WORDS)
    agreed, error = _connect_agreed(box)
    return {"agreed": agreed, "own": None if error is None else str(error),
            "bases": None if agreed else box.peers[0].tolist(), "in_step": _in_step()}


def test_symmetric_connect_maps_every_peers_box(tmp_path):
    """(A failure in each of the rendezvous' own phases: ``test_startup_phases.py``.)"""
    results = spawn(_symmetric_worker, 3, tmp_path, "past@-1", deadline_s=60)
    for r in results:
        assert r["agreed"] is None and r["in_step"] == 3
        assert r["bases"] == results[0]["bases"]  # one peer table: every rank's box


def test_symmetric_derivation_failing_on_one_rank_names_it_on_every_rank(tmp_path):
    for r in spawn(_symmetric_worker, 3, tmp_path, "past@2", deadline_s=60):
        assert r["in_step"] == 3 and r["agreed"] is not None
        assert r["own"].startswith("lamport-head: 1 rank(s) failed to rendezvous and derive "
                                   "peer addresses from its symmetric memory handle: rank 2: "
                                   "RuntimeError: "
                                   "symmetric memory handle points past this box")


# ---- the backend choice -------------------------------------------------------------

def _choose_worker(rank, nprocs, hosts):
    mailbox.device_key = lambda device: (hosts[rank], f"gpu{rank}")
    mailbox._symmetric_available = lambda: True
    try:
        outcome = list(mailbox.choose_backend(None, "cpu"))
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "in_step": _in_step()}


def test_ranks_on_one_host_get_cuda_ipc(tmp_path):
    """Distinct GPUs of one host, symmetric memory available: CUDA IPC all the same
    (symmetric memory's rendezvous would bind a multicast object by default)."""
    for r in spawn(_choose_worker, 2, tmp_path, ["a", "a"], deadline_s=60):
        assert r["outcome"] == ["ipc", 1] and r["in_step"] == 2


def test_ranks_on_several_hosts_get_no_mailbox_on_every_rank(tmp_path):
    """Unless the operator vouches for one NVLink domain: every rank raises the same
    error (install then leaves every rank stock), never ``symmetric``."""
    results = spawn(_choose_worker, 3, tmp_path, ["a", "b", "a"], deadline_s=60)
    assert len({r["outcome"] for r in results}) == 1
    assert results[0]["outcome"] == ("RuntimeError: lamport-head: the TP ranks span 2 hosts "
                                     "(a, b); a Lamport mailbox maps peers' memory within one "
                                     "host, or one multi-node NVLink domain with "
                                     "LAMPORT_HEAD_MAILBOX=symmetric on every rank")
    assert all(r["in_step"] == 3 for r in results)


def test_decide_across_hosts_forced_or_not():
    two_hosts = [("a", "gpu0"), ("b", "gpu0")]
    for forced in (None, "ipc"):
        with pytest.raises(RuntimeError, match="span 2 hosts"):
            mailbox.decide(two_hosts, [True, True], forced)
    # a multi-node NVLink domain: only an operator who forces symmetric vouches for it
    assert mailbox.decide(two_hosts, [True, True], "symmetric") == "symmetric"


# ---- no multicast on any path -----------------------------------------------------

def _recording_symmetric_memory(calls, multicast_when_unset=True):
    """torch's symmetric-memory entry points, recording each call with the state of
    torch's multicast switch at that moment; ``has_multicast_support`` answers as a
    multicast-capable GPU would (True unless the switch is set)."""
    import os

    from lamport_head.collective import all_gather_objects

    def record(name):
        calls.append((name, os.environ.get(mailbox.MULTICAST_OFF_ENV)))

    def empty(count, dtype, device):
        record("empty")
        return torch.empty(count, dtype=dtype, device=device)

    def rendezvous(box, group):
        record("rendezvous")
        ptrs = all_gather_objects(box.data_ptr(), group)
        return types.SimpleNamespace(world_size=len(ptrs), buffer_ptrs=ptrs)

    class _SymmetricMemory:
        @staticmethod
        def has_multicast_support(device_type, index):
            record("has_multicast_support")
            return multicast_when_unset and os.environ.get(mailbox.MULTICAST_OFF_ENV) != "1"

    fake_symmetric_memory(rendezvous, empty, _SymmetricMemory=_SymmetricMemory)


def _multicast_worker(rank, nprocs, hosts, forced):
    """Install's mailbox steps (choose, allocate, connect) as HeadGather runs them,
    with the user's environment asking for multicast (the switch unset)."""
    import os

    os.environ.pop(mailbox.MULTICAST_OFF_ENV, None)
    if forced:
        os.environ[mailbox.MAILBOX_ENV] = forced
    calls = []
    _recording_symmetric_memory(calls)
    mailbox.device_key = lambda device: (hosts[rank], f"gpu{rank}")
    mailbox._symmetric_available = lambda: True
    kind, _ = mailbox.choose_backend(None, "cpu")
    box, error = attempt(mailbox.MAILBOXES[kind], None, "cpu", nprocs, rank, CAP, WORDS)
    agree(error)
    _, error = attempt(box.connect)
    agree(error)
    return {"kind": kind, "calls": calls}


def test_ranks_of_one_host_never_touch_symmetric_memory(tmp_path):
    """Whatever the environment: distinct GPUs of one host take CUDA IPC, and no
    symmetric-memory entry point (the one that would bind multicast) is called."""
    for r in spawn(_multicast_worker, 2, tmp_path, ["a", "a"], None, deadline_s=60):
        assert r["kind"] == "ipc" and r["calls"] == []


def test_symmetric_memory_across_hosts_is_used_only_with_multicast_off(tmp_path):
    """Ranks on several hosts, symmetric forced (an NVL72 domain): every entry point
    runs with torch's multicast switch on, set by us before the first allocation."""
    for r in spawn(_multicast_worker, 2, tmp_path, ["a", "b"], "symmetric", deadline_s=60):
        assert r["kind"] == "symmetric"
        # (a CPU box: no device to probe for multicast support; the GPU case below)
        assert [name for name, _ in r["calls"]] == ["empty", "rendezvous"]
        assert all(switch == "1" for _, switch in r["calls"]), r["calls"]


def test_a_torch_that_keeps_multicast_on_is_refused(monkeypatch):
    """If torch still reports multicast with the switch set (read too early), the
    allocation refuses (a local step the ranks agree on), before any rendezvous."""
    calls = []
    _recording_symmetric_memory(calls)
    fake = sys.modules["torch.distributed._symmetric_memory"]
    fake._SymmetricMemory.has_multicast_support = staticmethod(lambda device_type, index: True)
    monkeypatch.setattr(torch, "device", lambda d: types.SimpleNamespace(type="cuda", index=0))
    try:
        with pytest.raises(RuntimeError, match="still reports NVLink multicast"):
            mailbox.multicast_off(fake, "cuda:0")
    finally:
        del sys.modules["torch.distributed._symmetric_memory"]
    assert calls == []  # neither empty nor rendezvous ran


def _peer_access_worker(rank, nprocs, index, blocked, unknown=()):
    """Distinct GPUs of one host, each rank's GPU ``GPU-uuid-RANK``; this process sees
    its GPU at local index ``index[rank]`` (0 on every rank: one visible GPU per
    process). The host's topology (NVML's answer, by UUID): every pair reaches except
    ``blocked``; NVML cannot tell about ``unknown``. torch's local-index query answers
    as a process that sees one GPU would: no index reaches another."""
    from lamport_head import peermem

    uuid = [f"GPU-uuid-{r}" for r in range(nprocs)]
    mailbox.device_key = lambda device: ("host", uuid[rank])
    asked = []

    def nvml(a, b):
        asked.append([a, b])
        if [a, b] in [[uuid[x], uuid[y]] for x, y in unknown]:
            return None, "NVML could not tell"
        if [a, b] in [[uuid[x], uuid[y]] for x, y in blocked]:
            return False, "no peer stores: not supported"
        return True, ""

    peermem.p2p_status = nvml
    torch.cuda.can_device_access_peer = lambda a, b: False
    device = types.SimpleNamespace(type="cuda", index=index[rank])
    real = torch.device
    torch.device = lambda d, *a: d if isinstance(d, types.SimpleNamespace) else real(d, *a)
    try:
        outcome = list(mailbox.choose_backend(None, device))
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        torch.device = real
    return {"outcome": outcome, "asked": asked, "in_step": _in_step()}


def test_one_visible_gpu_per_process_reaches_its_peers_by_uuid(tmp_path):
    """Issue 28 item 2: launched with one GPU visible per process (Ray, SLURM,
    Kubernetes), every rank's GPU is its local index 0. The check asks about the right
    pairs, by UUID, and every rank takes ipc (0a45b23 asked about (0, 0), got no, and
    every rank went stock naming GPU 0 and GPU 0)."""
    results = spawn(_peer_access_worker, 3, tmp_path, [0, 0, 0], [], deadline_s=60)
    for rank, r in enumerate(results):
        assert r["outcome"] == ["ipc", 1] and r["in_step"] == 3
        assert r["asked"] == [[f"GPU-uuid-{rank}", f"GPU-uuid-{p}"] for p in range(3) if p != rank]


def test_gpus_without_peer_access_give_every_rank_one_reason(tmp_path):
    """Issue 20 item 1, by UUID (issue 28 item 2): a GPU that cannot reach a TP peer's
    memory (PCIe without P2P), whatever each process's numbering (here a permuted
    visible list): every rank raises the same error naming the pair (install: every
    rank stock, one line). A pair NVML cannot tell about is left to the mapping."""
    results = spawn(_peer_access_worker, 3, tmp_path, [2, 0, 1], [(2, 0)], deadline_s=60)
    assert len({r["outcome"] for r in results}) == 1 and all(r["in_step"] == 3 for r in results)
    assert results[0]["outcome"] == (
        "RuntimeError: lamport-head: 1 rank(s) failed to reach its TP peers' GPUs (CUDA peer "
        "access): rank 2: RuntimeError: GPU GPU-uuid-2 (rank 2) cannot reach GPU GPU-uuid-0's "
        "memory (rank 0): no peer stores: not supported")
    (tmp_path / "unknown").mkdir()
    for r in spawn(_peer_access_worker, 3, tmp_path / "unknown", [2, 0, 1], [], [(2, 0)],
                   deadline_s=60):
        assert r["outcome"] == ["ipc", 1]
