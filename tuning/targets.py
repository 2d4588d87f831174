"""The timing target ``tune`` and ``bench`` measure on, chosen in one place: under
torchrun (``WORLD_SIZE`` > 1) one rank per process, ``harness.DistributedTarget``
(``harness.AllToAllTarget`` for the all-to-all: ``harness.target_for``); else TP
virtual ranks on this process's GPU, ``harness.EmulatedTarget`` (``tune`` of the
all-to-all refuses it: an all-to-all section is measured on real ranks;
``bench --all-to-all`` builds its ``EmulatedAllToAllTarget`` beside it)."""

import os
from dataclasses import dataclass

import torch

from lamport_head.table import ALL_TO_ALL_STOCK, NCCL_STOCK


@dataclass
class Chosen:
    target: object  # DistributedTarget or EmulatedTarget
    device: torch.device
    world: int  # the processes torchrun started; 1: this one process, emulating
    root: bool  # this process prints and writes
    emulated: bool  # not one rank per GPU (virtual ranks, or processes sharing a GPU)


def make_target(command, tp, vocab, *, emulate=None, shared_note="", dtype="bfloat16",
                stock=NCCL_STOCK):
    """The target of ``lamport-head COMMAND`` at ``tp`` ranks and ``vocab`` of logits of
    ``dtype`` (``--dtype``: a ``dtypes`` name), timing the collective that replaces
    ``stock`` (``table.STOCKS``). Under
    torchrun the ranks are started here; where they share a GPU the root prints the
    note, ``shared_note`` after it. ``emulate`` (tune's --emulate; None: not asked)
    is checked: torchrun's ranks must be ``tp``, and one process at ``tp`` > 1 needs it.
    One process and the all-to-all: SystemExit (real ranks only)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from lamport_head.tuning.support.procs import SHARED_NOTE, init_ranks

        from . import harness

        ranks = init_ranks()
        if emulate is not None and ranks.world != tp:
            raise SystemExit(f"lamport-head {command}: --tp {tp} but torchrun started "
                             f"{ranks.world} ranks")
        target = harness.target_for(stock)(ranks, vocab, dtype=dtype)
        if ranks.shared and ranks.is_root:
            print(f"lamport-head {command}: {SHARED_NOTE}{shared_note}", flush=True)
        return Chosen(target, ranks.device, world, ranks.is_root, ranks.shared)
    if stock == ALL_TO_ALL_STOCK:
        raise SystemExit(f"lamport-head {command}: the all-to-all is timed on real ranks only "
                         "(no emulated all-to-all): torchrun --nproc-per-node TP")
    if emulate is not None and not emulate and tp > 1:
        raise SystemExit(f"lamport-head {command}: one process sees one rank; use --emulate for "
                         "TP virtual ranks on one GPU, or torchrun --nproc-per-node TP")
    from .harness import EmulatedTarget

    device = torch.device("cuda", torch.cuda.current_device())
    return Chosen(EmulatedTarget(device, tp, vocab, dtype=dtype), device, 1, True, True)
