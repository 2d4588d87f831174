"""The per-phase timing diagnostic (benches/diagnostics/phases.py) on CPU: its arithmetic."""

import torch

from lamport_head.benches.diagnostics.phases import spans


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


def test_period_and_gap_between_consecutive_calls():
    """Period: first entry to the next call's first entry; a rank's gap: its last CTA's
    end to its next first entry (negative when PDL launched the next call early)."""
    from lamport_head.benches.diagnostics.phases import between

    call = torch.tensor([[[0, 1, 2, 3, 4000], [100, 1, 2, 3, 5000]],
                         [[50, 1, 2, 3, 4500], [60, 1, 2, 3, 4600]],
                         [[70, 1, 2, 3, 4700], [80, 1, 2, 3, 4800]]])
    then = torch.tensor([[[6000, 0, 0, 0, 0], [6500, 0, 0, 0, 0]],
                         [[4000, 0, 0, 0, 0], [4100, 0, 0, 0, 0]],
                         [[5000, 0, 0, 0, 0], [5100, 0, 0, 0, 0]]])
    got = between(call, then)
    assert got["period (entry -> next entry)"] == 4.0
    # gaps per rank: 6000 - 5000, 4000 - 4600, 5000 - 4800 ns: the median rank's is 0.2 µs
    assert abs(got["rank's gap (done -> next entry)"] - 0.2) < 1e-9


def test_stamp_slots_do_not_overlap():
    from lamport_head.kernels.protocol import (TIMER_BASE, TIMER_CALLS, TIMER_PHASES, timer_index,
                                               timer_words)

    ctas = 3
    seen = {timer_index(e, c, ctas, k) for e in range(TIMER_CALLS) for c in range(ctas)
            for k in range(len(TIMER_PHASES))}
    assert len(seen) == TIMER_CALLS * ctas * len(TIMER_PHASES)
    assert min(seen) == TIMER_BASE and 2 * (max(seen) + 1) == timer_words(ctas)


def test_where_the_visible_cost_goes_behind_the_gemms():
    """Behind the lm_head: a rank's wait releases at its own GEMM's end (its CTAs'
    latest "waited"); the spread of those, the median rank's wait to its own last
    end, and the last wait to the last end (ns in, µs out)."""
    from lamport_head.benches.diagnostics.phases import behind

    # 3 ranks x 2 CTAs: waits end at 1000, 3000, 6000 ns; last ends 5000, 7000, 8000
    stamps = torch.tensor([[[0, 900, 0, 0, 4000], [0, 1000, 0, 0, 5000]],
                           [[0, 3000, 0, 0, 7000], [0, 2500, 0, 0, 6000]],
                           [[0, 6000, 0, 0, 8000], [0, 5900, 0, 0, 7900]]])
    got = behind(stamps)
    assert got["ranks' waits' spread (GEMM ends)"] == 5.0
    assert got["rank's wait -> its done (median)"] == 4.0  # of 4.0, 4.0, 2.0
    assert got["last rank's wait -> last done"] == 2.0
