"""GPU µs per step of a grid of plans, against the HBM floor (one GPU, TP virtual ranks).

For each row count, every (threads, unroll) of the grid at a few CTA counts (the
default heuristic's, half and all of the co-resident limit), timed as the bench
times (``harness.gated_gpu_us``: queued behind a spin, each rank on its own stream,
no join between steps) after a bitwise check. Prints the best plans and the
default's, each as µs and as a multiple of the floor (``benches.floor``: every
rank's bytes over the copy bandwidth of the same run). What the sweep searches
with Optuna, walked by hand in a minute: it says which knob moves a row count.

Run: python -m lamport_head.benches.diagnostics.grid [--tp 8] [--rows 1,8,64]
     [--threads 128,256,512] [--unroll 2,4,8,16] [--staged 0|1]

``--staged 1`` compiles every kernel of the run with its batches staged through shared
memory, ``--staged 0`` every one with them in registers; by default each unroll
compiles as the runtime's does (``kernels.protocol.staged``).
"""

import argparse

import torch

from lamport_head.config import GatherConfig
from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.status import GatherTimeout
from lamport_head.tuning.support.reference import planted
from lamport_head.settings import BENCH_BUDGET_S

from ..bench import config_for
from ..floor import copy_bandwidth_gbs, floor_us, step_bytes
from ...tuning.harness import EmulatedTarget, gated_gpu_us


def _ints(text):
    return [int(x) for x in text.split(",")]


def _time(target, rows, config, steps, reps, why):
    """Gated GPU µs per step of ``config`` on ``target`` (an ``EmulatedTarget``: its
    budget and its bitwise check); NaN when it is not co-resident, wrong, gave up or
    host-bound, with the reason appended to ``why``."""
    nan = float("nan")
    try:
        emu = EmulatedGather(target.device, target.tp, target.shard_width, {rows: config},
                             budget_s=target.budget_s)
    except ValueError as exc:
        why.append(f"{config.label()}: not built ({exc})")
        return nan
    data = planted(target.tp, rows, target.shard_width, device=target.device)
    shards = [data[r] for r in range(target.tp)]
    try:
        if not target.verify(emu, rows, calls=1):
            emu.check()  # a give-up explains NaN words; otherwise the words are wrong
            why.append(f"{config.label()}: WRONG WORDS or an un-armed mailbox (no give-up)")
            return nan
        emu.run_steps(shards, 2)
        us = gated_gpu_us(lambda n: emu.run_steps(shards, n), target.device, steps, reps)
        emu.check()
        if us != us:
            why.append(f"{config.label()}: host-bound (the gate ran out before the queue)")
        return us
    except GatherTimeout as exc:
        why.append(f"{config.label()}: gave up ({exc})")
        return nan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--threads", default="128,256,512")
    p.add_argument("--unroll", default="2,4,8,16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--staged", type=int, choices=(0, 1), default=None)
    args = p.parse_args(argv)
    if args.staged is not None:
        from lamport_head.kernels import protocol

        # before the first kernel is compiled: every unroll staged, or none
        protocol.STAGED_FROM = 1 if args.staged else protocol.UNROLL_MAX + 1
    device = torch.device("cuda", torch.cuda.current_device())
    target = EmulatedTarget(device, args.tp, args.vocab, budget_s=BENCH_BUDGET_S)
    gbs = copy_bandwidth_gbs(device)
    from lamport_head.kernels import protocol

    print(f"tp {args.tp} (virtual), V {args.vocab}, copy bandwidth {gbs:.0f} GB/s, "
          f"batches staged from unroll {protocol.STAGED_FROM}")
    for rows in _ints(args.rows):
        floor = floor_us(step_bytes(rows, args.tp, args.vocab, args.tp), gbs)
        results, why = [], []
        for threads in _ints(args.threads):
            for unroll in _ints(args.unroll):
                limit = target.limit(threads, unroll)
                base = config_for(target, rows, {}, threads, unroll).ctas  # the heuristic's
                for ctas in sorted({base, max(1, limit // 2), limit}):
                    config = GatherConfig(ctas, threads, unroll)
                    results.append((_time(target, rows, config, args.steps, args.reps, why),
                                    config))
        default = config_for(target, rows, {})
        timed = sorted((r for r in results if r[0] == r[0]), key=lambda r: r[0])
        mine = next((us for us, c in results if c == default), None)
        if mine is None:
            mine = _time(target, rows, default, args.steps, args.reps, why)
        print(f"M = {rows}: floor {floor:.2f} µs; default {default.label()}: {mine:.2f} µs "
              f"({mine / floor:.2f}x floor); {len(timed)} of {len(results)} plans timed")
        for us, config in timed[:args.top]:
            print(f"  {config.label():>28}: {us:8.2f} µs  {us / floor:5.2f}x floor  "
                  f"{us / mine:5.2f}x default")
        for line in why:
            print(f"  no figure: {line}")


if __name__ == "__main__":
    main()
