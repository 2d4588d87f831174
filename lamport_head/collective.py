"""The agreement collectives every multi-rank path uses, on NCCL or gloo alike.

Fail-stop rule: a rank never leaves a collective sequence alone. Whatever can fail
locally runs first, inside ``attempt``; then every rank calls ``agree`` with its
outcome and either every rank goes on or every rank raises. gloo gets CPU tensors
(it refuses CUDA ones for these ops), NCCL the rank's device.

``group=None`` is the default (world) group.

Start-up steps are also bounded in time (``step``): a rank that blocks in a step (a
compile, an IPC open, a sync that never returns) must not hold its peers in the
next collective until the group's own timeout (gloo's: 30 min; vLLM's CPU group sets
none). ``step`` runs the step in a helper thread and hands its collectives back to
the calling thread, so that every collective of a rank is issued by one thread, in
order, and a step given up on can never issue one later: the helper's next
collective raises instead. A local part that precedes a collective goes through
``attempt`` (``mailbox.exchange`` does), which a step bounds itself: a rank blocking
there still reaches the collective, with its timeout as its error, so its peers are
never left waiting inside it. The step is given up on only when the helper is in
code of its own, past every collective of the step or before the first (or is
blocked there for ``seconds``); the caller then agrees on the ``TimeoutError`` as on
any failure.
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
    """Whether ``exc`` was raised on every rank at the same step (``agree``, or a
    failure a caller marked with ``together``): every rank is out of the collective
    sequence alike, so every rank may take the same fallback. Any other exception
    left this rank alone, its peers possibly inside a collective it will never join:
    the only safe outcome is to stop (fail-stop), never a fallback of its own."""
    return bool(getattr(exc, _TOGETHER, False))


def together(exc):
    """Mark ``exc`` as raised on every rank alike (a decision made from gathered facts,
    the same everywhere); returns it, to be raised."""
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
    """Every rank calls this after a local step: raises on every rank if any failed.

    ``error``: the exception this rank caught (None when its step succeeded). The
    failing rank re-raises its own error; the others raise ``PeerFailed``; both marked
    ``raised_together``."""
    if all_min(error is None, group, device):
        return
    if error is not None:
        raise together(error)
    raise together(PeerFailed(f"lamport-head: another rank failed {what}"))


def attempt(fn, *args, **kwargs):
    """``(fn(...), None)``, or ``(None, the exception)``: a local step to agree on.
    Inside a ``step``'s helper thread it is also bounded by the step's ``seconds``
    (``within``: a ``TimeoutError`` is its exception), so a rank blocking there still
    reaches the collective that follows."""
    current = _STEP.get()
    try:
        if current is not None and threading.current_thread() is current.helper:
            return current.bounded(functools.partial(fn, *args, **kwargs)), None
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
    """``fn(*args)``, a start-up step that may issue collectives, if it ends within
    ``seconds`` of code of its own; else ``TimeoutError`` naming ``what``.

    ``fn`` runs in a helper thread; each collective it issues (through this module:
    ``all_min``, ``all_gather_objects``, ``agree``, ``barrier``, ...) is run by this
    thread, so this rank's collectives keep one order on one thread; each ``attempt``
    in it is bounded by ``seconds`` too (a rank blocking before a collective still
    reaches it, with its timeout for an error). The helper is given up on only while
    it runs code of its own (between its collectives and local parts) for
    ``seconds``: then this thread raises, and the helper, if it ever unblocks, raises
    ``StepAbandoned`` at its next collective or local part instead of entering it,
    so its peers never meet it in a collective they have left. What it does alone
    meanwhile (finish a compile, map a peer's memory, write its own box) touches no
    peer. ``scope``: a context manager factory entered in the helper thread and in
    each thread of its local parts (the CUDA device, which is per thread)."""
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
