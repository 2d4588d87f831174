"""Where a gather's GPU time goes, phase by phase (one GPU, TP virtual ranks).

Builds the emulated gather with the diagnostic kernel (``compile_gather(...,
timers=True)``: thread 0 of every CTA stamps the global timer at each boundary of
``kernels.protocol.TIMER_PHASES``) and prints, per row count, the median over calls
of: the launch skew (first to last CTA entry, over every virtual rank), each phase's
span (the median CTA's), and the call from the first CTA's entry to the last CTA's
end. The stamps land in a pinned buffer that stands in for each rank's status record
(the record's words first, the stamps after), read after a device sync. The
diagnostic kernel is never served; its stamps add a few stores per CTA.

Run: python -m lamport_head.tuning.diagnostics.phases [--tp 8] [--rows 1,8,64] [--calls 200]
"""

import argparse
import statistics

import torch

from lamport_head import head_gather
from lamport_head.emulate import EmulatedGather
from lamport_head.kernels.compile import compile_gather
from lamport_head.kernels.protocol import STATUS_WORDS, TIMER_BASE, TIMER_PHASES


class _TimedKernels(head_gather.DeviceKernels):
    """The runtime's kernels, compiled with the phase timers."""

    def compiled(self, tp, shard, config, pdl, arch, stop=False):
        return compile_gather(tp, shard // 2, pdl=pdl, arch=arch, stop=stop, timers=True,
                              **config.kernel_knobs())


def spans(stamps):
    """``stamps``: int64 ``[ranks, ctas, phases]`` of one call -> the figures (µs):
    skew of the CTAs' entries, the median CTA's span of each phase, the whole call."""
    flat = stamps.reshape(-1, len(TIMER_PHASES)).double()
    out = {"entry skew": (flat[:, 0].max() - flat[:, 0].min()).item() / 1e3}
    for k in range(1, len(TIMER_PHASES)):
        name = f"{TIMER_PHASES[k - 1]} -> {TIMER_PHASES[k]}"
        out[name] = (flat[:, k] - flat[:, k - 1]).median().item() / 1e3
    out["call (first entry -> last done)"] = (flat[:, -1].max() - flat[:, 0].min()).item() / 1e3
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=8, help="virtual ranks (default: 8)")
    p.add_argument("--vocab", type=int, default=163840, help="V (default: 163840)")
    p.add_argument("--rows", default="1,8,64", help="row counts M (default: 1,8,64)")
    p.add_argument("--calls", type=int, default=200, help="calls per row count (default: 200)")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    head_gather.KERNELS = _TimedKernels()
    shard = args.vocab // args.tp
    for rows in (int(x) for x in args.rows.split(",")):
        emu = EmulatedGather(device, args.tp, shard, {rows})
        ctas = emu.ctas[rows]
        words = 2 * (TIMER_BASE + ctas * len(TIMER_PHASES))
        buffers = [torch.zeros(words, dtype=torch.int32, pin_memory=True) for _ in emu.ranks]
        for gather, buf in zip(emu.ranks, buffers):
            gather._status_address = buf.data_ptr()  # the record's words, then the stamps
        shards = [torch.randn(rows, shard, device=device).to(torch.bfloat16)
                  for _ in range(args.tp)]
        figures = []
        for call in range(args.calls):
            emu(shards)
            torch.cuda.synchronize(device)
            if call >= 10:  # warm-up
                stamps = torch.stack([b.view(torch.int64)[TIMER_BASE:].view(
                    ctas, len(TIMER_PHASES)) for b in buffers])
                figures.append(spans(stamps))
        assert all(int(b[:STATUS_WORDS].abs().sum()) == 0 for b in buffers), "a gather gave up"
        print(f"tp {args.tp} (virtual), M = {rows}, {ctas} CTAs per rank, median of "
              f"{len(figures)} calls (µs):")
        for name in figures[0]:
            print(f"  {name:>34}: {statistics.median(f[name] for f in figures):8.2f}")
        emu.check()


if __name__ == "__main__":
    main()
