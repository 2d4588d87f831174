"""``bench``'s picture: µs per step and the ratios its targets bound, per row count
(the plot helpers are the tuner's, ``plot``)."""

import math

from . import goals
from ..tuning.plot import _finite, _lines, _pyplot, _rows_axis


def plot_bench(records, path, title):
    """Left: µs per step against rows (gather, HBM floor, lm_head GEMM, the gather's
    visible cost behind it with PDL on and off, NCCL where measured). Right: the
    ratios the targets bound (÷ floor, visible ÷ standalone, host ÷ torch.add_), with
    the targets drawn. Returns the title drawn."""
    plt = _pyplot()
    records = sorted(records, key=lambda r: r["rows"])
    rows = [r["rows"] for r in records]
    fig, (lat, rat) = plt.subplots(1, 2, figsize=(12, 4.6))
    _lines(lat, rows, records, (("gpu_us", "gather, GPU µs/step", "o-"),
                                ("floor_us", "HBM floor", "k--"),
                                ("lm_head_us", "lm_head GEMM", "s-"),
                                ("visible_pdl_us", "gather visible behind lm_head, PDL on", "^-"),
                                ("visible_nopdl_us", "gather visible, PDL off", "v:"),
                                ("stock_gpu_us", "NCCL all-gather + reorder", "d-")),
           positive=True)
    lat.set_yscale("log")
    _rows_axis(lat, "µs per step", 8)
    for key, label, style, target in (
            ("floor_ratio", "GPU time ÷ HBM floor", "o-", goals.FLOOR_RATIO),
            ("visible_pdl_share", "visible ÷ standalone, PDL on", "^-", goals.VISIBLE_SHARE),
            ("host_vs_add", "host per call ÷ torch.add_", "s-", goals.HOST_VS_ADD)):
        ys = [r.get(key, math.nan) for r in records]
        if _finite(ys):
            line, = rat.plot(rows, ys, style, label=f"{label} (target ≤ {target})")
            rat.axhline(target, color=line.get_color(), lw=0.8, ls=":")
    _rows_axis(rat, "ratio (×)", 8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = fig._suptitle.get_text()
    plt.close(fig)
    return drawn
