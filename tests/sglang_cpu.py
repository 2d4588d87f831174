"""Real SGLang 0.5.23 on a CPU test bed: where it is, and the two modules it cannot load
here (the test bed only: the product's code never imports this).

``scripts/install-sglang-cpu.sh`` installs SGLang into its own venv inside the active one
(``$VIRTUAL_ENV/sglang``: SGLang's pins of compressed-tensors and openai, both imported at
import time, conflict with vLLM's, so the two engines cannot share one venv). The tests
run in the main venv and start their SGLang ranks under that venv's interpreter
(``sglang_python``), or under this one where SGLang is installed here.

Kept out, by a finder that answers only ``import`` statements (``keep_out``):
``torchvision`` (the index's wheel is a CUDA build that does not load against the CPU
torch: ``operator torchvision::nms does not exist``; ``sglang.srt.configs`` imports
``torchvision.transforms`` unguarded, for image preprocessing these tests never run) and
``sgl_kernel`` (SGLang's compiled ops, a CUDA wheel; SGLang's CPU engine imports it at
module level). Each is a module whose every name is a placeholder that raises when
called, so a code path that would really need one fails loudly. Probes
(``importlib.util.find_spec``, what transformers' ``is_torchvision_available`` asks) see
neither module, so no library takes the kept-out one for installed.

SGLang's CPU ISA choice follows from this: ``cpu_has_amx_support()`` is torch's AMX
answer AND ``torch.ops.sgl_kernel.convert_weight_packed`` existing, so with ``sgl_kernel``
kept out every host (AMX or not, ``engine_cpu.simulate_host`` either way) takes SGLang's
portable torch path; ``prepare_rank`` asserts it.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

SGLANG = "0.5.23"  # the SGLang the real-SGLang tests run against
KEPT_OUT = ("torchvision", "sgl_kernel")
PYTHON_ENV = "LAMPORT_HEAD_SGLANG_PYTHON"  # an interpreter with SGLang, overriding the search
REQUIRE_ENV = "LAMPORT_HEAD_REQUIRE_SGLANG"


def _found_in(python):
    """The SGLang version ``python`` imports the metadata of; None if none."""
    import subprocess

    try:
        done = subprocess.run([python, "-c", "from importlib.metadata import version; "
                               "print(version('sglang'))"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def sglang_python():
    """(interpreter, SGLang version) the SGLang ranks run under: ``$LAMPORT_HEAD_SGLANG_PYTHON``,
    else this interpreter if SGLang is installed here, else the venv
    scripts/install-sglang-cpu.sh made (``sys.prefix/sglang``); (None, None) if none."""
    from importlib.metadata import PackageNotFoundError, version

    given = os.environ.get(PYTHON_ENV)
    if given:
        return given, _found_in(given)
    try:
        return sys.executable, version("sglang")
    except PackageNotFoundError:
        pass
    own = os.path.join(sys.prefix, "sglang", "bin", "python")
    if os.path.exists(own):
        return own, _found_in(own)
    return None, None


def require_sglang():
    """The interpreter with SGLang ``SGLANG``; skips without one, and with
    ``LAMPORT_HEAD_REQUIRE_SGLANG=1`` (CI) its absence fails the test instead."""
    import pytest

    python, found = sglang_python()
    if python is not None and found == SGLANG:
        return python
    reason = (f"needs SGLang {SGLANG} (found {found} at {python}); install it with "
              "scripts/install-sglang-cpu.sh")
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(reason)
    pytest.skip(reason)


class _Placeholder:
    """A name of a kept-out module: attribute access gives more placeholders (so import-time
    references such as ``InterpolationMode.BICUBIC`` resolve); a call raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: kept out of the CPU test bed (tests/sglang_cpu.py)")

    def __repr__(self):
        return f"<kept out: {self._name}>"


