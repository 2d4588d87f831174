"""Diagnostics, run by hand or by the multi-process tests, never by serving or the
sweep: ``ranks`` (the multi-process checker: free-running real ranks, kill/slow a
rank, install and first-use tuning end to end; ``gpu_cycles``, the GPU-spin
calibration its tests share), ``diagnose`` (where the emulated eager time goes) and
``hostcost`` (the host's cost per eager call)."""
