"""Real processes, one GPU: N ranks share the GPU through the CUDA IPC mailbox and a
gloo group (NCCL and symmetric memory refuse two ranks on one GPU). Each case
starts ``python -m lamport_head.benches.diagnostics.ranks`` in N processes with torchrun's
environment (our own launcher: torchrun's agent would kill the survivors of the
killed-rank case before they report). Skips without CUDA; correctness only, the
contexts time-slice the GPU."""

import re

import pytest
from launch import ENGINE_STEP, canary_case, engine_reports, launch, show

from lamport_head.status import STOP_EXIT_CODE

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]
VOCAB3 = "129024"  # splits into 3 shards of whole 16-byte fragments (163840 does not)
DRAFT_VOCAB = "32000"  # an EAGLE3 draft head: 16000 a rank at TP 2, a multiple of 8
DTYPES = ["bfloat16", "float32"]  # the logits dtypes (float32: an FP32 lm_head, issue 42)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_free_running_processes_bitwise(n, dtype):
    codes, outs, wall = launch(n, "--calls", "300", "--dtype", dtype, timeout=420)
    assert codes == [0] * n, show(outs)
    line = next(x for x in outs[0].splitlines() if x.startswith("ranks check:"))
    assert f"V=163840 {dtype}," in line
    print(f"\n{line} ({wall:.0f} s wall)")
    assert "bitwise equal to the reference on every rank and call, every mailbox word armed" in line
    assert "timings in this mode are not performance" in line


def test_killed_process_every_survivor_raises_within_budget_then_gpu_works():
    n, budget = 4, 2.0
    codes, outs, _ = launch(n, "--calls", "1000", "--kill-rank", "1", "--kill-after", "40",
                            "--budget", str(budget), timeout=240)
    assert codes[1] == 0 and "exits without a word after call 40" in outs[1], show(outs)
    lines = []
    for r in (0, 2, 3):
        assert codes[r] == 0, show(outs)
        found = re.search(r"rank\(s\) ([\d, ]+) never published.* after ([\d.]+) s", outs[r])
        assert found and "1" in found.group(1).split(", "), show(outs)
        assert float(found.group(2)) < budget + 1.0
        lines.append(outs[r].strip().splitlines()[-1])
    print("\n" + "\n".join(lines))
    # the GPU serves the next process group
    codes, outs, _ = launch(2, "--calls", "30")
    assert codes == [0, 0], show(outs)


def test_slow_process_inside_the_budget_is_right():
    codes, outs, _ = launch(2, "--calls", "40", "--slow-rank", "1", "--slow-s", "0.5",
                            "--budget", "3")
    assert codes == [0, 0], show(outs)
    assert "every output right" in outs[0]


def test_slow_process_past_the_budget_all_raise_and_a_late_push_is_harmless():
    codes, outs, _ = launch(3, "--calls", "40", "--slow-rank", "1", "--slow-s", "2.5",
                            "--budget", "1", "--late-push", "--vocab", VOCAB3)
    assert codes == [0, 0, 0], show(outs)
    assert ("every rank raised at the same call (the second after the late one), none served; "
            "right again after reset()") in outs[0], show(outs)
    print("\n" + outs[0].strip())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 4])
def test_install_across_processes_serves_bitwise(n, dtype):
    """The table's section is written for ``dtype`` and the model's head gathers it
    (float32: vLLM's head_dtype): served rows bitwise the reference, the others stock."""
    codes, outs, _ = launch(n, "--install", "--calls", "60", "--dtype", dtype)
    assert codes == [0] * n, show(outs)
    line = next(x for x in outs[0].splitlines() if x.startswith("ranks install:"))
    print("\n" + line)
    # measured enabled rows 1, 2, 3, 5, 8, 16, 64 (33 disabled); gaps between two
    # enabled rows are filled, so 4, 6, 7 and 9-15 are served too
    assert f"served rows {[*range(1, 17), 64]} on every rank" in line


