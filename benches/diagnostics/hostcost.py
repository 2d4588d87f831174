"""Where a HeadGather call's host time goes (one GPU, two virtual ranks).

Each line is the median host µs of one piece of ``HeadGather.__call__`` done on its
own, beside ``torch.add_`` on a small tensor (the cost of one torch dispatch on this
host) and the whole call. Every figure is the median of single calls, each timed
around the piece alone: the two virtual ranks are called alternately, each on its
own stream (so every launched gather finds its peer and completes), and the stream
switch stays outside the clock (an engine calls on one stream; switching costs more
than a piece here). The gather launches through the driver
(``launch.DriverLaunch``); the DSL's TVM-FFI callable of the same kernel is
timed beside it. Only public names of ``HeadGather`` are timed (the stream-order
bookkeeping inside a call is not: the whole call's line includes it).
Run: python -m lamport_head.benches.diagnostics.hostcost [rows]
"""

import statistics
import sys
import time

import torch

from lamport_head.tuning.support.emulate import EmulatedGather

from ...tuning.harness import never_stock


def _median_us(step, calls):
    """Median µs of ``calls`` calls of ``step`` (each returns its own seconds)."""
    return statistics.median(step() for _ in range(calls)) * 1e6


def main(rows=1, tp=2, vocab=163840, calls=2000):
    device = torch.device("cuda", torch.cuda.current_device())
    shard = vocab // tp
    emu = EmulatedGather.default(device, tp, shard, {rows})
    shards = [torch.randn(rows, shard, device=device).to(torch.bfloat16) for _ in range(tp)]
    outs = [torch.empty(rows, tp * shard, device=device, dtype=torch.bfloat16) for _ in range(tp)]
    small = torch.zeros(16, device=device)
    turn = [0]

    def alternate(piece):
        """piece(gather, rank) on that rank's stream, ranks in turn; returns the host
        seconds of the piece alone (the stream switch outside the clock)."""
        def step():
            r = turn[0]
            turn[0] = (r + 1) % tp
            with torch.cuda.stream(emu.streams[r]):
                t0 = time.perf_counter()
                piece(emu.ranks[r], r)
                return time.perf_counter() - t0
        return step

    def alone(fn):
        def step():
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return step

    from lamport_head.launch import DriverLaunch, current_context

    handles = [s.cuda_stream for s in emu.streams]
    with torch.cuda.device(device):
        plain = [DriverLaunch(g.kernels.compiled(g.plan[rows]), pdl=False, serving=False)
                 for g in emu.ranks]
    pieces = {
        "torch.add_ (one dispatch)": alone(lambda: small.add_(1)),
        "new_empty [M, V]": alternate(lambda g, r: shards[r].new_empty((rows, g.width))),
        "poll (status record)": alternate(lambda g, r: g.poll()),
        "launch (preallocated out)": alternate(lambda g, r: g.launch(shards[r], outs[r], g.plan[rows].ctas)),
        "same, the DSL's TVM-FFI callable": alternate(lambda g, r: g.kernels.compiled(
            g.plan[rows]).launch(shards[r], outs[r].data_ptr(), g.peers_address, g.rank,
                                    g.plan[rows].ctas, g.budget_ns, g.status_address, 0)),
        "same, no PDL attribute": alternate(lambda g, r: plain[r](
            shards[r], outs[r].data_ptr(), g.peers_address, g.rank, g.plan[rows].ctas, g.budget_ns,
            g.status_address, handles[r])),
        "one ctypes driver call": alone(current_context),
        "whole HeadGather call": alternate(lambda g, r: g(shards[r], never_stock)),
    }
    for fn in pieces.values():  # warm-up: compile, lazy loads
        for _ in range(2 * tp):
            fn()
    torch.cuda.synchronize(device)
    import tvm_ffi

    print(f"torch {torch.__version__}, tvm_ffi {tvm_ffi.__version__}; rows {rows}, tp {tp} "
          f"(virtual), V {vocab}; median of {calls} single calls each (host µs)")
    base = None
    for name, fn in pieces.items():
        us = _median_us(fn, calls)
        base = base or us
        print(f"{name:>34}: {us:7.2f} µs  ({us / base:4.2f}x add_)")
        torch.cuda.synchronize(device)
    for g in emu.ranks:
        g.check()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
