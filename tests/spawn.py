"""Run a function in N processes on a fresh gloo group, with a deadline: a rank that
hangs in a collective fails the test instead of hanging it."""

import json
import os

import torch.multiprocessing as mp

DEADLINE_S = 120


def _entry(rank, fn, nprocs, init, out, args):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nprocs)
    result = fn(rank, nprocs, *args)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    # no destroy: a test may leave peers in different states on purpose; exit at once
    os._exit(0)


def spawn(fn, nprocs, tmp_path, *args, deadline_s=DEADLINE_S):
    """``fn(rank, nprocs, *args)`` in each of ``nprocs`` processes; the JSON-able
    results in rank order. Fails if any process is still running after the deadline."""
    out = tmp_path / "result"
    ctx = mp.start_processes(_entry, args=(fn, nprocs, f"file://{tmp_path / 'init'}", str(out),
                                           args),
                             nprocs=nprocs, join=False, start_method="spawn")
    import time

    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=max(0.1, end - time.monotonic())):
        if time.monotonic() >= end:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"a rank was still running after {deadline_s} s: a hang")
    return [json.loads(open(f"{out}.{r}").read()) for r in range(nprocs)]
