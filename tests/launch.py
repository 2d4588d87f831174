"""Ranks as real processes with torchrun's environment, for the multiproc (one GPU) and
multigpu (one GPU per rank) tests: our own launcher, since torchrun's agent would kill
the survivors of a killed-rank case before they report. Also the canary case of issue 28
item 3, written once for both."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(__file__)
ENGINE_STEP = [os.path.join(HERE, "engine_step.py")]
CANARY = [os.path.join(HERE, "canary.py")]
ONE_GPU, OWN_GPU, ONLY_OWN_VISIBLE = "one", "own", "only-own-visible"


def _physical(index):
    """This machine's GPU ``index`` as the launching process sees it, named as a child's
    CUDA_VISIBLE_DEVICES must name it (an outer list, if any, is honoured)."""
    outer = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return outer[index].strip() if outer else str(index)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(n, *args, program=None, gpus=ONE_GPU):
    """``n`` ranks of the real-rank tool (or of ``program``, argv before ``args``),
    started with torchrun's environment; their processes. ``gpus``: ``one`` (every rank
    on GPU 0, even on a larger machine), ``own`` (rank i on GPU i, all visible) or
    ``only-own-visible`` (rank i sees only GPU i, as Ray, SLURM and Kubernetes
    launch)."""
    port = _port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
        if gpus == ONE_GPU and torch.cuda.device_count() > 1:
            env["CUDA_VISIBLE_DEVICES"] = _physical(0)
        elif gpus == ONLY_OWN_VISIBLE:
            env["CUDA_VISIBLE_DEVICES"] = _physical(rank)
        argv = program or ["-m", "lamport_head.benches.diagnostics.ranks"]
        procs.append(subprocess.Popen([sys.executable, *argv, *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def launch(n, *args, timeout=300, program=None, gpus=ONE_GPU):
    """``n`` ranks (see ``start``); (return codes, stdout+stderr per rank, wall s)."""
    start_s = time.monotonic()
    return finish(start(n, *args, program=program, gpus=gpus), start_s, timeout)


def finish(procs, start_s, timeout):
    """Wait for ``procs`` (a hang past ``timeout`` s from ``start_s`` fails the test);
    (return codes, outputs, wall s)."""
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, timeout - (time.monotonic() - start_s)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            seen = [q.communicate()[0] or "" for q in procs]
            pytest.fail(f"a rank was still running after {timeout} s: a hang\n" + show(seen))
        outs.append(out)
        codes.append(p.returncode)
    return codes, outs, time.monotonic() - start_s


def show(outs):
    return "\n".join(f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(outs))


def engine_reports(outs):
    """Each rank's last ``engine-step`` JSON report (tests/engine_step.py)."""
    found = [[json.loads(x[len("engine-step "):]) for x in o.splitlines()
              if x.startswith("engine-step ")] for o in outs]
    assert all(f for f in found), show(outs)
    return [f[-1] for f in found]


def canary_case(n, vocab, gpus=ONE_GPU, budget=10.0, at=30):
    """Issue 28 item 3: the last rank dies at step ``at`` of an engine-shaped run (serving
    mode); once it is gone a canary process on ITS GPU takes most of the free memory and
    fills it with a pattern, before the survivors give up and mark every rank's box (3/4
    of the budget); then every canary word is checked. Asserts no word changed, no wrong
    token on any host, every survivor stopped within budget + 1 s."""
    dead = n - 1
    begun = time.monotonic()
    procs = start(n, "--steps", "400", "--at", str(at), "--budget", str(budget), "--vocab", vocab,
                  "--kill-rank", str(dead), program=ENGINE_STEP, gpus=gpus)
    while procs[dead].poll() is None:
        assert time.monotonic() - begun < 180, "the rank to kill never exited"
        time.sleep(0.02)
    gone = time.monotonic()
    env = dict(os.environ)
    if gpus != ONE_GPU:
        env["CUDA_VISIBLE_DEVICES"] = _physical(dead)  # the dead rank's GPU
    elif torch.cuda.device_count() > 1:
        env["CUDA_VISIBLE_DEVICES"] = _physical(0)
    canary = subprocess.Popen([sys.executable, *CANARY], stdin=subprocess.PIPE, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = canary.stdout.readline()
    ready_s = time.monotonic() - gone
    codes, outs, _ = finish(procs, begun, 240)
    out, _ = canary.communicate("check\n", timeout=120)
    reports = engine_reports(outs)
    lines = [x for x in out.splitlines() if x.startswith("canary ")]
    assert lines, f"the canary did not report: {ready}{out}"
    found = json.loads(lines[0][len("canary "):])
    print(f"\n  {ready.strip()}, {ready_s:.1f} s after rank {dead} died; changed words: "
          f"{found['changed']}")
    for r, code in zip(reports, codes):
        print(f"  rank {r['rank']} (exit {code}): {r['steps']} steps, {r['wrong']} wrong; "
              f"stopped {r.get('stopped_after_s')} s into step {r.get('failed_step')}")
    assert ready.startswith("canary ready") and found["words"] > (1 << 28), out
    assert ready_s < 0.7 * budget, "the canary was not in place before the give-up's marks"
    assert found["changed"] == 0
    assert all(r["served"] for r in reports), show(outs)  # the Lamport path, not stock
    assert sum(r["wrong"] for r in reports) == 0, show(outs)
    for r in reports:
        if not r.get("killed"):
            assert r["error"] is not None and r["stopped_after_s"] < budget + 1.0, show(outs)
    return found, reports
