"""The targets of ``lamport-head bench``, each a ratio or figure within one run, and the
verdict lines the bench prints under its table. One definition per target."""

import math

M1_STEP_US = {8: 4.5, 2: 3.5}  # GPU µs per step at M = 1, by TP
FLOOR_RATIO = 1.30  # GPU time over the HBM floor, for M >= FLOOR_FROM_ROWS
FLOOR_FROM_ROWS = 8
COPY_RATIO = 1.3  # GPU time over TP plain copies of the same bytes, for M <= COPY_UP_TO_ROWS
COPY_UP_TO_ROWS = 4
HOST_VS_ADD = 1.0  # host µs per eager call over torch.add_'s, same run
CAPTURED_HOST_US = 1.0  # host µs a captured gather adds beyond the graph launch
VISIBLE_SHARE = 0.5  # gather's visible cost behind the lm_head over its standalone time
VISIBLE_UP_TO_ROWS = 16
DEFAULT_WITHIN = 1.05  # default plan's GPU time over the benchmarked (tuned) plan's


def _fmt(x):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"


def _line(name, value, limit, rows, skipped=None):
    if skipped:  # its runner could not take it here: say why, not "not measured"
        return f"  {name} at M={rows}: skipped ({skipped})"
    if value is None or not math.isfinite(value):
        return f"  {name} at M={rows}: not measured"
    verdict = "met" if value <= limit else "MISSED"
    return f"  {name} at M={rows}: {_fmt(value)} (target <= {limit}): {verdict}"


def verdicts(records, tp):
    """One line per (target, row count) the records cover: the figure, the target and
    met / MISSED / not measured / skipped (why). ``records``: the bench's per-row dicts; a
    record's ``skipped``, where present: ``{figure: why}`` of the figures its runner skipped."""
    lines = []
    for r in records:
        m = r["rows"]
        if m == 1 and tp in M1_STEP_US:
            lines.append(_line("GPU µs per step", r["gpu_us"], M1_STEP_US[tp], m))
        if m >= FLOOR_FROM_ROWS:
            lines.append(_line("GPU time / HBM floor", r["floor_ratio"], FLOOR_RATIO, m))
        if m <= COPY_UP_TO_ROWS and "copy_ratio" in r:
            lines.append(_line("GPU time / TP plain copies", r["copy_ratio"], COPY_RATIO, m))
        lines.append(_line("host per call / torch.add_", r["host_vs_add"], HOST_VS_ADD, m))
        lines.append(_line("captured host µs per gather beyond the launch",
                           r["captured_host_us"], CAPTURED_HOST_US, m))
        if m <= VISIBLE_UP_TO_ROWS:
            lines.append(_line("visible / standalone, PDL on", r["visible_pdl_share"],
                               VISIBLE_SHARE, m,
                               r.get("skipped", {}).get("lm_head_gather_pdl_us")))
        if r.get("plan") == "table":  # else the benchmarked plan is the default itself
            lines.append(_line("default plan / table's plan", r["default_vs_plan"],
                               DEFAULT_WITHIN, m))
    return lines
