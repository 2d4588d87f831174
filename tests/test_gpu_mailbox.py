"""Mailbox backends on the GPU host's torch: the symmetric-memory peer addresses
derived from this rank's own pointer (one-rank group: symmetric memory works on one
GPU), allocated after other symmetric tensors, as PyTorch's handle reports them."""

import pytest
import torch
import torch.distributed as dist

from lamport_head.mailbox import symmetric_bases

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank_group(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def test_symmetric_box_address_after_other_allocations(one_rank_group):
    import torch.distributed._symmetric_memory as symm_mem

    device = one_rank_group
    others = [symm_mem.empty(n, dtype=torch.int32, device=device) for n in (1000, 77777)]
    for t in others:
        symm_mem.rendezvous(t, dist.group.WORLD)
    box = symm_mem.empty(4096, dtype=torch.int32, device=device)
    handle = symm_mem.rendezvous(box, dist.group.WORLD)
    bases = symmetric_bases(handle.buffer_ptrs, box.data_ptr(), 0)
    assert bases[0] == box.data_ptr()
    offset = (bases[0] - int(handle.buffer_ptrs[0])) // 4
    view = handle.get_buffer(0, (4096,), torch.int32, storage_offset=offset)
    box.copy_(torch.arange(4096, dtype=torch.int32, device=device))
    assert view.data_ptr() == box.data_ptr() and torch.equal(view, box)
    print(f"\nbuffer_ptrs[0] = {int(handle.buffer_ptrs[0]):#x}, box = {box.data_ptr():#x}, "
          f"offset {offset * 4} B (torch {torch.__version__})")


def test_a_symmetric_mailbox_binds_no_multicast_object(one_rank_group, monkeypatch):
    """The real SymmetricMailbox on a one-rank group, the environment asking for
    multicast (switch unset): the mailbox switches multicast off before torch's first
    allocation, torch then reports no multicast support, and the handle carries no
    multicast address."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._autograd import DeviceType

    from lamport_head import mailbox

    monkeypatch.delenv(mailbox.MULTICAST_OFF_ENV, raising=False)
    device = one_rank_group
    box = mailbox.SymmetricMailbox(None, device, 2, 0, 1, 8)  # allocate: local step
    assert symm_mem._SymmetricMemory.has_multicast_support(DeviceType.CUDA, device.index) is False
    handle = symm_mem.rendezvous(box.box, dist.group.WORLD)
    assert int(getattr(handle, "multicast_ptr", 0) or 0) == 0
    print(f"\nmulticast support before: see CHANGELOG.md 0.3.0; after multicast_off: False; handle "
          f"multicast_ptr {getattr(handle, 'multicast_ptr', None)}")
