"""An A/B of kernel trees on one GPU: the same emulated gather, plan and data, each
variant's kernel compiled from its own ``kernels/`` folder, timed in rounds in one run.

A variant is ``NAME=TREE[:FLAG]``: TREE a folder holding a ``kernels/`` package (a
past release's, e.g. from ``git archive``; ``.`` is this package's), FLAG the launch's
give-up mode, 0 recoverable (the default) or 1 serving (a tree of one compiled variant
per mode compiles its ``stop`` variant for 1). Every variant runs on this package's
host side (``build.TOOLCHAIN`` replaced: its compile, occupancy and driver launch are
the tree's), the mailbox layout being the same. The driver launcher is the tree's own
``kernels/launch.py`` where it has one (trees before 0.7.0); a later tree's sits in its
``lamport_head/launch.py``, which this tool does not load: such a tree runs on this
package's launcher, right only while the launch's parameters are the same. Per TP and M, each round times every
variant in turn (``harness.gated_gpu_us``, as ``bench`` times ``gpu_us``) after a
bitwise check of three calls on planted data; a variant that fails it has no figure.
The plan is the built-in heuristic's, the same for every variant. ``--phases`` adds
each variant's phase medians (``phases``: the tree's kernel compiled with its timers).
Never served.

Run: python -m lamport_head.benches.diagnostics.ab --tp 2,8 --rows 1,2,4,16 --rounds 2 \\
        --variant v0.3.4=.ab/v034 --variant head:0=. --variant head:1=.:1 [--phases]
"""

import argparse
import importlib
import importlib.util
import inspect
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from lamport_head import build, launch
from lamport_head.launch import bind_primary_context
from lamport_head.kernels.protocol import STATUS_WORDS, TIMER_CALLS, timer_words
from lamport_head.occupancy import resident_ctas
from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.tuning.support.reference import planted, reference_gather

from ..emubench import capture, replay
from ...tuning.harness import gated_gpu_us, never_stock
from .phases import _stamps, between, spans


def kernels_of(tree):
    """The ``kernels`` package of ``tree`` (``.``: this package's), imported under a
    name of its own so that several trees load side by side."""
    if tree == ".":
        return importlib.import_module("lamport_head.kernels")
    root = Path(tree, "kernels").resolve()
    name = "ab_kernels_" + "".join(c if c.isalnum() else "_" for c in str(root))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class Variant(build.Toolchain):
    """A tree's kernel behind this package's host: ``build.Toolchain``'s seams."""

    def __init__(self, spec, timers=False):
        self.name, _, rest = spec.partition("=")
        tree, _, flag = rest.partition(":")
        self.tree, self.flag, self.timers = tree or ".", int(flag or 0), timers
        k = kernels_of(self.tree)
        self.compile = importlib.import_module(k.__name__ + ".compile")
        # a past tree's host launcher sat in its kernels/ (before 0.7.0); this package's
        # is the runtime's
        self.launch = (importlib.import_module(k.__name__ + ".launch")
                       if importlib.util.find_spec(k.__name__ + ".launch") else launch)
        self.protocol = importlib.import_module(k.__name__ + ".protocol")
        self.stop_variant = "stop" in inspect.signature(self.compile.compile_gather).parameters
        self.takes_serving = "serving" in inspect.signature(self.launch.DriverLaunch).parameters

    def timed(self):
        return Variant(f"{self.name}={self.tree}:{self.flag}", timers=True)

    def compiled(self, tp, words, config, pdl, arch, all_to_all=False):
        knobs = config.kernel_knobs()
        if self.stop_variant:
            knobs["stop"] = bool(self.flag)
        if self.timers:
            knobs["timers"] = True
        return self.compile.compile_gather(tp, words, pdl=pdl, arch=arch, **knobs)

    def launcher(self, compiled, device, serving):
        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            if self.takes_serving:
                return self.launch.DriverLaunch(compiled, serving=bool(self.flag))
            return self.launch.DriverLaunch(compiled)

    def resident(self, compiled, device):
        name = (self.launch.kernel_name(compiled) if hasattr(self.launch, "kernel_name")
                else self.launch.kernel_entry(compiled.ptx))
        return resident_ctas(bytes(compiled.cubin), name, compiled.threads, device.index,
                             getattr(compiled, "smem", 0))


def emulated(variant, device, tp, shard, plan):
    build.TOOLCHAIN = variant
    return EmulatedGather(device, tp, shard, plan)


def bitwise(emu, tp, rows, shard, device, calls=3):
    """Whether ``calls`` calls on fresh planted data (sentinel words, -0, NaN, Inf) give
    every rank the reference's bits, and no record was written."""
    for _ in range(calls):
        data = planted(tp, rows, shard, device=device)
        shards = [data[r] for r in range(tp)]
        want = reference_gather(shards).view(torch.int32)
        if not all(torch.equal(o.view(torch.int32), want) for o in emu(shards)):
            return False
    emu.check()
    return True


def timed(emu, tp, rows, shard, device, steps, reps):
    data = planted(tp, rows, shard, device=device)
    shards = [data[r] for r in range(tp)]
    emu.run_steps(shards, 2)
    return gated_gpu_us(lambda n: emu.run_steps(shards, n), device, steps, reps)


