"""Where an emulated step's GPU time goes (one GPU, TP virtual ranks).

Compares, under a gated queue (the host queues everything while a spin holds the
GPU, so events time the GPU alone):
- joined: every step forks the TP streams from the caller's and joins them back
  (what ``EmulatedGather.__call__`` does);
- streams: each rank's calls stay on its own stream, joined once at the end (how
  real ranks run; the mailbox orders them);
- fork/join alone: the same stream choreography around a trivial kernel.
Run: python -m lamport_head.benches.diagnostics.diagnose
"""

import sys

import torch

from lamport_head.plan import uniform
from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.tuning.support.reference import planted, reference_gather
from lamport_head.settings import BENCH_BUDGET_S

from ...tuning.harness import gated_gpu_us


def main(tp=8, vocab=163840, steps=20):
    device = torch.device("cuda", torch.cuda.current_device())
    shard = vocab // tp
    streams = [torch.cuda.Stream(device) for _ in range(tp)]
    xs = [torch.zeros(1024, device=device) for _ in range(tp)]

    def forkjoin(n):
        here = torch.cuda.current_stream(device)
        for _ in range(n):
            for s, x in zip(streams, xs):
                s.wait_stream(here)
                with torch.cuda.stream(s):
                    x.add_(1)
            for s in streams:
                here.wait_stream(s)

    def streams_only(n):
        here = torch.cuda.current_stream(device)
        for s in streams:
            s.wait_stream(here)
        for _ in range(n):
            for s, x in zip(streams, xs):
                with torch.cuda.stream(s):
                    x.add_(1)
        for s in streams:
            here.wait_stream(s)

    print(f"fork/join of {tp} streams around a tiny kernel: {gated_gpu_us(forkjoin, device, steps, 5):.2f} µs/step; "
          f"streams only: {gated_gpu_us(streams_only, device, steps, 5):.2f} µs/step", flush=True)
    print(f"{'rows':>4} {'ctas':>5} {'pdl':>5} {'joined µs':>10} {'streams µs':>11} {'ok':>3}")
    for rows in (1, 8, 64):
        for pdl in (False, True):
            probe = EmulatedGather.default(device, tp, shard, {rows}, pdl=pdl)
            limit = probe.ranks[0].resident()
            base = probe.plan[rows].ctas
            choices = sorted({c for c in (1, 4, base // 2, base, 2 * base, limit // 2) if 1 <= c <= limit // 2})
            for ctas in choices:
                g = EmulatedGather(device, tp, shard, uniform({rows}, ctas), pdl=pdl,
                                   budget_s=BENCH_BUDGET_S)
                data = planted(tp, rows, shard, device=device)
                shards = [data[r] for r in range(tp)]
                joined = gated_gpu_us(lambda n: [g(shards) for _ in range(n)], device, steps, 5)
                alone = gated_gpu_us(lambda n: g.run_steps(shards, n), device, steps, 5)
                want = reference_gather(shards).view(torch.int32)
                outs = g.run_steps(shards, 1)
                ok = all(torch.equal(o.view(torch.int32), want) for o in outs)
                try:
                    g.check()
                except Exception as exc:  # a timeout: report, re-arm, go on
                    print(f"  timeout: {exc}")
                    g.reset()
                    ok = False
                print(f"{rows:>4} {ctas:>5} {str(pdl):>5} {joined:>10.2f} {alone:>11.2f} {'yes' if ok else 'NO':>3}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
