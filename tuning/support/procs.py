"""Real ranks under torchrun: one process per rank, on GPUs of their own or sharing one.

``init_ranks()`` maps each local rank to a GPU and starts the process group:

- as many GPUs as local ranks (or more): rank i on GPU i, NCCL;
- fewer GPUs than local ranks: N processes on ONE GPU (local rank i on GPU
  ``i % count``; NCCL refuses two ranks on one GPU), or one GPU visible per process
  (``CUDA_VISIBLE_DEVICES`` per rank: every rank's GPU is its index 0): gloo either
  way. Shared, the contexts time-slice the GPU, so that mode proves correctness
  across real processes and says nothing about speed.

The mailbox is ``ipc`` on one host in every case; it tells the two shapes apart by
the GPUs' UUIDs (``mailbox.choose_backend``), not by these indices.

NVLink multicast stays off in every process (set before the group starts).
"""

import os
from dataclasses import dataclass

import torch

SHARED_NOTE = ("processes share a GPU (CUDA IPC mailbox, gloo): their contexts time-slice it, "
               "so timings in this mode are not performance")


def no_multicast():
    """Keep NCCL, symmetric memory and NVSHMEM off NVLink multicast in this process."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


@dataclass(frozen=True)
class Ranks:
    device: torch.device
    rank: int
    world: int
    shared: bool  # several ranks on one GPU (gloo, IPC): correctness only
    backend: str
    group: object = None  # the default group

    @property
    def is_root(self):
        return self.rank == 0


def init_ranks(timeout_s: float = 600.0) -> Ranks:
    """This process's rank, device and process group (torchrun's environment)."""
    import datetime

    import torch.distributed as dist

    no_multicast()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("no CUDA GPU visible to this process")
    shared = count < local_world
    device = torch.device("cuda", local % count)
    torch.cuda.set_device(device)
    backend = "gloo" if shared else "nccl"
    kwargs = {} if shared else {"device_id": device}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Ranks(device, dist.get_rank(), dist.get_world_size(), shared, backend)
