"""Start-up never hangs on a one-rank failure at any phase of the peer exchange
(issue 19 item 3), on 3 gloo processes (CPU), through the engines' install.

The mailboxes are the real ``IpcMailbox`` and ``SymmetricMailbox`` (CPU tensors;
only the kernels are stood in, ``helpers.fake_cuda``). Symmetric memory is a
stand-in module whose ``rendezvous`` has torch's phases, over the group's store as
torch's has: an all-gather of the handles, an exchange of file descriptors, the
import and mapping of every peer (local), a store barrier. One rank fails in one
phase; a failure inside the rendezvous leaves its peers waiting in a later phase
(that is how torch's behaves), the fd exchange and the barrier with no timeout a
caller can set, which only the rendezvous' deadline ends. Every rank
must come out stock, with one warning naming the failing rank, before the spawn
deadline, and then meet its peers in the next collective.
"""

import itertools
import os
import time
import types

import pytest
import torch
import torch.distributed as dist
from helpers import capture_log, fake_cuda, fake_symmetric_memory, model
from spawn import spawn
from tables import TWO_RANKS as TABLE

from lamport_head import head_gather, mailbox

WAIT_S = 2.0  # how long a rank waits for the rendezvous in this test (RENDEZVOUS_WAIT_S)
SYMMETRIC_PHASES = ("handles", "fds", "map", "after")
IPC_PHASES = ("export", "map", "arm")


def _phased_symmetric_memory(rank, phase, failing):
    """``torch.distributed._symmetric_memory`` with torch's rendezvous phases; rank
    ``failing`` raises at ``phase`` ("after": once the rendezvous is over, in
    torch's own post-processing)."""
    from torch.distributed import distributed_c10d as c10d

    calls = itertools.count()

    def fail(here):
        if rank == failing and phase == here:
            raise RuntimeError(f"injected: rendezvous phase {here!r} failed")

    def rendezvous(box, group):
        store = c10d.PrefixStore("symmetric_memory-test", c10d._get_process_group_store(group))
        world, n = dist.get_world_size(group), next(calls)

        def all_gather(tag, value):
            store.set(f"{n}/{tag}/{rank}", str(value))
            return [int(store.get(f"{n}/{tag}/{r}")) for r in range(world)]

        def unbounded(key):
            # torch's fd exchange (a local socket) and its store barrier (the prefix
            # store's own timeout) honour no timeout a caller could set: wait as long
            while True:
                try:
                    return store.get(key)
                except Exception:  # this store's own timeout: keep waiting
                    time.sleep(0.05)

        fail("handles")  # before publishing its handle: peers wait for it
        ptrs = all_gather("handles", box.data_ptr())
        fail("fds")  # peers wait for its file descriptors
        store.set(f"{n}/fds/{rank}", str(1000 + rank))
        for r in range(world):
            unbounded(f"{n}/fds/{r}")
        fail("map")  # importing and mapping a peer: peers wait in the barrier
        store.set(f"{n}/barrier/{rank}", "1")
        for r in range(world):
            unbounded(f"{n}/barrier/{r}")
        fail("after")  # peers have returned and gone on
        return types.SimpleNamespace(world_size=world, buffer_ptrs=ptrs)

    fake_symmetric_memory(rendezvous)


def _inject_ipc(rank, phase, failing):
    import multiprocessing.reduction as reduction

    torch.multiprocessing.set_sharing_strategy("file_system")  # no fd passing between ranks
    if rank != failing:
        return
    if phase == "export":
        def refuse(*args, **kwargs):
            raise RuntimeError("injected: cannot export an IPC handle")

        reduction.ForkingPickler.dumps = refuse
    elif phase == "map":
        def cannot_open(blob):
            raise RuntimeError("injected: cannot open a peer's IPC handle")

        mailbox.pickle = types.SimpleNamespace(loads=cannot_open)
    elif phase == "arm":
        def cannot_arm(self):
            raise RuntimeError("injected: cannot arm the mailbox")

        mailbox.IpcMailbox.arm = cannot_arm


def _worker(rank, nprocs, table, backend, phase, failing):
    os.environ["LAMPORT_HEAD_TABLE"] = table
    os.environ[mailbox.BACKEND_ENV] = backend
    fake_cuda(setattr, rank, "ok")
    head_gather.MAILBOXES = {"ipc": mailbox.IpcMailbox, "symmetric": mailbox.SymmetricMailbox}
    mailbox.RENDEZVOUS_WAIT_S = WAIT_S
    mailbox._symmetric_available = lambda: True
    if backend == "symmetric":
        _phased_symmetric_memory(rank, phase, failing)
    else:
        _inject_ipc(rank, phase, failing)
    from lamport_head.engines.vllm import install_logits_gather

    seen = capture_log()
    m = model(lm__tp_size=nprocs)
    started = time.monotonic()
    served = install_logits_gather(m, None, nprocs, rank, "cpu")
    took = time.monotonic() - started
    t = torch.tensor([1])
    dist.all_reduce(t)  # the program's next collective: every rank gets here
    return {"served": list(served), "took_s": took, "met": int(t.item()),
            "warnings": [x for x in seen if "stays stock" in x]}


def _run(tmp_path, backend, phase, failing=1, nprocs=3):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE.replace("tp: 2", f"tp: {nprocs}"))
    return spawn(_worker, nprocs, tmp_path, str(table), backend, phase, failing, deadline_s=90)


@pytest.mark.parametrize("backend,phase", [("symmetric", p) for p in SYMMETRIC_PHASES]
                         + [("ipc", p) for p in IPC_PHASES])
def test_one_rank_failing_any_phase_of_the_exchange_leaves_every_rank_stock(tmp_path, backend,
                                                                            phase):
    results = _run(tmp_path, backend, phase)
    for rank, r in enumerate(results):
        assert r["served"] == [] and r["met"] == 3, r
        assert len(r["warnings"]) == 1, r["warnings"]  # one line per rank
        if rank == 1:  # the failing rank names its cause
            assert "injected" in r["warnings"][0], r
        else:  # its peers name it, or say another rank failed
            assert "rank 1" in r["warnings"][0] or "another rank failed" in r["warnings"][0], r
        assert r["took_s"] < 3 * WAIT_S + 10, r  # a stranded wait ends at the bound


@pytest.mark.parametrize("backend", ["symmetric", "ipc"])
def test_with_no_failure_every_rank_serves(tmp_path, backend):
    """The same programs with nothing injected serve every enabled row (the injected
    cases above fail for the injected reason, not for the stand-ins)."""
    for r in _run(tmp_path, backend, phase="none"):
        assert r["served"] == [1, 2, 4] and r["met"] == 3 and r["warnings"] == [], r
