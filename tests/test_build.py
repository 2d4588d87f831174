"""lamport_head.build: the tuner's occupancy limit is install's (issue 30 item 2).

The occupancy stand-in (``VariantKernels``) makes the CTAs per SM depend on everything
the compile is asked for, as a GPU's calculator can: a kernel compiled with anything
beyond the configuration's knobs (a compile-time variant: serving's give-up was one,
more code) holds one CTA per SM fewer. Install's limit is read where install builds:
``install._build`` (mode serving, ``clamp=True``) asked for more CTAs than fit clamps
the row to its limit; the tuner's is ``DistributedTarget.limit`` (a gloo group of one
process: its MIN over ranks is this rank's). The test that the kernel timed for a
tuned row is the kernel install builds for it, and the identity written with the row
its identity, needs two ranks: ``test_harness_ranks``."""

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from lamport_head import build, head_gather, install
from lamport_head.config import SWEEP_THREADS, SWEEP_UNROLL, GatherConfig
from lamport_head.occupancy import Resident
from lamport_head.table import TableRow

SHARD = 64
SMS = 132


class VariantKernels(build.Toolchain):
    """Compile and occupancy on CPU; CTAs per SM follow threads, unroll and any
    compile-time variant asked for."""

    def __init__(self):
        self.compiles = []

    def arch(self, device):
        return "cpu"

    def pdl(self, arch):
        return True  # as on Hopper

    def compiled(self, tp, shard, config, pdl, arch, **variant):
        self.compiles.append((config.threads, config.unroll, pdl, arch, sorted(variant.items())))
        return types.SimpleNamespace(threads=config.threads, unroll=config.unroll,
                                     variant=any(variant.values()), launch=lambda *args: None)

    def launcher(self, compiled, device, *flag):
        return compiled.launch

    def resident(self, compiled, device):
        per_sm = max(1, 2048 // compiled.threads - (compiled.unroll >= 8))
        if compiled.variant and compiled.threads >= 256:  # more code, more registers
            per_sm = max(1, per_sm - 1)
        return Resident(per_sm, SMS)


def _box(tp, sharing):
    return types.SimpleNamespace(tp=tp, words=tp * SHARD // 2, sharing=sharing, cap=1 << 20,
                                 peers=torch.zeros(3, tp, dtype=torch.int64),
                                 close=lambda: None)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _install_limit(monkeypatch, tp, sharing, config):
    """The CTAs install's build serves ``config``'s kernel with, asked for far more."""
    built = head_gather.HeadGather

    def on_the_box(*args, setup, **kwargs):  # install's setup, on a shared box
        return built(*args, setup=dataclasses.replace(setup, mailbox=_box(tp, sharing)),
                     **kwargs)

    monkeypatch.setattr(head_gather, "HeadGather", on_the_box)
    entries = {1: TableRow(GatherConfig(1 << 16, config.threads, config.unroll), True)}
    gather = install._build(None, "cpu", tp, 0, SHARD, entries, 10.0)
    try:
        assert gather.mode == "serving"
        (asked, limit), = gather.clamped.values()
        return limit
    finally:
        gather._watcher.stop()
        gather.close()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_tuners_limit_is_installs_for_every_config_of_the_search_space(
        monkeypatch, one_rank, tp, shared):
    from lamport_head.tuning.support.procs import Ranks
    from lamport_head.tuning.harness import DistributedTarget

    kernels = VariantKernels()
    monkeypatch.setattr(build, "TOOLCHAIN", kernels)
    target = DistributedTarget(Ranks(torch.device("cpu"), 0, tp, shared, "gloo"), tp * SHARD)
    sharing = tp if shared else 1
    for threads in SWEEP_THREADS:
        for unroll in SWEEP_UNROLL:
            config = GatherConfig(1, threads, unroll)
            tuned = target.limit(threads, unroll)
            served = _install_limit(monkeypatch, tp, sharing, config)
            assert tuned == served, (tp, shared, config.label(), tuned, served)
    # both sides compiled the one kernel of each configuration: no variant asked for
    assert {tuple(c[-1]) for c in kernels.compiles} == {()}


def test_a_mode_is_a_launch_flag_not_a_kernel():
    assert build.launch_flag("serving") == 1 and build.launch_flag("recoverable") == 0
    with pytest.raises(ValueError):
        build.launch_flag("other")
