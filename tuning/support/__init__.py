"""The tools the tuner, the CLI, the diagnostics and the tests share, kept out of the
runtime package so that serving can never import them (tests/test_layout.py):

- ``emulate``: ``EmulatedGather``, TP virtual ranks of ``HeadGather`` on one GPU;
- ``procs``: ranks as processes under torchrun (``init_ranks``, ``Ranks``), on GPUs of
  their own or N sharing one;
- ``stock``: ``StockGather``, the tuner's stand-in for the engine's all-gather (NCCL
  or gloo), its buffers allocated up front;
- ``reference``: the gather's exact expected result and planted data (sentinel words,
  -0, NaN, Inf).

They import the runtime (and ``kernels.protocol``); the runtime imports none of them.
"""