def test_one_process_failing_its_mailbox_leaves_every_process_stock():
    codes, outs, _ = launch(3, "--install", "--fail-alloc-rank", "2", "--calls", "20",
                            "--vocab", VOCAB3, timeout=180)
    assert codes == [0, 0, 0], show(outs)
    assert "served rows none (stock) on every rank" in outs[0], show(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 4])
def test_captured_gathers_across_processes_bitwise(n, dtype):
    codes, outs, wall = launch(n, "--graph", "--rows", "1,8,64", "--calls", "100", "--dtype",
                               dtype, timeout=300)
    assert codes == [0] * n, show(outs)
    line = next(x for x in outs[0].splitlines() if x.startswith("ranks graph:"))
    print(f"\n{line} ({wall:.0f} s wall)")
    assert "bitwise equal to the reference on every rank and replay" in line


def test_first_use_tuning_measures_once_writes_emulated_and_serves_bitwise(tmp_path, monkeypatch):
    """Issue 12 item 2's "Done when", on one GPU: no table entry; start 1 measures,
    writes the user table (emulated: true: time-sliced processes are not
    performance), serves what won (opted in for this test) bitwise; start 2 reads
    the entry and measures nothing."""
    from lamport_head.table import load_table, user_path

    monkeypatch.setenv("LAMPORT_HEAD_AUTOTUNE", "1")
    monkeypatch.setenv("LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED", "1")
    monkeypatch.delenv("LAMPORT_HEAD_TABLE", raising=False)
    for expect in ("yes", "no"):
        codes, outs, wall = launch(2, "--autotune", "--rows", "16", "--calls", "100",
                                   "--expect-measure", expect, timeout=280)
        assert codes == [0, 0], show(outs)
        line = next(x for x in outs[0].splitlines() if x.startswith("ranks autotune:"))
        print(f"\n{line} ({wall:.1f} s wall)")
        assert ("measured nothing" in line) == (expect == "no")
    sections = load_table(user_path()).sections  # the ranks inherit LAMPORT_HEAD_CACHE
    assert sections and all(s.emulated for s in sections)


def _fault(fault, bad, budget):
    """The loop program's flags for ``fault`` on rank ``bad``: killed, or stalled past
    the spin budget."""
    if fault == "kill":
        return ["--kill-rank", str(bad)]
    return ["--stall-rank", str(bad), "--stall-s", str(budget + 2)]


