"""Where a gather's GPU time goes, phase by phase (one GPU, TP virtual ranks).

Builds the emulated gather with the diagnostic kernel (``compile_gather(...,
timers=True)``: thread 0 of every CTA stamps the global timer at each boundary of
``kernels.protocol.TIMER_PHASES`` and stores the stamps in its call's slot,
``protocol.timer_index``). The calls run as the bench times them: queued behind a
spin (``harness.gated_gpu_us``), every rank on its own stream, back to back with no
sync, so what the stamps show is the steady state, not the host issuing launches.
Per row count it prints the medians over calls of: the skew of the CTAs' entries
over every rank, each phase's span (the median CTA's), the call from the first
entry to the last CTA's end, the period (first entry to the next call's first
entry: the GPU time per step), and, per rank, the gap from its call's last CTA's
end to its next call's first entry (negative: PDL launched the next one early).
The stamps land in a pinned buffer that stands in for each rank's status record
(the record's words first, the stamps after). Never served.

``--lmhead``: every rank's step is its lm_head shard GEMM (``tuning.lmhead``, the
bench's) then the gather of that GEMM's output, as in a decode step; it adds where
the gather's visible cost goes: the spread of the ranks' waits (each releases when
its own GEMM ends; here every rank's GEMM shares the one GPU), each rank's own wait
to its last CTA's end, and the last rank's wait to the last end (what no overlap can
hide), beside a step of the GEMMs alone.

Run: python -m lamport_head.benches.diagnostics.phases [--tp 8] [--rows 1,8,64] [--calls 200]
     [--lmhead]
"""

import argparse
import statistics

import torch

from lamport_head import build
from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.status import GatherTimeout
from lamport_head.kernels.compile import compile_gather
from lamport_head.kernels.protocol import (CONTROL_EPOCH, STATUS_WORDS, TIMER_CALLS,
                                           TIMER_PHASES, timer_index, timer_words)

from ..emubench import rank_steps
from ...tuning.harness import gated_gpu_us
from ..lmhead import KIMI_K2_HIDDEN, LmHead


class _TimedKernels(build.Toolchain):
    """The runtime's kernels, compiled with the phase timers."""

    def compiled(self, tp, words, config, pdl, arch):
        return compile_gather(tp, words, pdl=pdl, arch=arch, timers=True,
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


def between(call, then):
    """Two consecutive calls' stamps (``[ranks, ctas, phases]`` each) -> the period
    (first entry to the next call's first entry) and the median rank's gap from its
    last CTA's end to its next first entry (µs)."""
    period = (then[..., 0].min() - call[..., 0].min()).item() / 1e3
    gaps = (then[..., 0].min(dim=1).values - call[..., -1].max(dim=1).values).double()
    return {"period (entry -> next entry)": period,
            "rank's gap (done -> next entry)": gaps.median().item() / 1e3}


def behind(stamps):
    """``stamps`` of one call behind the GEMMs -> where its visible cost goes (µs): the
    spread of the ranks' waits (a rank's wait releases at its own GEMM's end), the
    median rank's wait to its own last CTA's end, and the last wait to the last end."""
    waited = stamps[..., 1].max(dim=1).values.double()  # per rank: its GEMM's end
    done = stamps[..., -1].max(dim=1).values.double()
    return {"ranks' waits' spread (GEMM ends)": (waited.max() - waited.min()).item() / 1e3,
            "rank's wait -> its done (median)": (done - waited).median().item() / 1e3,
            "last rank's wait -> last done": (done.max() - waited.max()).item() / 1e3}


def _stamps(buffers, epoch, ctas):
    """Call ``epoch``'s stamps, int64 ``[ranks, ctas, phases]``."""
    first = timer_index(epoch, 0, ctas, 0)
    return torch.stack([b.view(torch.int64)[first:first + ctas * len(TIMER_PHASES)].view(
        ctas, len(TIMER_PHASES)) for b in buffers])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=8, help="virtual ranks (default: 8)")
    p.add_argument("--vocab", type=int, default=163840, help="V (default: 163840)")
    p.add_argument("--rows", default="1,8,64", help="row counts M (default: 1,8,64)")
    p.add_argument("--calls", type=int, default=200, help="calls per row count (default: 200)")
    p.add_argument("--lmhead", action="store_true",
                   help="each step: the rank's lm_head shard GEMM, then the gather of its output")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    build.TOOLCHAIN = _TimedKernels()
    shard = args.vocab // args.tp
    batch = TIMER_CALLS // 2  # calls queued back to back, each in its own stamp slot
    for rows in (int(x) for x in args.rows.split(",")):
        emu = EmulatedGather.default(device, args.tp, shard, {rows})
        ctas = emu.plan[rows].ctas
        words = timer_words(ctas)
        buffers = [torch.zeros(words, dtype=torch.int32, pin_memory=True) for _ in emu.ranks]
        for gather, buf in zip(emu.ranks, buffers):
            gather.status_address = buf.data_ptr()  # the record's words, then the stamps
        shards = [torch.randn(rows, shard, device=device).to(torch.bfloat16)
                  for _ in range(args.tp)]
        heads = ([LmHead(rows, KIMI_K2_HIDDEN, shard, device, seed=r) for r in range(args.tp)]
                 if args.lmhead else None)
        emu.run_steps(shards, 4)  # warm-up
        if heads:
            # cuBLAS takes its workspace per stream once
            rank_steps(2, emu.streams, device, emu, heads=heads)
        figures, per_step, gemms = [], [], []
        for _ in range(max(1, args.calls // batch)):
            torch.cuda.synchronize(device)
            first = emu.ranks[0].box.control(0)[CONTROL_EPOCH].item()
            if heads:
                gemms.append(gated_gpu_us(lambda n: rank_steps(n, emu.streams, device, heads=heads),
                                          device, batch, 1))
                per_step.append(gated_gpu_us(
                    lambda n: rank_steps(n, emu.streams, device, emu, heads=heads), device, batch,
                    1))
            else:
                per_step.append(gated_gpu_us(lambda n: emu.run_steps(shards, n), device, batch, 1))
            torch.cuda.synchronize(device)
            calls = [_stamps(buffers, first + k, ctas) for k in range(batch)]
            for k in range(2, batch - 1):  # the first calls leave the gate
                figures.append({**spans(calls[k]), **between(calls[k], calls[k + 1]),
                                **(behind(calls[k]) if heads else {})})
        if any(int(b[:STATUS_WORDS].abs().sum()) for b in buffers):  # a record was written
            try:
                emu.check()
                why = "its record was written"
            except GatherTimeout as exc:
                why = str(exc)
            print(f"tp {args.tp} (virtual), M = {rows}, {ctas} CTAs per rank: a gather gave up, "
                  f"no figures ({why})")
            continue
        what = "lm_head then gather" if heads else "gather"
        print(f"tp {args.tp} (virtual), M = {rows}, {ctas} CTAs per rank, median of "
              f"{len(figures)} calls (µs); gated GPU time per step ({what}) "
              f"{statistics.median(per_step):.2f} µs"
              + (f", lm_head alone {statistics.median(gemms):.2f} µs" if heads else "") + ":")
        for name in figures[0]:
            print(f"  {name:>34}: {statistics.median(f[name] for f in figures):8.2f}")
        emu.check()


if __name__ == "__main__":
    main()
