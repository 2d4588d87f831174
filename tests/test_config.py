"""GatherConfig: validation, the label a study stores (every field, by construction),
the default heuristic's inputs and the sweep grid's order."""

import dataclasses

import pytest

from lamport_head.config import CTA_STEPS, GatherConfig, cta_choices, sweep_grid
from lamport_head.kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL, UNROLL_MAX


def test_label_keeps_the_stored_format():
    # Stored studies resume only while this string is unchanged for existing fields.
    assert GatherConfig(32, 128, 4).label() == "ctas=32,threads=128,unroll=4"
    assert GatherConfig(8) == GatherConfig(8, DEFAULT_THREADS, DEFAULT_UNROLL)


def test_a_new_field_is_in_the_label_and_the_values_by_construction():
    @dataclasses.dataclass(frozen=True)
    class Wider(GatherConfig):
        lanes: int = 2

    wide = Wider(16, 256, 4, 3)
    assert wide.label() == "ctas=16,threads=256,unroll=4,lanes=3"
    assert wide.values() == {"ctas": 16, "threads": 256, "unroll": 4, "lanes": 3}
    assert wide.kernel_knobs() == {"threads": 256, "unroll": 4, "lanes": 3}


@pytest.mark.parametrize("args, what", [
    ((0,), "ctas must be an int >= 1"),
    ((True,), "ctas must be an int >= 1"),
    ((2.0,), "ctas must be an int >= 1"),
    ((4, 96), "threads must be one of"),
    ((4, 256.0), "threads must be one of"),
    ((4, 256, 0), f"unroll must be an int in \\[1, {UNROLL_MAX}\\]"),
    ((4, 256, UNROLL_MAX + 1), "unroll must be an int in"),
])
def test_bad_values_raise_naming_the_field(args, what):
    with pytest.raises(ValueError, match=what):
        GatherConfig(*args)


def test_the_grid_walks_threads_then_unroll_then_ctas_under_each_limit():
    grid = sweep_grid({(128, 2): 3, (256, 4): 1})
    assert grid == [GatherConfig(1, 128, 2), GatherConfig(2, 128, 2), GatherConfig(3, 128, 2),
                    GatherConfig(1, 256, 4)]
    assert sweep_grid({(256, 4): 64}, ctas=(8, 16, 100)) == [GatherConfig(8), GatherConfig(16)]
    assert cta_choices(1024) == list(CTA_STEPS) and cta_choices(0) == []