class _KeptOut(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


def _probing():
    """True when the lookup comes from ``importlib.util.find_spec`` (an availability
    probe), not from an import statement."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "find_spec" and code.co_filename.replace("/", ".").endswith(
                ("importlib.util>", "importlib.util.py")):
            return True
        frame = frame.f_back
    return False


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in KEPT_OUT and not _probing():
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _KeptOut(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def keep_out():
    """Install the finder (once per process), ahead of the real import system."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def prepare_rank(rank, tp, run):
    """In a spawned SGLang rank, first thing: output to ``run/out.RANK``, SGLang's CPU
    engine with this rank's OpenMP core, the kept-out modules, the simulated host CPU (if
    the pin asked: ``engine_cpu.HOST_ISA_ENV``), and a check that SGLang's CPU ISA choice
    is its portable path. Returns torch's AMX answer (what the ranks' SGLang was told)."""
    fd = os.open(f"{run}/out.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    cores = sorted(os.sched_getaffinity(0))
    os.environ.update(SGLANG_USE_CPU_ENGINE="1", NO_COLOR="1", SGLANG_CPU_OMP_THREADS_BIND="|".join(
        str(cores[r % len(cores)]) for r in range(tp)))
    for key in ("SGLANG_PLUGINS", "LAMPORT_HEAD_DISABLE", "LAMPORT_HEAD_FORCE"):
        os.environ.pop(key, None)
    keep_out()
    from engine_cpu import prepare_process

    prepare_process()
    import torch

    import sglang.srt.utils.common as common

    told = bool(torch.cpu._is_amx_tile_supported())
    if common.is_amx_tile_supported is not told or common.cpu_has_amx_support():
        raise AssertionError(
            f"SGLang's CPU ISA choice moved: torch says AMX={told}, SGLang read "
            f"{common.is_amx_tile_supported}, its AMX backend {common.cpu_has_amx_support()} "
            "(expected off: sgl_kernel is kept out); update tests/sglang_cpu.py")
    return told


def scheduler_runtime(rank, tp, run, model_path, **server_args):
    """In a prepared SGLang rank: the scheduler process's order, as SGLang runs it:
    ``ServerArgs`` (CPU, TP ``tp``, dummy weights, BF16, no CUDA graphs, and
    ``server_args``), ``publish(role="scheduler")``, ``configure_logger``, the parallel
    runtime on gloo, the layer runtime. Returns ``(server args, the model's ModelConfig,
    the TP group's CPU group)``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import configure_logger

    args = ServerArgs(model_path=model_path, device="cpu", tp_size=tp, load_format="dummy",
                      skip_tokenizer_init=True, dtype="bfloat16", disable_cuda_graph=True,
                      mem_fraction_static=0.5, **server_args)
    args.resolve_once()
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=rank))
    configure_logger(args, prefix=f" TP{rank}")
    bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=0)
    config = ModelConfig.from_server_args(args)
    bootstrap.init_layer_runtime(model_config=config)
    return args, config, get_tp_group().cpu_group


def stand_in_kernel(tp, group, launches):
    """The gather kernel's CPU stand-in for ``helpers.fake_cuda(launch=...)``: it moves
    the shards over ``group`` as the protocol does (every word unchanged but the
    sentinel, sent as (+0, +0); rank r's shard at columns r x V/TP), writes every word
    of the output, and appends each launch's row count to ``launches``."""
    import ctypes

    import torch
    import torch.distributed as dist

    from lamport_head.kernels.protocol import SENTINEL_I32

    def kernel(logits, dst, peers, r, ctas, budget_ns, status, stream):
        words = logits.contiguous().view(torch.int32)
        sent = torch.where(words == SENTINEL_I32, torch.zeros_like(words), words)
        parts = [torch.empty_like(sent) for _ in range(tp)]
        dist.all_gather(parts, sent, group=group)
        full = torch.cat(parts, dim=1).contiguous()
        ctypes.memmove(dst, full.data_ptr(), full.numel() * full.element_size())
        launches.append(logits.shape[0])

    return kernel


def run_ranks(module, run, table, isa, deadline_s):
    """``module``'s (a test file's name) ``_launch(run, table)`` in SGLang's interpreter
    on a host whose CPU ISA is ``isa`` (``engine_cpu.HOST_ISA_ENV``): its 2 ranks'
    results (``run/result.{rank}``, JSON) and logs (``run/out.{rank}``); the test
    fails with every rank's log when they do."""
    import json
    import subprocess

    import pytest
    from engine_cpu import HOST_ISA_ENV

    python = require_sglang()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **{HOST_ISA_ENV: isa})
    code = (f"import sys; sys.path.insert(0, {tests!r}); import {module} as t; "
            f"t._launch({str(run)!r}, {str(table)!r})")
    done = subprocess.run([python, "-c", code], env=env, cwd=tests, capture_output=True,
                          text=True, timeout=deadline_s + 60)
    logs = [(run / f"out.{r}").read_text() if (run / f"out.{r}").exists() else ""
            for r in range(2)]
    if done.returncode != 0:
        pytest.fail(f"SGLang ranks failed (rc {done.returncode}):\n{done.stderr[-4000:]}\n"
                    + "\n".join(f"--- rank {r}:\n{log[-4000:]}" for r, log in enumerate(logs)))
    return [json.loads((run / f"result.{r}").read_text()) for r in range(2)], logs


def log_sections(log):
    """A rank's log split at its ``=== name`` lines: ``{name: text}``."""
    import re

    parts = re.split(r"^=== (\w+)\n", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))

