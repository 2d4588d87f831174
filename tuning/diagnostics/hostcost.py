"""Where a HeadGather call's host time goes (one GPU, two virtual ranks).

Each line is the median host µs of one piece of ``HeadGather.__call__`` done on its
own, beside ``torch.add_`` on a small tensor (the cost of one torch dispatch on this
host) and the whole call. The two virtual ranks are called alternately, each on its
own stream, so every launched gather finds its peer and completes; host time is
taken around the piece only. The gather launches through the driver
(``kernels.launch.DriverLaunch``); the DSL's TVM-FFI callable of the same kernel is
timed beside it. Also says whether TVM-FFI has torch's fast DLPack
exchange (``__dlpack_c_exchange_api__``): without it every tensor argument goes
through ``to_dlpack``.
Run: python -m lamport_head.tuning.diagnostics.hostcost [rows]
"""

import sys

import torch

from lamport_head.emulate import EmulatedGather

from ..harness import SOLO, median_eager


def main(rows=1, tp=2, vocab=163840):
    device = torch.device("cuda", torch.cuda.current_device())
    shard = vocab // tp
    emu = EmulatedGather(device, tp, shard, {rows})
    shards = [torch.randn(rows, shard, device=device).to(torch.bfloat16) for _ in range(tp)]
    outs = [torch.empty(rows, tp * shard, device=device, dtype=torch.bfloat16) for _ in range(tp)]
    small = torch.zeros(16, device=device)
    turn = [0]

    def alternate(piece):
        """piece(gather, rank) on that rank's stream, ranks in turn."""
        def step():
            r = turn[0]
            turn[0] = (r + 1) % tp
            with torch.cuda.stream(emu.streams[r]):
                piece(emu.ranks[r], r)
        return step

    def stock(x):
        raise AssertionError("the planned rows must not take stock")

    from lamport_head.kernels.launch import DriverLaunch, current_context

    handles = [s.cuda_stream for s in emu.streams]
    with torch.cuda.device(device):
        plain = [DriverLaunch(g._compiled(g.configs[rows]), pdl=False) for g in emu.ranks]
    pieces = {
        "torch.add_ (one dispatch)": lambda: small.add_(1),
        "stream context enter/exit": alternate(lambda g, r: None),
        "new_empty [M, V]": alternate(lambda g, r: shards[r].new_empty((rows, g.width))),
        "_follow_stream": alternate(lambda g, r: g._follow_stream()),
        "launch (preallocated out)": alternate(lambda g, r: g.launch(shards[r], outs[r], g.ctas[rows])),
        "same, the DSL's TVM-FFI callable": alternate(lambda g, r: g._compiled(g.configs[rows]).launch(
            shards[r], outs[r].data_ptr(), g._peers, g.rank, g.ctas[rows], g.budget_ns,
            g._status_address)),
        "same, no PDL attribute": alternate(lambda g, r: plain[r](
            shards[r], outs[r].data_ptr(), g._peers, g.rank, g.ctas[rows], g.budget_ns,
            g._status_address, handles[r])),
        "one ctypes driver call": current_context,
        "to_dlpack (slow conversion)": lambda: torch.utils.dlpack.to_dlpack(shards[0]),
        "whole HeadGather call": alternate(lambda g, r: g(shards[r], stock)),
    }
    for fn in pieces.values():  # warm-up: compile, lazy loads
        for _ in range(2 * tp):
            fn()
    torch.cuda.synchronize(device)
    import tvm_ffi

    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    print(f"torch {torch.__version__}, tvm_ffi {tvm_ffi.__version__}, "
          f"torch fast DLPack exchange: {fast}; rows {rows}, tp {tp} (virtual), V {vocab}")
    base = None
    for name, fn in pieces.items():
        _, us = median_eager(fn, device, 400, 7, SOLO)  # host µs per call
        base = base or us
        print(f"{name:>28}: {us:7.2f} µs  ({us / base:4.2f}x add_)")
    for g in emu.ranks:
        g.check()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
