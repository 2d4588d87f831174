"""``lamport-head bench`` and the diagnostics: measurements of the gather beside the
engine's own collective, the HBM floor and plain copies. Not the tuner (``tuning``):
nothing here writes a table."""
