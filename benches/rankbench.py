"""``lamport-head bench`` under torchrun: one process per rank (``harness.DistributedTarget``).

Every method is collective: every rank calls it, in the same order, and every rank
returns the same figures (MAX over ranks; the bandwidth MIN) or raises at the same
step. Figures per row count:

- ``gpu_us`` / ``gpu_nopdl_us`` / ``default_gpu_us``: GPU µs per step of a CUDA graph
  of two gathers replayed (``DistributedTarget.lamport``), PDL as the architecture
  has it / off / the built-in heuristic's plan; ``captured_gpu_us`` is the same graph;
- ``eager_us``, ``host_us``: per eager call, back-to-back, as serving issues them (the
  host figure is the whole issuing loop's per call, so it includes the loop);
- ``captured_host_us``: host µs per gather of replaying that two-gather graph (half a
  graph launch included: an upper bound of what a gather adds to a replay);
- ``lm_head_us``, ``lm_head_gather_{pdl,nopdl}_us``: graphs of the lm_head shard GEMM
  alone / then the gather of its output (``DistributedTarget.lm_head_overlap``);
- ``stock_eager_us``, ``stock_gpu_us``: the stock path (NCCL all-gather + reorder;
  gloo where processes share a GPU, which says nothing about performance).
"""

import math

import torch

from lamport_head.collective import agree, all_max, all_min, attempt
from lamport_head import build

from .emubench import MEASURED
from .floor import copy_bandwidth_gbs
from ..tuning.harness import SOLO, AllToAllTarget, DistributedTarget, median_eager
from .lmhead import LmHead
from .report import RANKS, SHARED

STOCK_MEASURED = ("eager_us", "stock_eager_us", "stock_gpu_us")


class RanksRunner:
    def __init__(self, target, hidden, *, budget_s):
        self.target, self.hidden = target, hidden
        target.budget_s = budget_s  # every gather the target builds waits at most this
        self.group, self.device = target.group, target.device
        self.mode = SHARED if target.emulated else RANKS
        self.pdl = build.TOOLCHAIN.pdl(build.TOOLCHAIN.arch(self.device))
        self.notes = []

    def _local(self, fn, what):
        """``fn()`` on this rank, agreed: every rank returns or every rank raises."""
        value, error = attempt(fn)
        agree(error, self.group, self.device, what)
        return value

    def bandwidth_gbs(self):
        gbs = self._local(lambda: copy_bandwidth_gbs(self.device), "to measure the copy bandwidth")
        return all_min(gbs, self.group, self.device)

    def _add_us(self):
        x = torch.zeros(16, device=self.device)
        host = self._local(lambda: median_eager(lambda: x.add_(1.0), self.device,
                                                self.target.calls, self.target.reps, SOLO)[1],
                           "to time torch.add_")
        return all_max(host, self.group, self.device)

    # -- bench --drafter: one gather of any shard width (benches/draftbench.py) ----------

    def target_for(self, vocab):
        """The target of ``vocab`` on the same ranks (its shard width, limit, stock)."""
        t = self.target
        if vocab == t.vocab:
            return t
        return DistributedTarget(t.ranks, vocab, calls=t.calls, reps=t.reps, replays=t.replays,
                                 budget_s=t.budget_s, dtype=t.dtype)

    def all_to_all_target(self, splits):
        """The all-to-all target of the bench's vocabulary on the same ranks, M split
        ``splits(M)`` (the same function on every rank)."""
        t = self.target
        return AllToAllTarget(t.ranks, t.vocab, calls=t.calls, reps=t.reps, replays=t.replays,
                              budget_s=t.budget_s, dtype=t.dtype, splits=splits)

    def gather(self, target, rows, config):
        """``{"gpu_us", "stock_gpu_us"}`` (collective, MAX over ranks): the captured GPU
        µs per step of our gather (``target``'s collective: the all-to-all's too) of
        ``[rows, target.shard_width]`` (NaN where it failed) and of the stock path of the same
        shape (NCCL all-gather + reorder; all_to_all_single + permute)."""
        lam = target.lamport(rows, config)
        if lam is None:
            self.notes.append(f"M={rows} {target.collective} shard {target.shard_width} "
                              f"{config.label()}: failed (build, verification or a wait)")
        return {"gpu_us": lam.gpu_us if lam is not None else math.nan,
                "stock_gpu_us": target.stock(rows).gpu_us}

    def op_us(self):
        """GPU µs per call of one ``torch.add_`` of 16 floats, eager back to back (the
        launch-latency floor of a one-kernel step), MAX over ranks."""
        x = torch.zeros(16, device=self.device)
        gpu = self._local(lambda: median_eager(lambda: x.add_(1.0), self.device,
                                               self.target.calls, self.target.reps, SOLO)[0],
                          "to time torch.add_")
        return all_max(gpu, self.group, self.device)

    def row(self, rows, config, default):
        out = dict.fromkeys(MEASURED + STOCK_MEASURED, math.nan)
        t = self.target
        lam = t.lamport(rows, config)
        if lam is None:
            self.notes.append(f"M={rows} {config.label()}: failed (build, verification or a wait)")
        else:
            out.update(gpu_us=lam.gpu_us, captured_gpu_us=lam.graph_us, eager_us=lam.eager_us,
                       host_us=lam.host_us, captured_host_us=lam.graph_host_us)
        off = t.lamport(rows, config, pdl=False)
        out["gpu_nopdl_us"] = off.gpu_us if off is not None else math.nan
        if default == config:
            out["default_gpu_us"] = out["gpu_us"]
        else:
            other = t.lamport(rows, default)
            out["default_gpu_us"] = other.gpu_us if other is not None else math.nan
        out["add_us"] = self._add_us()
        stock = t.stock(rows)
        out.update(stock_eager_us=stock.eager_us, stock_gpu_us=stock.gpu_us)
        head = self._local(lambda: LmHead(rows, self.hidden, t.shard_width, self.device, seed=t.rank,
                                          dtype=t.dtype),
                           "to build the lm_head shard")
        for pdl, key in ((None, "pdl"), (False, "nopdl")):
            both = t.lm_head_overlap(rows, config, head, pdl=pdl)
            if both is not None:
                out["lm_head_us"], out[f"lm_head_gather_{key}_us"] = both
        return out