def _every_survivor_stopped(reports, codes, outs, fault, n, at, budget, bad, failed_in=None):
    """The engine-shaped cases' stop: every rank still running (all but a killed one)
    stopped at most a step past ``at``, within budget + 1 s, its log naming rank
    ``bad``, with exit 0 or, ended by the watchdog, its exit code (``failed_in``: the
    gather a rank that was not ended must have stopped in); then a fresh group on this
    GPU serves bitwise."""
    stopped = [r for r in reports if not r.get("killed")]
    assert len(stopped) == (n - 1 if fault == "kill" else n)
    for r in stopped:
        assert r["error"] is not None and r["steps"] <= at + 1, show(outs)
        ended = r["error"].startswith("ended by the watchdog")
        assert codes[r["rank"]] == (STOP_EXIT_CODE if ended else 0), show(outs)
        if failed_in is not None:
            assert ended or r["failed_in"] == failed_in, show(outs)
        assert r["stopped_after_s"] < budget + 1.0, show(outs)
        assert any(f"rank(s) {bad}" in line for line in r["log"]), show(outs)
    # the GPU serves the next process group
    codes, outs, _ = launch(2, "--calls", "30")
    assert codes == [0, 0], show(outs)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_engine_shaped_steps_never_put_a_wrong_token_on_a_host(n, fault):
    """Issue 19's "Done when": gather -> argmax -> tokens to the host each step, no
    check(), real data (no planted NaN: a NaN column would change the argmax); the
    last rank is killed, or stalls on its host past the budget, at step 60. No host
    receives a wrong token; every rank still running stops within budget + 1 s of
    the step that could not finish, its log naming the missing rank (by the CUDA
    error of its stopped context, or, where the context did not stop, by the
    watchdog ending the process: exit code 70); then a fresh group on this GPU
    serves bitwise."""
    budget, at, bad = 2.0, 60, n - 1
    flag = _fault(fault, bad, budget)
    codes, outs, _ = launch(n, "--steps", "400", "--at", str(at), "--budget", str(budget),
                            *flag, timeout=240, program=ENGINE_STEP)
    reports = engine_reports(outs)
    print()
    for r, code in zip(reports, codes):
        print(f"  {fault} n={n} rank {r['rank']} (exit {code}): {r['steps']} steps' tokens "
              f"on the host, {r['wrong']} wrong; stopped {r.get('stopped_after_s')} s into step "
              f"{r.get('failed_step')}: {r['error']}; log: {r.get('log', [])[-1:]}")
    assert all(r["served"] for r in reports), show(outs)  # the Lamport path, not stock
    assert sum(r["wrong"] for r in reports) == 0, show(outs)
    _every_survivor_stopped(reports, codes, outs, fault, n, at, budget, bad)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_engine_shaped_drafter_steps_never_put_a_wrong_draft_token_on_a_host(fault):
    """Issue 32's "Done when" for the drafter path: each step is the target's gather ->
    argmax -> host, then K = 3 draft gathers of an EAGLE3 head (V = 32000: 16000 a rank
    at TP 2, a width of its own, so the drafter's install builds its own gather, mailbox
    and table section, serving mode, the same budget), each of fresh data -> argmax ->
    host. The last rank is killed, or stalls on its host past the budget, at step 60,
    before that step's target gather. Both gathers served on every rank (the Lamport
    path, not stock); no host receives a wrong target or draft token, and every draft
    token of the steps before the fault reached every host; every rank still running
    stops in the target's gather within budget + 1 s, its log naming the missing rank
    (or the watchdog ends it: exit 70); then a fresh group on this GPU serves bitwise."""
    n, budget, at, k, bad = 2, 2.0, 60, 3, 1
    rows = [1, 2, 4, 8]  # engine_step's default --rows: step s gathers rows[s % 4]
    flag = _fault(fault, bad, budget)
    codes, outs, wall = launch(n, "--steps", "400", "--at", str(at), "--budget", str(budget),
                               "--draft-vocab", DRAFT_VOCAB, "--draft-tokens", str(k), *flag,
                               timeout=240, program=ENGINE_STEP)
    reports = engine_reports(outs)
    print(f"\n  ({wall:.0f} s wall)")
    for r, code in zip(reports, codes):
        print(f"  drafter {fault} n={n} rank {r['rank']} (exit {code}): target served "
              f"{r['served']}, draft served {r.get('draft_served')} (shared: "
              f"{r.get('draft_shared')}; {r.get('draft_why')}); {r['steps']} steps' tokens on "
              f"the host, {r['wrong']} wrong; {r.get('draft_tokens')} draft tokens, "
              f"{r.get('draft_wrong')} wrong; stopped {r.get('stopped_after_s')} s into step "
              f"{r.get('failed_step')} ({r.get('failed_in')}): {r['error']}; "
              f"log: {r.get('log', [])[-1:]}")
    assert all(r["served"] for r in reports), show(outs)  # the Lamport path, not stock
    assert all(r["draft_served"] and not r["draft_shared"] for r in reports), show(outs)
    assert sum(r["wrong"] for r in reports) == 0, show(outs)
    assert sum(r["draft_wrong"] for r in reports) == 0, show(outs)
    for r in reports:  # every draft token of the steps before the fault reached the host
        assert r["draft_steps"] >= at, show(outs)
        assert r["draft_tokens"] == k * sum(rows[s % 4] for s in range(r["draft_steps"])), \
            show(outs)
    _every_survivor_stopped(reports, codes, outs, fault, n, at, budget, bad, failed_in="target")


