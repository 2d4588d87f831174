"""The agreement collectives, on NCCL or gloo alike (gloo gets CPU tensors, NCCL the rank's
device; ``group=None``: the world). ``attempt``/``agree``: docs/design.md, "Together or
alone". ``step`` bounds a start-up step in time (the group's own timeout is 30 min on gloo,
none on vLLM's CPU group) and keeps a rank's collectives on one thread, in order.
"""

import contextlib
import contextvars
import functools
import threading
import time

import torch
import torch.distributed as dist


class PeerFailed(RuntimeError):
    """Another rank failed a step this rank finished; every rank stops together."""


_TOGETHER = "_lamport_head_raised_together"


def raised_together(exc) -> bool:
    """Whether every rank raised ``exc`` at the same step: only then may they all take a
    fallback; any other exception must stop this rank."""
    return bool(getattr(exc, _TOGETHER, False))


def together(exc):
    """Mark ``exc`` as raised on every rank alike (decided from gathered facts); returns it."""
    setattr(exc, _TOGETHER, True)
    return exc


def _where(group, device):
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(device)


_STEP = contextvars.ContextVar("lamport_head_step", default=None)


def _on_caller(fn):
    """A collective that, called in a ``step``'s helper thread, runs on the step's caller."""
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        current = _STEP.get()
        if current is None:
            return fn(*args, **kwargs)
        if threading.current_thread() is not current.helper:
            raise RuntimeError(f"lamport-head: a collective ({fn.__name__}) inside a local part "
                               f"of {current.what} (attempt/within): collectives go on the "
                               "step's own thread")
        return current.collective(collective, args, kwargs)

    return collective


@_on_caller
def _reduce(value, op, group, device, dtype):
    t = torch.tensor([value], dtype=dtype, device=_where(group, device))
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def all_min(value: int, group=None, device="cpu") -> int:
    return int(_reduce(int(value), dist.ReduceOp.MIN, group, device, torch.int64))


def all_max(value: float, group=None, device="cpu") -> float:
    return float(_reduce(float(value), dist.ReduceOp.MAX, group, device, torch.float64))


@_on_caller
def all_gather_objects(obj, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@_on_caller
def broadcast_object(obj, group=None):
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group=None, device="cpu"):
    """A barrier that also works where ``dist.barrier`` would pick a wrong device."""
    all_min(1, group, device)


def agree(error, group=None, device="cpu", what="the step"):
    """Collective, after a local step: raises on every rank if any failed (``error``: this
    rank's or None), the failing rank its own, the others ``PeerFailed``, both together."""
    if all_min(error is None, group, device):
        return
    if error is not None:
        raise together(error)
    raise together(PeerFailed(f"lamport-head: another rank failed {what}"))


def attempt(fn, *args, **kwargs):
    """``(fn(...), None)`` or ``(None, the exception)``, for ``agree``; bounded inside a
    ``step``, so a rank blocking there still reaches the collective that follows."""
    current = _STEP.get()
    try:
        if current is not None and threading.current_thread() is current.helper:
            return current.bounded(functools.partial(fn, *args, **kwargs)), None
        return fn(*args, **kwargs), None
    except Exception as exc:
        return None, exc


def within(seconds, what, fn, *args, why=""):
    """``fn(*args)`` within ``seconds``, else ``TimeoutError`` (``fn`` left in a daemon thread)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    current = _STEP.get()
    scope = current.scope if current is not None else contextlib.nullcontext

    def inside():  # the step's thread setup (the CUDA device) in this thread too
        with scope():
            run()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(inside,),
                              name=f"lamport-head: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {seconds:g} s{why}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class StepAbandoned(TimeoutError):
    """Raised in a helper thread given up on, at its next collective or local part."""


class _Step:

    def __init__(self, seconds, what, scope):
        self.seconds, self.what, self.scope = seconds, what, scope or contextlib.nullcontext
        self.lock = threading.Condition()
        self.helper = None
        self.state, self.since = "own", time.monotonic()  # "own", "attempt", "collective"
        self.request = self.reply = self.outcome = None
        self.abandoned = False

    def _begin(self, state):
        if self.abandoned:
            raise StepAbandoned(f"{self.what} was given up on by its caller after "
                                f"{self.seconds:g} s: this thread enters nothing more")
        self.state = state

    def _end(self):
        self.state, self.since = "own", time.monotonic()
        self.lock.notify_all()

    def bounded(self, fn):
        """Helper side: a local part before a collective, bounded by ``seconds``."""
        with self.lock:
            self._begin("attempt")
        try:
            return within(self.seconds, f"{self.what} (a local part)", fn)
        finally:
            with self.lock:
                self._end()

    def collective(self, fn, args, kwargs):
        """Helper side: ``fn(*args, **kwargs)`` run by the caller's thread."""
        with self.lock:
            self._begin("collective")
            self.request = (fn, args, kwargs)
            self.lock.notify_all()
            while self.reply is None:
                self.lock.wait()
            (value, error), self.reply = self.reply, None
            self._end()
        if error is not None:
            raise error
        return value

    def serve(self):
        """Caller side: run the helper's collectives; ``TimeoutError`` past its own ``seconds``."""
        while True:
            with self.lock:
                while True:
                    if self.outcome is not None:
                        value, error = self.outcome
                        if error is not None:
                            raise error
                        return value
                    if self.request is not None:
                        (fn, args, kwargs), self.request = self.request, None
                        break
                    if self.state == "own":
                        left = self.since + self.seconds - time.monotonic()
                        if left <= 0:
                            self.abandoned = True
                            raise TimeoutError(f"{self.what} did not return within "
                                               f"{self.seconds:g} s")
                        self.lock.wait(left)
                    else:  # a local part bounds itself; a collective's reply is on its way
                        self.lock.wait()
            try:
                reply = (fn(*args, **kwargs), None)
            except BaseException as exc:  # handed to the helper, which raises it
                reply = (None, exc)
            with self.lock:
                self.reply = reply
                self.lock.notify_all()


def step(seconds, what, fn, *args, scope=None):
    """``fn(*args)`` in a helper thread whose collectives run on this one, unless it spends
    ``seconds`` in code of its own: then ``TimeoutError``. A helper given up on enters no
    collective again, so its code between them must touch no peer. ``scope``: entered in
    every thread of the step (the CUDA device is per thread)."""
    current = _Step(seconds, what, scope)

    def run():
        _STEP.set(current)
        try:
            with current.scope():
                outcome = (fn(*args), None)
        except BaseException as exc:  # handed to the caller's thread
            outcome = (None, exc)
        with current.lock:
            current.outcome = outcome
            current.lock.notify_all()

    current.helper = threading.Thread(target=contextvars.copy_context().run, args=(run,),
                                      name=f"lamport-head: {what}", daemon=True)
    with current.lock:
        current.since = time.monotonic()
    current.helper.start()
    return current.serve()
