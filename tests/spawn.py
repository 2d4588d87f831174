"""Run a function in N processes on a fresh gloo group, with a deadline: a rank that
hangs in a collective fails the test instead of hanging it. The one launcher of the
tests' ranks (test_multiproc launches whole programs, as torchrun does: not functions)."""

import json
import os

import torch.multiprocessing as mp

DEADLINE_S = 120


def _entry(rank, fn, nprocs, init, timeout_s, out, args):
    import sys

    if init:
        import datetime

        import torch.distributed as dist

        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nprocs, **timeout)
    result = fn(rank, nprocs, *args)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()  # os._exit flushes nothing (a rank may print into a file)
    sys.stderr.flush()
    # no destroy: a test may leave peers in different states on purpose; exit at once
    os._exit(0)


def spawn(fn, nprocs, tmp_path, *args, deadline_s=DEADLINE_S, group=True, timeout_s=None):
    """``fn(rank, nprocs, *args)`` in each of ``nprocs`` processes; the JSON-able
    results in rank order (each also left in ``tmp_path/result.RANK``). Fails if any
    process is still running after the deadline. ``group``: a gloo default group is
    made first, its rendezvous ``file://tmp_path/init``, its collectives' timeout
    ``timeout_s`` (None: torch's default); False: ``fn`` makes its own (vLLM's
    ``init_distributed_environment``, say; that file is free for it)."""
    out = tmp_path / "result"
    init = f"file://{tmp_path / 'init'}" if group else None
    ctx = mp.start_processes(_entry, args=(fn, nprocs, init, timeout_s, str(out), args),
                             nprocs=nprocs, join=False, start_method="spawn")
    import time

    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=max(0.1, end - time.monotonic())):
        if time.monotonic() >= end:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"a rank was still running after {deadline_s} s: a hang")
    return [json.loads(open(f"{out}.{r}").read()) for r in range(nprocs)]
