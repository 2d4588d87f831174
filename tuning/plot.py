"""PNG plots: tune's latency (and, on real ranks, its speedup over stock) against rows
(``plot_rows``), and the helpers bench's picture shares (``benchplot``). Every plot's
title is the caller's."""

import math


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'lamport-head[plot]'") from exc
    return plt


def _rows_axis(ax, ylabel, legend_size=None):
    """The x axis every plot here shares (rows M, powers of two), its y label, a legend
    and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (M)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)


def _finite(ys):
    return any(y is not None and isinstance(y, (int, float)) and math.isfinite(y) for y in ys)


def _lines(ax, rows, records, series, positive=False):
    """One line per ``(key, label, style)`` of ``series`` that has a finite value in
    ``records``; ``positive``: values not above 0 are gaps (a log axis)."""
    for key, label, style in series:
        ys = [r.get(key, math.nan) for r in records]
        if _finite(ys):
            ax.plot(rows, [y if not positive or y > 0 else math.nan for y in ys], style,
                    label=label)


def plot_rows(records, path, title, emulated=False):
    """``records``: dicts with rows, lamport_us, stock_us (and optionally *_gpu_us).
    Real ranks: latency of both, and the speedup over stock. ``emulated``: one panel, the
    gather's latency alone (a one-GPU cat is no all-gather: no stock line, no speedup)."""
    plt = _pyplot()
    records = sorted(records, key=lambda r: r["rows"])
    rows = [r["rows"] for r in records]
    if emulated:
        fig, lat = plt.subplots(1, 1, figsize=(6.5, 4.2))
        series = [("lamport_us", "gather", "o-")]
        if any(r.get("lamport_gpu_us") != r["lamport_us"] for r in records):
            series.append(("lamport_gpu_us", "gather, GPU time", "o--"))
        _lines(lat, rows, records, series)
        lat.set_yscale("log")
        _rows_axis(lat, "µs per step")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    fig, (lat, spd) = plt.subplots(1, 2, figsize=(11, 4.2))
    _lines(lat, rows, records, (("lamport_us", "Lamport (eager)", "o-"),
                                ("stock_us", "stock (eager)", "s-"),
                                ("lamport_gpu_us", "Lamport (GPU)", "o--"),
                                ("stock_gpu_us", "stock (GPU)", "s--")))
    _rows_axis(lat, "µs per gather")
    spd.plot(rows, [r["stock_us"] / r["lamport_us"] for r in records], "o-", label="eager")
    if all(r.get("lamport_gpu_us") for r in records):
        spd.plot(rows, [r["stock_gpu_us"] / r["lamport_gpu_us"] for r in records], "o--",
                 label="GPU time")
    spd.axhline(1.0, color="gray", lw=0.8)
    _rows_axis(spd, "speedup over stock (×)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
