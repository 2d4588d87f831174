"""Engine adapters, one per engine (docs/design.md, "Rule for adapters", "The module map").
Only ``measure_first_use`` names the tuner, lazily: a process its tables cover never loads it."""


def measure_first_use(*args, **kwargs):
    """``lamport_head.tuning.firstuse.measure``, imported only when the agreed view measures."""
    from lamport_head.tuning.firstuse import measure

    return measure(*args, **kwargs)