def captured(emu, tp, rows, shard, device, steps, reps):
    """GPU µs per step as engines run decode: each rank's CUDA graph of ``steps``
    gathers, replayed together on the ranks' streams (``emubench``'s captured figure);
    NaN if a record was written."""
    data = planted(tp, rows, shard, device=device)
    shards = [data[r] for r in range(tp)]
    torch.cuda.synchronize(device)
    graphs = [capture(stream, lambda r=r: [emu.ranks[r](shards[r], never_stock)
                                           for _ in range(steps)])
              for r, stream in enumerate(emu.streams)]
    replay(graphs, emu.streams, device)  # upload
    us = gated_gpu_us(lambda n: replay(graphs, emu.streams, device), device, steps, reps)
    try:
        emu.check()
    except Exception as exc:  # a record: no figure, and say why
        print(f"  captured run raised: {exc}", flush=True)
        return math.nan
    return us


def phase_figures(variant, device, tp, shard, plan, rows, batches=3):
    """Medians (µs) of ``phases``' figures for ``variant``'s timed kernel; ``{"not
    built": why}`` where it cannot be (its timers' registers cost co-resident CTAs)."""
    try:
        emu = emulated(variant.timed(), device, tp, shard, plan)
    except ValueError as exc:
        return {"not built": str(exc)}
    ctas = plan[rows].ctas
    buffers = [torch.zeros(timer_words(ctas), dtype=torch.int32, pin_memory=True)
               for _ in emu.ranks]
    for gather, buf in zip(emu.ranks, buffers):
        gather.status_address = buf.data_ptr()
    shards = [torch.randn(rows, shard, device=device).to(torch.bfloat16) for _ in range(tp)]
    emu.run_steps(shards, 4)
    batch, figures = TIMER_CALLS // 2, []
    for _ in range(batches):
        torch.cuda.synchronize(device)
        first = int(emu.ranks[0].box.control(0)[variant.protocol.CONTROL_EPOCH].item())
        gated_gpu_us(lambda n: emu.run_steps(shards, n), device, batch, 1)
        torch.cuda.synchronize(device)
        calls = [_stamps(buffers, first + k, ctas) for k in range(batch)]
        for k in range(2, batch - 1):
            figures.append({**spans(calls[k]), **between(calls[k], calls[k + 1])})
    if any(int(b[:STATUS_WORDS].abs().sum()) for b in buffers):
        return {}
    return {name: statistics.median(f[name] for f in figures) for name in figures[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True,
                   help="NAME=TREE[:FLAG] (repeat; the first is the ratios' base)")
    p.add_argument("--tp", default="2,8", help="virtual ranks (default: 2,8)")
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--rows", default="1,2,4,16", help="row counts M (default: 1,2,4,16)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=50, help="steps per gated run")
    p.add_argument("--reps", type=int, default=7, help="gated runs per figure (median)")
    p.add_argument("--phases", action="store_true", help="each variant's phase medians too")
    p.add_argument("--captured", action="store_true",
                   help="time CUDA graphs of the steps replayed together (as engines run "
                        "decode) instead of queued eager launches")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    variants = [Variant(v) for v in args.variant]
    names = [v.name for v in variants]
    rows_list = [int(x) for x in args.rows.split(",")]
    results = []
    for tp in (int(x) for x in args.tp.split(",")):
        shard = args.vocab // tp
        build.TOOLCHAIN = build.Toolchain()
        plan = EmulatedGather.default(device, tp, shard, set(rows_list)).plan
        for rows in rows_list:
            one = {rows: plan[rows]}
            figures = {n: [] for n in names}
            for _ in range(args.rounds):
                for v in variants:
                    emu = emulated(v, device, tp, shard, one)
                    ok = bitwise(emu, tp, rows, shard, device)
                    how = captured if args.captured else timed
                    figures[v.name].append(how(emu, tp, rows, shard, device, args.steps,
                                               args.reps) if ok else math.nan)
                    del emu
            base = statistics.median(figures[names[0]])
            line = "  ".join(f"{n} {' / '.join(f'{x:.2f}' for x in figures[n])} "
                             f"({statistics.median(figures[n]) / base:.3f}x)" for n in names)
            mode = "captured" if args.captured else "eager"
            print(f"tp {tp} M {rows} ({plan[rows].label()}), {mode} µs per step: {line}",
                  flush=True)
            record = {"tp": tp, "rows": rows, "config": plan[rows].label(), "us": figures}
            if args.phases:
                record["phases"] = {v.name: phase_figures(v, device, tp, shard, one, rows)
                                    for v in variants}
                for n, ph in record["phases"].items():
                    print(f"  phases {n}: " + ", ".join(
                        f"{k} {x:.2f}" if isinstance(x, float) else f"{k}: {x}"
                        for k, x in ph.items()), flush=True)
            results.append(record)
    device_name = torch.cuda.get_device_name(device)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name, "variants": args.variant,
                                              "results": results}, indent=1))
    build.TOOLCHAIN = build.Toolchain()


if __name__ == "__main__":
    main()
