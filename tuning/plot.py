"""PNG plots: latency (Lamport vs stock) and speedup against rows."""


def plot_rows(records, path, title):
    """``records``: dicts with rows, lamport_us, stock_us (and optionally *_gpu_us)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'lamport-head[plot]'") from exc
    records = sorted(records, key=lambda r: r["rows"])
    rows = [r["rows"] for r in records]
    fig, (lat, spd) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("lamport_us", "Lamport (eager)", "o-"),
                              ("stock_us", "stock (eager)", "s-"),
                              ("lamport_gpu_us", "Lamport (GPU)", "o--"),
                              ("stock_gpu_us", "stock (GPU)", "s--")):
        ys = [r.get(key) for r in records]
        if any(y is not None and y == y for y in ys):
            lat.plot(rows, ys, style, label=label)
    lat.set_xscale("log", base=2)
    lat.set_xlabel("rows (M)")
    lat.set_ylabel("µs per gather")
    lat.legend()
    lat.grid(alpha=0.3)
    spd.plot(rows, [r["stock_us"] / r["lamport_us"] for r in records], "o-", label="eager")
    if all(r.get("lamport_gpu_us") for r in records):
        spd.plot(rows, [r["stock_gpu_us"] / r["lamport_gpu_us"] for r in records], "o--",
                 label="GPU time")
    spd.axhline(1.0, color="gray", lw=0.8)
    spd.set_xscale("log", base=2)
    spd.set_xlabel("rows (M)")
    spd.set_ylabel("speedup over stock (×)")
    spd.legend()
    spd.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