@pytest.mark.parametrize("n", [2, 4])
def test_engine_shaped_steps_with_a_peer_slow_inside_the_budget_all_go_on(n):
    """A host stall past half the budget and inside its three quarters: the peers'
    gathers raise the slow heartbeat and then finish, which clears it; nobody stops
    (no false watchdog end), every step's tokens reach every host, none wrong."""
    budget, at, steps = 2.0, 60, 120
    codes, outs, _ = launch(n, "--steps", str(steps), "--at", str(at), "--budget", str(budget),
                            "--stall-rank", str(n - 1), "--stall-s", str(0.6 * budget),
                            timeout=240, program=ENGINE_STEP)
    reports = engine_reports(outs)
    assert codes == [0] * n, show(outs)
    for r in reports:
        assert r["error"] is None and r["steps"] == steps and r["wrong"] == 0, show(outs)


def test_a_dead_peers_box_never_becomes_another_processs_memory():
    """Issue 28 item 3 on one GPU: rank 2 of 3 dies mid-run (serving mode, engine-shaped
    steps); as soon as it is gone a canary process takes most of the GPU's free memory
    and fills it with a pattern, before the survivors give up and mark every rank's box
    (3/4 of the budget). The survivors stop as ever, no wrong token on a host, and not
    one canary word changed: the survivors' mappings hold the dead rank's pages (cuMem:
    freed only when the last mapping and handle go), so its box was not the canary's."""
    canary_case(3, VOCAB3)


def test_a_peer_killed_from_outside_during_a_large_step_puts_no_wrong_token_on_a_host():
    """Issue 29's last case: the last of 3 ranks is killed from outside (SIGKILL, no
    word, no exit path of its own) while 64-row steps are in flight, most of a step
    being its pushes (10 MB to each peer at V = 129024); it may die mid-push, leaving a
    peer's box half written. No survivor hands out a token computed from missing data:
    every survivor stops within budget + 1 s of its last step's start, naming the rank."""
    import json
    import os
    import signal
    import threading
    import time

    from launch import finish, start

    n, budget, victim = 3, 2.0, 2
    procs = start(n, "--steps", "100000", "--rows", "64", "--budget", str(budget),
                  "--vocab", VOCAB3, program=ENGINE_STEP)
    seen, killed = [], threading.Event()

    def watch():  # the victim's lines; SIGKILL once it is well into the run
        for line in procs[victim].stdout:
            seen.append(line)
            if not killed.is_set() and "step 40 tokens" in line:
                time.sleep(0.003)  # inside the next steps, not at a step's edge
                os.kill(procs[victim].pid, signal.SIGKILL)
                killed.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    begun = time.monotonic()
    codes, outs, _ = finish(procs[:victim], begun, 240)
    reader.join(timeout=10)
    procs[victim].wait(timeout=10)
    assert killed.is_set(), "".join(seen[-20:])
    reports = [json.loads(x[len("engine-step "):]) for o in outs for x in o.splitlines()
               if x.startswith("engine-step ")]
    print()
    for r, code in zip(reports, codes):
        print(f"  killed-in-flight rank {r['rank']} (exit {code}): {r['steps']} steps' tokens on "
              f"the host, {r['wrong']} wrong; stopped {r.get('stopped_after_s')} s into step "
              f"{r.get('failed_step')}: {str(r['error'])[:120]}")
    assert len(reports) == victim, show(outs)
    assert all(r["served"] for r in reports), show(outs)  # the Lamport path, not stock
    assert sum(r["wrong"] for r in reports) == 0, show(outs)
    for r in reports:
        assert r["error"] is not None and r["stopped_after_s"] < budget + 1.0, show(outs)
        assert any(f"rank(s) {victim}" in line for line in r["log"]), show(outs)


