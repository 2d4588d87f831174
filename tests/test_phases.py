"""The per-phase timing diagnostic (tuning/diagnostics/phases.py) on CPU: its arithmetic."""

import torch

from lamport_head.tuning.diagnostics.phases import spans


def test_phase_spans_from_stamps():
    """The phases diagnostic's arithmetic: launch skew, each phase's median CTA span,
    the whole call (stamps in ns, figures in µs)."""
    stamps = torch.tensor([[[0, 1000, 3000, 6000, 7000], [500, 1500, 3500, 6500, 9000]],
                           [[200, 1200, 3200, 6200, 7200], [100, 1100, 3100, 6100, 7100]]])
    got = spans(stamps)
    assert got["entry skew"] == 0.5
    assert got["entry -> waited"] == 1.0 and got["waited -> pushed"] == 2.0
    assert got["pushed -> delivered"] == 3.0 and got["delivered -> done"] == 1.0
    assert got["call (first entry -> last done)"] == 9.0
