"""Engine adapters: one file per serving engine (``vllm``, ``sglang``), each an entry
point (``vllm.general_plugins`` / ``sglang.srt.plugins``, name ``lamport_head``) and
an explicit install call.

An adapter finds the engine's LogitsProcessor and lm_head, turns them into a
``lamport_head.install.GatherSite`` and calls the engine-neutral core
(``install.install``); the vote, agreement, first-use tuning and build are the core's.
Imports point down: engines -> install core -> runtime -> kernels. The adapters are
the only runtime code that may name the tuner, and only lazily (``measure_first_use``),
so a serving process whose tables cover it never imports the tuner or optuna.
"""


def measure_first_use(*args, **kwargs):
    """First-use tuning's measuring (``lamport_head.tuning.firstuse.measure``), imported
    only when the install core decided, on every rank alike, to measure."""
    from lamport_head.tuning.firstuse import measure

    return measure(*args, **kwargs)