# ---- the all-to-all of vocab shards (issue 43 item 4) -------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 4])
def test_free_running_processes_all_to_all_bitwise_with_splits_changing_every_call(n, dtype):
    """AllToAll across processes, free-running (no collective between calls: a rank may
    be calls ahead), 300 calls, M and its split over the ranks new every call (even, all
    to one rank, cut at random: ranks with no rows on many calls), planted -0, NaN, Inf
    and sentinel words, outputs poisoned first: every rank's rows bitwise its rows of
    the reference on every call, every mailbox word armed at the end."""
    codes, outs, wall = launch(n, "--all-to-all", "--calls", "300", "--dtype", dtype,
                               timeout=420)
    assert codes == [0] * n, show(outs)
    line = next(x for x in outs[0].splitlines() if x.startswith("ranks check:"))
    print(f"\n{line} ({wall:.0f} s wall)")
    empty = re.search(rf"tp={n}, all-to-all, splits new every call \((\d+) calls with a rank "
                      r"of no rows\)", line)
    assert empty and int(empty.group(1)) > 0, line
    assert f"V=163840 {dtype}," in line
    assert "bitwise equal to the reference on every rank and call, every mailbox word armed" in line


# (processes, fault step): the split of the step the fault comes before, on the ranks
A2A_FAULTS = [(2, 60, [1, 0]),  # the survivor has the step's row; the faulty rank none
              (2, 64, [0, 1]),  # the survivor has none: it waits on the faulty rank's token
              (4, 60, [1, 0, 0, 0])]  # rank 0 has the row; ranks 1 and 2 wait on tokens


@pytest.mark.parametrize("n,at,split", A2A_FAULTS, ids=[f"n{n}-at{at}" for n, at, _ in A2A_FAULTS])
@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_engine_shaped_all_to_all_steps_never_put_a_wrong_token_on_a_host(fault, n, at, split):
    """Issue 43 item 4, the all-to-all's fail-stop: vLLM's batch-sharded sampling, each
    step all_to_all_vocab_shards (routed to the Lamport all-to-all, serving mode) ->
    each rank's argmax of its own rows -> tokens to its host, the split new every step,
    ranks with no rows included (tests/engine_step.py --all-to-all). The last rank is
    killed, or stalls on its host past the budget, before step ``at``, whose split is
    ``split`` (a survivor with no rows waits on the faulty rank's token). No host
    receives a wrong token, every token of the steps before reached its rank's host;
    every rank still running stops within budget + 1 s of the step that could not
    finish, its log naming the missing rank (or the watchdog ends it: exit 70); then a
    fresh group on this GPU serves bitwise."""
    from engine_step import step_splits

    budget, bad, rows = 2.0, n - 1, [1, 2, 4, 8]  # engine_step's --rows: step s has rows[s % 4]
    assert step_splits(at, rows[at % 4], n) == split  # the case this is
    flag = _fault(fault, bad, budget)
    codes, outs, wall = launch(n, "--all-to-all", "--steps", "400", "--at", str(at), "--budget",
                               str(budget), *flag, timeout=240, program=ENGINE_STEP)
    reports = engine_reports(outs)
    print(f"\n  ({wall:.0f} s wall)")
    for r, code in zip(reports, codes):
        print(f"  all-to-all {fault} n={n} at {at} rank {r['rank']} (exit {code}): "
              f"{r['steps']} steps, {r['tokens']} tokens on the host, {r['wrong']} wrong, "
              f"{r['empty_steps']} steps with no rows; stopped {r.get('stopped_after_s')} s "
              f"into step {r.get('failed_step')}: {r['error']}; log: {r.get('log', [])[-1:]}")
    assert all(r["served"] for r in reports), show(outs)  # the Lamport path, not stock
    assert sum(r["wrong"] for r in reports) == 0, show(outs)
    for r in reports:  # every token of the steps before the fault reached its rank's host
        assert r["steps"] >= at, show(outs)
        assert r["tokens"] == sum(step_splits(s, rows[s % 4], n)[r["rank"]]
                                  for s in range(r["steps"])), show(outs)
    assert all(r["empty_steps"] > 0 for r in reports), show(outs)
    _every_survivor_stopped(reports, codes, outs, fault, n, at, budget, bad)
