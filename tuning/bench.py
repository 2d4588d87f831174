"""``lamport-head bench``: Lamport vs stock per (TP, rows), measured in one run.

Per row count: eager per-call latency, GPU time (graph replay; emulated: a gated queue)
and host µs per call of both paths, and their ratios; the Lamport gather captured in
CUDA graphs (GPU µs and host µs per gather) beside its eager figures; plus, for scale, the host µs of one
``torch.add_`` on this machine. Results go to CSV and JSON (and a PNG with --plot).
The Lamport configuration comes from the table (emulated sections included when
emulating), else the built-in CTA heuristic.
"""

import csv
import json
import math
import statistics
import time
from pathlib import Path

import torch

from lamport_head.config import GatherConfig, default_ctas
from lamport_head.kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL
from lamport_head.table import load_table

from .targets import make_target

FIELDS = ["tp", "rows", "ctas", "threads", "unroll", "lamport_eager_us", "lamport_gpu_us",
          "lamport_host_us", "lamport_graph_us", "lamport_graph_host_us", "stock_eager_us", "stock_gpu_us", "stock_host_us",
          "eager_speedup", "gpu_speedup", "host_ratio"]


def add_host_us(device, calls=200, reps=5):
    x = torch.zeros(1024, device=device)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def plan_for(target, rows, table_plan, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
    """The GatherConfig to time ``rows`` with: the table's, else the default heuristic's."""
    if rows in table_plan:
        return table_plan[rows].config
    limit = target.limit(threads, unroll)
    return GatherConfig(default_ctas(rows, target.tp, target.shard, threads, unroll, limit),
                        threads, unroll)


def run(args):
    chosen = make_target("bench", args.tp, args.vocab)
    target, device, world = chosen.target, chosen.device, chosen.world
    root, emulated = chosen.root, chosen.emulated
    name = torch.cuda.get_device_name(device)
    table = load_table(args.table)
    table_plan = table.plan(name, target.tp, args.dcp, emulated=emulated)
    add_us = add_host_us(device)
    records = []
    for rows in args.rows:
        plan = plan_for(target, rows, table_plan)
        lam = target.lamport(rows, plan)
        stock = target.stock(rows)
        if lam is None:
            raise SystemExit(f"lamport-head bench: rows={rows} {plan} failed verification")
        records.append({
            "tp": target.tp, "rows": rows, "ctas": plan.ctas, "threads": plan.threads,
            "unroll": plan.unroll, "lamport_eager_us": lam.eager_us,
            "lamport_gpu_us": lam.gpu_us, "lamport_host_us": lam.host_us,
            "lamport_graph_us": lam.graph_us, "lamport_graph_host_us": lam.graph_host_us,
            "stock_eager_us": stock.eager_us, "stock_gpu_us": stock.gpu_us,
            "stock_host_us": stock.host_us, "eager_speedup": stock.eager_us / lam.eager_us,
            "gpu_speedup": stock.gpu_us / lam.gpu_us,
            "host_ratio": lam.host_us / stock.host_us})
    if not root:
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in records:
            w.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    meta = {"gpu": name, "emulated": emulated, "vocab": args.vocab, "tp": target.tp,
            "torch_add_host_us": add_us, "records": records}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print(f"lamport-head bench: {name}, tp={target.tp}, vocab={args.vocab}"
          f"{(' (processes sharing one GPU, stock = gloo: not performance)' if world > 1 else ' (emulated: one GPU, stock = cat of shards)') if emulated else ''}; "
          f"torch.add_ host {add_us:.1f} µs")
    print(f"{'rows':>4} {'ctas':>4} | {'lamport eager':>13} {'gpu':>7} {'host':>6} | "
          f"{'stock eager':>11} {'gpu':>7} {'host':>6} | {'eager x':>7} {'gpu x':>7}")
    for r in records:
        print(f"{r['rows']:>4} {r['ctas']:>4} | {r['lamport_eager_us']:>13.2f} "
              f"{r['lamport_gpu_us']:>7.2f} {r['lamport_host_us']:>6.2f} | "
              f"{r['stock_eager_us']:>11.2f} {r['stock_gpu_us']:>7.2f} "
              f"{r['stock_host_us']:>6.2f} | {r['eager_speedup']:>6.2f}x {r['gpu_speedup']:>6.2f}x")
    print("Lamport eager vs captured in a CUDA graph (per gather): GPU µs | host µs")
    print(f"{'rows':>4} | {'eager gpu':>9} {'graph gpu':>9} {'ratio':>6} | {'eager host':>10} "
          f"{'graph host':>10}")
    for r in records:
        print(f"{r['rows']:>4} | {r['lamport_gpu_us']:>9.2f} {r['lamport_graph_us']:>9.2f} "
              f"{r['lamport_graph_us'] / r['lamport_gpu_us']:>6.2f} | "
              f"{r['lamport_host_us']:>10.2f} {r['lamport_graph_host_us']:>10.2f}")
    if args.plot:
        from .plot import plot_rows

        plot_rows([dict(rows=r["rows"], lamport_us=r["lamport_eager_us"],
                        stock_us=r["stock_eager_us"], lamport_gpu_us=r["lamport_gpu_us"],
                        stock_gpu_us=r["stock_gpu_us"]) for r in records],
                  args.plot, f"{name} tp={target.tp} V={args.vocab}"
                  + (" (emulated)" if emulated else ""))
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.json')}"
          + (f", {args.plot}" if args.plot else ""))
    return 0 if all(math.isfinite(r["lamport_eager_us"]) for r in records) else 1
