"""The agreement collectives every multi-rank path uses, on NCCL or gloo alike.

A rank never leaves a collective sequence alone: local work runs in ``attempt``, then
every rank calls ``agree`` and all go on or all raise (docs/design.md, "Together or
alone"). ``step`` bounds a start-up step in time, since the group's own timeout is 30
min (gloo) or none (vLLM's CPU group), and keeps a rank's collectives on one thread, in
order. gloo gets CPU tensors (it refuses CUDA ones), NCCL the rank's device;
``group=None`` is the world group.
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
    """Whether every rank raised ``exc`` at the same step (``agree``, or ``together``):
    only then may every rank take the same fallback. Any other exception must stop
    this rank (fail-stop), never send it to a fallback of its own."""
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
    """A collective that, called inside a ``step``'s helper thread, runs on the thread
    that called ``step`` (the rank's one thread of collectives)."""
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
    """Rank 0 of ``group``'s ``obj`` on every rank."""
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group=None, device="cpu"):
    """A barrier that also works where ``dist.barrier`` would pick a wrong device."""
    all_min(1, group, device)


def agree(error, group=None, device="cpu", what="the step"):
    """Collective, after a local step: raises on every rank if any failed (``error``:
    this rank's exception, or None). The failing rank raises its own, the others
    ``PeerFailed``; both marked ``raised_together``."""
    if all_min(error is None, group, device):
        return
    if error is not None:
        raise together(error)
    raise together(PeerFailed(f"lamport-head: another rank failed {what}"))


def attempt(fn, *args, **kwargs):
    """``(fn(...), None)`` or ``(None, the exception)``, for ``agree``. Inside a ``step``
    it is bounded by the step's ``seconds`` (a ``TimeoutError``), so a rank blocking
    there still reaches the collective that follows."""
    current = _STEP.get()
    try:
        if current is not None and threading.current_thread() is current.helper:
            return current.bounded(functools.partial(fn, *args, **kwargs)), None
        return fn(*args, **kwargs), None
    except Exception as exc:  # reported to every rank by ``agree``
        return None, exc


def within(seconds, what, fn, *args, why=""):
    """``fn(*args)`` if it returns or raises within ``seconds``; else ``TimeoutError``
    naming ``what`` (and ``why``), ``fn`` left running in a daemon thread, its outcome
    dropped."""
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
    """Raised in a step's helper thread that its caller gave up on, instead of the
    collective or local part it was about to begin: it never enters one again."""


class _Step:
    """One bounded step: where its helper thread is (code of its own, a bounded local
    part, a collective handed to the caller), and the collective handed over."""

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
        """Caller side: run the helper's collectives until it is done; raise
        ``TimeoutError`` once it has spent ``seconds`` in code of its own."""
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
    """``fn(*args)``, a start-up step that may issue collectives, unless it spends
    ``seconds`` in code of its own: then ``TimeoutError`` naming ``what``.

    ``fn`` runs in a helper thread; the collectives it issues through this module run
    on this thread, and its ``attempt``s are bounded by ``seconds``. A helper given up
    on raises ``StepAbandoned`` at its next collective or local part, so no peer meets
    it in a collective they have left; its code between them must touch no peer.
    ``scope``: a context-manager factory entered in the helper and its local parts'
    threads (the CUDA device is per thread)."""
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
