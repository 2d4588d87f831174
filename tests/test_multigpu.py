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
                           "-m", "lamport_head.benches.diagnostics.ranks", *args],
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
@pytest.mark.parametrize("n", [2, 8])
def test_real_ranks_all_to_all_bitwise_with_splits_changing_every_call(n):
    """The all-to-all of vocab shards on one GPU a process (each its own context and
    device numbering, peers' boxes mapped across GPUs): 2000 free-running calls, M and
    its split new every call, empty ranks included, bitwise against the reference on
    every rank. What distinct GPUs change that one GPU's processes cannot show: a
    push lands in another GPU's memory through the mapping, the token of a rank with
    no rows included."""
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {_gpus()}")
    run = _torchrun(n, "--all-to-all", "--calls", "2000")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "all-to-all, splits new every call" in run.stdout
    assert "bitwise equal to the reference on every rank and call" in run.stdout


@pytest.mark.multigpu
def test_killed_rank_is_named_and_no_gpu_hangs():
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    n = min(_gpus(), 4)
    run = _torchrun(n, "--calls", "2000", "--kill-rank", "1", "--kill-after", "300", timeout=300)
    lines = [line for line in run.stdout.splitlines() if "never published" in line]
    assert len(lines) == n - 1 and all("rank(s) 1" in line for line in lines), run.stdout + run.stderr


def _stock_worker(rank, world, out):
    from lamport_head.tuning.support.stock import all_gather_logits

    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * rank
    got = all_gather_logits(x)
    torch.save(got, f"{out}.{rank}")  # the tensor itself: dtype and all


def test_stock_layout_is_cat_of_ranks_on_gloo(tmp_path):
    out = tmp_path / "g"
    spawn(_stock_worker, 2, tmp_path, str(out))
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * r for r in range(2)], 1)
    for r in range(2):
        assert torch.equal(torch.load(f"{out}.{r}"), want)


# ---- issue 28: what only several GPUs can show (scripts/multigpu.sh runs these) ------

def _ranks_for(gpus):
    return 4 if gpus >= 4 else 2


@pytest.mark.multigpu
def test_each_process_holds_a_context_on_its_own_gpu_only():
    """Each rank maps its peers in its own context: nvidia-smi lists every rank's
    process on its own GPU and no other (torch's CUDA tensor sharing put a context of
    every process on every peer GPU)."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    from launch import OWN_GPU, launch, show

    n = _ranks_for(_gpus())
    codes, outs, _ = launch(n, "--install", "--contexts", "--calls", "60", gpus=OWN_GPU)
    assert codes == [0] * n, show(outs)
    assert f"ranks contexts: tp={n}: every rank's process holds a context on its own GPU only" \
        in outs[0], show(outs)


@pytest.mark.multigpu
def test_one_visible_gpu_per_process_serves_bitwise():
    """Launched as Ray, SLURM and Kubernetes do (each process sees only its GPU, as its
    index 0): the peer check by UUID passes and install serves every enabled row,
    bitwise (0a45b23 asked about GPUs (0, 0) and every rank went stock)."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    from launch import ONLY_OWN_VISIBLE, launch, show

    n = _ranks_for(_gpus())
    codes, outs, _ = launch(n, "--install", "--calls", "60", gpus=ONLY_OWN_VISIBLE)
    assert codes == [0] * n, show(outs)
    line = next(x for x in outs[0].splitlines() if x.startswith("ranks install:"))
    assert "none (stock)" not in line and "FAILED" not in line and codes == [0] * n, line


@pytest.mark.multigpu
def test_a_dead_peers_box_never_becomes_another_processs_memory_on_its_gpu():
    """Issue 28 item 3 with a GPU per rank: the canary takes the dead rank's GPU."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    from launch import OWN_GPU, canary_case

    canary_case(_ranks_for(_gpus()), "163840", gpus=OWN_GPU)
