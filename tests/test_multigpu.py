"""Real ranks (torchrun, one process per GPU): HeadGather vs NCCL all-gather, and a
killed rank. Skips below 2 GPUs. The stock layout itself is checked on gloo (CPU)."""

import os
import subprocess
import sys

import pytest
import torch
from spawn import spawn


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torchrun(n, *args, timeout=900):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                           "-m", "lamport_head.tuning.diagnostics.ranks", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.multigpu
@pytest.mark.parametrize("n", [2, 4, 8])
def test_real_ranks_bitwise_vs_nccl(n):
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {_gpus()}")
    run = _torchrun(n, "--calls", "10000")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "bitwise equal to NCCL all-gather on every rank and call" in run.stdout


@pytest.mark.multigpu
def test_killed_rank_is_named_and_no_gpu_hangs():
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    n = min(_gpus(), 4)
    run = _torchrun(n, "--calls", "2000", "--kill-rank", "1", "--kill-after", "300", timeout=300)
    lines = [line for line in run.stdout.splitlines() if "never published" in line]
    assert len(lines) == n - 1 and all("rank(s) 1" in line for line in lines), run.stdout + run.stderr


def _stock_worker(rank, world, out):
    from lamport_head.stock import all_gather_logits

    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * rank
    got = all_gather_logits(x)
    torch.save(got, f"{out}.{rank}")  # the tensor itself: dtype and all


def test_stock_layout_is_cat_of_ranks_on_gloo(tmp_path):
    out = tmp_path / "g"
    spawn(_stock_worker, 2, tmp_path, str(out))
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * r for r in range(2)], 1)
    for r in range(2):
        assert torch.equal(torch.load(f"{out}.{r}"), want)
