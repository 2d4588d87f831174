"""Issue 28 item 1, pinned on the CPU where exporter and importer devices differ: the real
``IpcMailbox`` over the real ``peermem.CudaSegments``, its driver a stand-in
(tests/fake_driver.py: memfd memory mapped at the reserved addresses, shared between the
processes as cuMem's is; every call fails as CUDA's does when no context is current on
the calling thread, so a call made before binding the device's context, or from a thread
that never bound it, fails the test). Each rank maps every peer's box for ITS OWN device, and no
driver call names another device, whether every process sees all GPUs (rank r's GPU is
its ordinal r) or only its own (ordinal 0 everywhere). At 0a45b23 peers were opened
through torch's CUDA tensor sharing under the exporter's device: no import here, and
the test fails."""

import pytest
import torch
import torch.distributed as dist
from fake_driver import FakeDriver
from spawn import spawn

from lamport_head import mailbox, peermem
from lamport_head.collective import agree, attempt

CAP, WORDS = 2, 8


def _worker(rank, nprocs, ordinals):
    uuid = [f"GPU-uuid-{r}" for r in range(nprocs)]
    fake = FakeDriver(ordinals[rank], uuid[rank])
    peermem.segments_for = lambda device: peermem.CudaSegments(device, driver=fake, bind=fake.bind)
    box = mailbox.IpcMailbox(None, "cpu", nprocs, rank, CAP, WORDS)
    _, error = attempt(box.connect)
    agree(error, None, "cpu", "to map the peers' mailboxes")
    box.box.fill_(100 + rank)
    dist.barrier()
    seen = [int(box.peer_view(p)[-1]) for p in range(nprocs)]  # the box's last word too
    box.peer_view((rank + 1) % nprocs)[0] = 200 + rank  # a push into the next rank's box
    dist.barrier()
    pushed = int(box.box[0])
    table = box.peers.tolist()
    dist.barrier()
    box._release()
    return {"seen": seen, "pushed": pushed, "named": sorted({d for _, d in fake.named}),
            "calls": sorted({c for c, _ in fake.named}), "imports": sorted(fake.imports),
            "own": ordinals[rank], "bases": table[0], "live": len(fake.live)}


@pytest.mark.parametrize("ordinals", [[0, 1, 2], [0, 0, 0], [2, 0, 1]],
                         ids=["all-visible", "one-visible-each", "permuted"])
def test_every_rank_maps_its_peers_for_its_own_device(tmp_path, ordinals):
    for rank, r in enumerate(spawn(_worker, 3, tmp_path, ordinals, deadline_s=60)):
        assert r["seen"] == [100, 101, 102]  # every peer's box, whole, through the mapping
        assert r["pushed"] == 200 + (rank - 1) % 3  # a peer's store landed in this box
        # the allocation, its access and every peer's mapping: this rank's device only
        assert r["named"] == [r["own"]]
        assert r["calls"] == ["cuDeviceGetAttribute", "cuMemCreate",
                              "cuMemGetAllocationGranularity", "cuMemSetAccess"]
        assert r["imports"] == [f"GPU-uuid-{p}" for p in range(3) if p != rank]
        assert len(set(r["bases"])) == 3  # the table holds this process's mappings
        assert r["live"] == 0  # close unmapped all three


def test_a_descriptor_that_never_comes_is_named(tmp_path):
    """The receive is bounded and names the rank it waited for."""
    channel = peermem.FdChannel()
    try:
        with pytest.raises(RuntimeError, match=r"no mailbox descriptor from rank\(s\) \[3\] within 0.2 s"):
            channel.receive([3], wait_s=0.2)
    finally:
        channel.close()


def test_host_segments_share_pages_between_processes_through_a_descriptor():
    memory = peermem.HostSegments()
    own = memory.create(64)
    other = memory.open(own.fd, own.size)
    memory.tensor(own, 16).fill_(7)
    assert torch.equal(memory.tensor(other, 16), torch.full((16,), 7, dtype=torch.int32))
    memory.close(other)
    memory.close(own)


def test_sixteen_ranks_hand_out_their_descriptors_though_an_inbox_holds_a_dozen():
    """Every rank sends to every peer before any receives, and a datagram inbox holds
    about a dozen messages (``net.unix.max_dgram_qlen``: 10 here and in a fresh network
    namespace). With 16 ranks (TP up to 32 when ranks share GPUs) a blocking send
    deadlocked every rank until start-up's deadline; a sender now reads its own inbox
    while it waits for a peer's. Each rank gets every peer's own descriptor."""
    import os
    import threading

    n = 16
    channels = [peermem.FdChannel() for _ in range(n)]
    names = {r: c.name for r, c in enumerate(channels)}
    fds = []
    for r in range(n):
        fd = os.memfd_create(f"rank{r}")
        os.write(fd, bytes([r]))
        fds.append(fd)
    seen, errors = {}, []

    def rank(r):
        try:
            channels[r].send_all({p: names[p] for p in range(n) if p != r}, r, fds[r], wait_s=20)
            got = channels[r].receive([p for p in range(n) if p != r], wait_s=20)
            seen[r] = {p: os.pread(fd, 1, 0)[0] for p, fd in got.items()}
            for fd in got.values():
                os.close(fd)
        except Exception as exc:  # noqa: BLE001  reported below
            errors.append(f"rank {r}: {exc}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert seen == {r: {p: p for p in range(n) if p != r} for r in range(n)}
    finally:
        for c in channels:
            c.close()
        for fd in fds:
            os.close(fd)


def test_nvml_that_cannot_start_leaves_the_pair_to_the_mapping(monkeypatch):
    """The library is there but will not initialize (a container's partial driver
    mount, a driver/library mismatch): NVML cannot tell, so the mapping decides (its
    failure is agreed, named) instead of every rank going stock on NVML's word."""
    def broken():
        raise RuntimeError("nvmlInit failed")

    monkeypatch.setattr(peermem, "_nvml", broken)
    ok, why = peermem.p2p_status("GPU-a", "GPU-b")
    assert ok is None and "nvmlInit failed" in why
