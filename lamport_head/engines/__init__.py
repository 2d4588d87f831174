"""Engine adapters: one file per serving engine (``vllm``, ``sglang``), each an entry
point (``vllm.general_plugins`` / ``sglang.srt.plugins``, name ``lamport_head``) and
an explicit install call.

An adapter finds the engine's LogitsProcessor and lm_head, turns them into a
``lamport_head.install.GatherSite`` and calls the engine-neutral core
(``install.install``); the vote, agreement, first-use tuning and build are the core's.
Imports point down: engines -> install core -> runtime -> kernels. The adapters are
the only runtime code that may name the tuner, and only lazily (``measure_first_use``),
so a serving process whose tables cover it never imports the tuner or optuna.

Shared by both adapters: ``measure_first_use``. What an install did reaches an
adapter as a value (``lamport_head.outcome.Outcome``), never as log text. The bridge
of our log lines into an engine's own handlers is that engine's adapter's
(``vllm.attach_to_vllm``).
"""


def measure_first_use(*args, **kwargs):
    """First-use tuning's measuring (``lamport_head.tuning.firstuse.measure``), imported
    only when the install core decided, on every rank alike, to measure."""
    from lamport_head.tuning.firstuse import measure  # lazy: the tuner, first-use tuning only

    return measure(*args, **kwargs)
