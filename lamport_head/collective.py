"""The agreement collectives every multi-rank path uses, on NCCL or gloo alike.

Fail-stop rule: a rank never leaves a collective sequence alone. Whatever can fail
locally runs first, inside ``attempt``; then every rank calls ``agree`` with its
outcome and either every rank goes on or every rank raises. gloo gets CPU tensors
(it refuses CUDA ones for these ops), NCCL the rank's device.

``group=None`` is the default (world) group.
"""

import threading

import torch
import torch.distributed as dist


class PeerFailed(RuntimeError):
    """Another rank failed a step this rank finished; every rank stops together."""


def _where(group, device):
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(device)


def _reduce(value, op, group, device, dtype):
    t = torch.tensor([value], dtype=dtype, device=_where(group, device))
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def all_min(value: int, group=None, device="cpu") -> int:
    return int(_reduce(int(value), dist.ReduceOp.MIN, group, device, torch.int64))


def all_max(value: float, group=None, device="cpu") -> float:
    return float(_reduce(float(value), dist.ReduceOp.MAX, group, device, torch.float64))


def all_gather_objects(obj, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, group=None):
    """Rank 0 of ``group``'s ``obj`` on every rank."""
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group=None, device="cpu"):
    """A barrier that also works where ``dist.barrier`` would pick a wrong device."""
    all_min(1, group, device)


def agree(error, group=None, device="cpu", what="the step"):
    """Every rank calls this after a local step: raises on every rank if any failed.

    ``error``: the exception this rank caught (None when its step succeeded). The
    failing rank re-raises its own error; the others raise ``PeerFailed``."""
    if all_min(error is None, group, device):
        return
    if error is not None:
        raise error
    raise PeerFailed(f"lamport-head: another rank failed {what}")


def attempt(fn, *args, **kwargs):
    """``(fn(...), None)``, or ``(None, the exception)``: a local step to agree on."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # reported to every rank by ``agree``
        return None, exc


def within(seconds, what, fn, *args, why=""):
    """``fn(*args)`` if it returns or raises within ``seconds``; else ``TimeoutError``
    naming ``what`` (and ``why``), while ``fn`` goes on in a daemon thread, its outcome
    dropped: a local step that may block for ever (a peer gone inside torch's
    rendezvous, a CUDA context that never answers) bounded in time."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"lamport-head: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {seconds:g} s{why}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
