"""Real-rank checks under torchrun, on GPUs of their own or N processes sharing one.

    torchrun --nproc-per-node N -m lamport_head.benches.diagnostics.ranks [--calls 300]
    ... --all-to-all                               the check, of the all-to-all
    ... --kill-rank 1 --kill-after 100            a rank dies mid-run
    ... --slow-rank 1 --slow-s 0.5 [--late-push]  a rank starts one call late
    ... --install [--fail-alloc-rank 1]           install_logits_gather on a model
    ... --graph                                    gathers captured in a CUDA graph
    ... --autotune [--expect-measure yes|no]      first-use tuning at install

check: HeadGather against the reference on fresh planted data every call (sentinel
words, -0 in either half, NaN, Inf), outputs poisoned first, M changing every call
among the served rows (1 and the cap included). The ranks free-run: no collective
between calls, so a rank may be whole calls ahead; every rank derives every rank's
shard from a shared seed, so it checks its own output with no exchange. Bitwise on
every rank and call, every mailbox word armed at the end. ``--all-to-all``: the same of
``AllToAll`` (vLLM's ``all_to_all_vocab_shards``), call i's M split over the ranks anew
(``Calls.splits``: even, all to one rank, or cut at random, ranks with no rows
included), each rank's ``[splits[rank], V]`` against its rows of the reference.

kill: one rank exits without a word; every survivor must raise ``GatherTimeout``
naming it within budget + 1 s (syncing after each call, as a serving step does).

slow: one rank sleeps on its GPU before call k. Inside the budget every output is
right; past it every rank's check() raises after a sync, every rank raises at the
same call (k + 2: call k + 1 fails everywhere and raises every flag; none serves), a
collective ``reset()`` follows, and the gather is right again. ``--late-push``: before its reset the slow rank also
queues, behind a GPU sleep, a write into a peer's box (what a push of the abandoned
call landing late looks like); reset must make it harmless.

install: a vLLM-shaped model and a table with an enabled entry for this GPU;
``install_logits_gather`` routes the gather; served rows and stock rows are checked
bitwise. ``--fail-alloc-rank``: that rank's mailbox allocation fails; every rank
must stay stock, and nobody hangs.

graph: every rank captures one CUDA graph of a gather per served row count on a side
stream and replays it ``--calls`` times, free-running, with fresh data copied into
the graph's static inputs before each replay; bitwise on every rank and replay, an
eager call between replays every tenth time.

autotune: the same model with no table entry (``$LAMPORT_HEAD_CACHE`` names the user
table; ``LAMPORT_HEAD_TABLE`` is unset): install measures (first-use tuning), writes
the user table, and serves what won; calls over every row count of the cap are checked
bitwise. Rank 0 prints the install's log lines, the seconds install took, whether it
measured, and the user table. Processes sharing one GPU write ``emulated: true``; set
``LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED=1`` to serve it in this test.
``--expect-measure no``: a second start must read the entry and measure nothing.

Exit status 0 only when every check held; rank 0 prints one summary line.
"""

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from lamport_head.tuning.support.procs import SHARED_NOTE, init_ranks

POISON = 0x7FBF7FBF  # a NaN pair the kernel never writes on its own
SEED = 1234


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m lamport_head.benches.diagnostics.ranks")
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the logits' dtype (float32: an FP32 lm_head's)")
    p.add_argument("--rows", default="1,2,3,5,8,16,33,64")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--budget", type=float, default=2.0)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-after", type=int, default=100)
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-s", type=float, default=0.5)
    p.add_argument("--late-push", action="store_true")
    p.add_argument("--install", action="store_true")
    p.add_argument("--contexts", action="store_true",
                   help="with --install: each rank lists the GPUs its process holds a CUDA "
                        "context on (nvidia-smi); only its own is right (several GPUs)")
    p.add_argument("--fail-alloc-rank", type=int)
    p.add_argument("--graph", action="store_true")
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--expect-measure", choices=("yes", "no"))
    p.add_argument("--all-to-all", action="store_true",
                   help="the free-running check of the all-to-all of vocab shards instead")
    args = p.parse_args(argv)
    if args.all_to_all and (args.install or args.autotune or args.graph
                            or args.kill_rank is not None or args.slow_rank is not None):
        p.error("--all-to-all is the free-running check alone")
    return args


class Calls:
    """The same call sequence on every rank: call i's M and every rank's shard."""

    def __init__(self, rows, tp, shard, device, dtype=torch.bfloat16):
        self.rows, self.tp, self.shard_width, self.device = rows, tp, shard, device
        self.dtype = dtype
        rng, previous, self.m = random.Random(SEED), None, []
        for i in range(100_000):
            if i < len(rows):  # every served row count early, 1 and the cap included
                m = rows[i]
            else:
                m = rng.choice([r for r in rows if r != previous] or rows)
            self.m.append(m)
            previous = m

    def shards(self, i):
        return self.shards_for(i, self.m[i])

    def splits(self, i):
        """How call i's M rows split over the ranks (the all-to-all's ``send_splits``),
        drawn from i alone: the same on every rank (``draw_splits``)."""
        return draw_splits(random.Random(SEED * 7919 + i), self.m[i], self.tp)

    def shards_for(self, i, m):
        """Every rank's ``[m, shard]`` of draw ``i``: the same on every rank."""
        from lamport_head.tuning.support.reference import planted

        g = torch.Generator(device=self.device).manual_seed(SEED * 1_000_003 + i)
        data = planted(self.tp, m, self.shard_width, generator=g, device=self.device, dtype=self.dtype)
        return [data[r] for r in range(self.tp)]


def draw_splits(rng, rows, tp):
    """``rows`` split over ``tp`` ranks by ``rng`` (ranks drawing from equal generators
    draw the same): even, all to one rank, or cut at random points (coinciding cuts
    leave ranks with no rows)."""
    from lamport_head.all_to_all import even_splits

    kind = rng.random()
    if kind < 0.2:
        return even_splits(rows, tp)
    if kind < 0.35:
        one = rng.randrange(tp)
        return [rows if q == one else 0 for q in range(tp)]
    cuts = sorted(rng.randint(0, rows) for _ in range(tp - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, rows])]


def _poison(rows, width, device, dtype=torch.bfloat16):
    """Leave freed blocks full of POISON where the next output will be allocated."""
    blocks = [torch.full((rows, width * dtype.itemsize // 4), POISON, dtype=torch.int32,
                         device=device) for _ in range(2)]
    del blocks


_CYCLES_PER_S = {}


def gpu_cycles(seconds, device):
    """``torch.cuda._sleep`` cycles that hold a stream for about ``seconds`` (the
    spin's rate measured once per device)."""
    if device not in _CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_S[device] = 50_000_000 / (start.elapsed_time(end) / 1e3)
    return int(seconds * _CYCLES_PER_S[device])


def _sleep_s(seconds, device):
    """Hold this rank's current stream for about ``seconds`` of GPU time."""
    torch.cuda._sleep(gpu_cycles(seconds, device))


def run_calls(gather, calls, first, count, bad, device, stock=None):
    """Calls ``first .. first + count - 1``, free-running; a call's mismatch adds to
    ``bad[i]`` on the device (nothing synchronizes here)."""
    from lamport_head.tuning.support.reference import reference_gather

    me = gather.rank
    for i in range(first, first + count):
        shards = calls.shards(i)
        _poison(calls.m[i], gather.width, device, calls.dtype)
        out = gather(shards[me], stock or _no_stock)
        want = reference_gather(shards).view(torch.int32)
        bad[i] += (out.view(torch.int32) != want).any()


def run_all_to_all(a2a, calls, first, count, bad, device):
    """``run_calls`` of the all-to-all: call i splits its M as ``calls.splits(i)``; this
    rank's ``[splits[rank], V]`` (poisoned first) against its rows of the reference."""
    from lamport_head.tuning.support.reference import reference_all_to_all

    me = a2a.rank
    for i in range(first, first + count):
        shards, splits = calls.shards(i), calls.splits(i)
        _poison(max(splits[me], 1), a2a.width, device, calls.dtype)
        out = a2a(shards[me], splits, splits[me], _no_stock)
        want = reference_all_to_all(shards, splits)[me]
        if out.shape != want.shape:
            bad[i] += 1
        else:
            bad[i] += (out.view(torch.int32) != want.view(torch.int32)).any()


def _no_stock(x, *split):
    raise AssertionError(f"rows {x.shape[0]} are served: stock must not run")


def check(args, ranks, gather, calls):
    bad = torch.zeros(args.calls, dtype=torch.int32, device=ranks.device)
    start = time.monotonic()
    (run_all_to_all if args.all_to_all else run_calls)(gather, calls, 0, args.calls, bad,
                                                        ranks.device)
    torch.cuda.synchronize(ranks.device)
    per_call = (time.monotonic() - start) / args.calls
    gather.check()
    gather.box.barrier()  # every rank's last kernel is done: nothing left in flight
    armed = gather.box.armed()
    wrong = bad.cpu()
    report = _gathered(ranks, (wrong.nonzero().flatten().tolist()[:5], int(wrong.sum()), armed,
                               per_call))
    ok = all(n == 0 and a for _, n, a, _ in report)
    if ranks.is_root:
        slowest = max(t for *_, t in report)
        rows = ",".join(map(str, calls.rows))
        verdict = ("bitwise equal to the reference on every rank and call, every mailbox word "
                   "armed" if ok else "FAILED " + "; ".join(
                       f"rank {r}: {n} bad calls (first {f}), armed {a}"
                       for r, (f, n, a, _) in enumerate(report)))
        exchange = ""
        if args.all_to_all:
            empty = sum(0 in calls.splits(i) for i in range(args.calls))
            exchange = (f"all-to-all, splits new every call ({empty} calls with a rank of no "
                        "rows), ")
        print(f"ranks check: tp={ranks.world}, {exchange}{args.calls} free-running calls, M in "
              f"{rows}, V={args.vocab} {args.dtype}, {_mode(ranks)}: {verdict}; "
              f"{slowest * 1e3:.1f} ms per call",
              flush=True)
    return ok


def graph(args, ranks, gather, calls):
    from lamport_head.tuning.support.reference import reference_gather

    me, device, ms = ranks.rank, ranks.device, calls.rows
    static = [torch.zeros(m, calls.shard_width, dtype=calls.dtype, device=device) for m in ms]
    stream = torch.cuda.Stream(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        outs = [gather(x, _no_stock) for x in static]
    bad = torch.zeros(args.calls, dtype=torch.int32, device=device)
    eager_bad = torch.zeros(args.calls, dtype=torch.int32, device=device)
    start = time.monotonic()
    with torch.cuda.stream(stream):  # replays and eager calls: one stream order
        for i in range(args.calls):
            for k, m in enumerate(ms):
                shards = calls.shards_for(i * len(ms) + k, m)
                static[k].copy_(shards[me])
            g.replay()
            for k, m in enumerate(ms):
                shards = calls.shards_for(i * len(ms) + k, m)
                want = reference_gather(shards).view(torch.int32)
                bad[i] += (outs[k].view(torch.int32) != want).any()
            if i % 10 == 9:
                shards = calls.shards_for(10**6 + i, ms[i % len(ms)])
                out = gather(shards[me], _no_stock)
                eager_bad[i] += (out.view(torch.int32) !=
                                 reference_gather(shards).view(torch.int32)).any()
    torch.cuda.synchronize(device)
    per_replay = (time.monotonic() - start) / args.calls
    gather.check()
    gather.box.barrier()
    armed = gather.box.armed()
    report = _gathered(ranks, (int(bad.sum()), int(eager_bad.sum()), armed, per_replay))
    ok = all(b == 0 and e == 0 and a for b, e, a, _ in report)
    if ranks.is_root:
        print(f"ranks graph: tp={ranks.world}, {args.calls} free-running replays of a graph of "
              f"{len(ms)} gathers (M {','.join(map(str, ms))}) + eager calls between, "
              f"{_mode(ranks)}: "
              + ("bitwise equal to the reference on every rank and replay, every mailbox word armed"
                 if ok else f"FAILED {report}")
              + f"; {max(t for *_, t in report) * 1e3:.1f} ms per replay", flush=True)
    return ok


def _gathered(ranks, obj):
    from lamport_head.collective import all_gather_objects

    return all_gather_objects(obj, ranks.group)


def _mode(ranks):
    return f"{ranks.world} processes on one GPU ({SHARED_NOTE})" if ranks.shared else \
        f"{ranks.world} GPUs, {ranks.backend}"


def kill(args, ranks, gather, calls):
    """Returns only on survivors; the killed rank exits inside."""
    from lamport_head.status import GatherTimeout

    bad = torch.zeros(args.kill_after + 10_000, dtype=torch.int32, device=ranks.device)
    run_calls(gather, calls, 0, args.kill_after, bad, ranks.device)
    if ranks.rank == args.kill_rank:
        torch.cuda.synchronize(ranks.device)
        print(f"rank {ranks.rank}: exits without a word after call {args.kill_after}", flush=True)
        # Gone mid-run: its peers wait for pushes that never come. Exit status 0 so that
        # torchrun's agent does not take the survivors down before they report.
        os._exit(0)
    start, i = time.monotonic(), args.kill_after
    try:
        while time.monotonic() - start < args.budget + 30:
            run_calls(gather, calls, i, 1, bad, ranks.device)
            torch.cuda.synchronize(ranks.device)  # a serving step syncs on its sample
            i += 1
        print(f"rank {ranks.rank}: no timeout reported", flush=True)
        return False
    except GatherTimeout as exc:
        waited = time.monotonic() - start
        torch.ones(1, device=ranks.device).add_(1).item()  # the GPU is still usable
        ok = args.kill_rank in exc.peers and waited < args.budget + 1.0
        print(f"rank {ranks.rank}: {exc} after {waited:.2f} s (budget {args.budget} s)"
              f"{'' if ok else ' FAILED'}", flush=True)
        return ok


def slow(args, ranks, gather, calls):
    """Call k is late on one rank. Past the budget: after a sync, check() raises on
    every rank; call k + 1 returns on every rank (NaN peer columns); after a sync,
    call k + 2 raises on every rank: the same call everywhere."""
    from lamport_head.status import GatherTimeout

    bad = torch.zeros(3 * args.calls + 3, dtype=torch.int32, device=ranks.device)
    late = args.slow_s > args.budget
    run_calls(gather, calls, 0, args.calls, bad, ranks.device)
    k = args.calls
    if ranks.rank == args.slow_rank:
        _sleep_s(args.slow_s, ranks.device)
    run_calls(gather, calls, k, 1, bad, ranks.device)
    torch.cuda.synchronize(ranks.device)
    raised, checked = None, None
    try:
        gather.check()
    except GatherTimeout as exc:
        checked = exc
    for i in (k + 1, k + 2):  # none may serve after a give-up: the call that raises
        try:
            gather(calls.shards(i)[ranks.rank], _no_stock)
            torch.cuda.synchronize(ranks.device)
        except GatherTimeout as exc:
            raised = (i, str(exc))
            break
    nxt = k + 3
    if late:
        if args.late_push and ranks.rank == args.slow_rank:
            _late_push(gather, ranks, (ranks.rank + 1) % ranks.world)
        gather.reset()
        bad[k] = 0  # the abandoned call and the one after it: NaN, not served as valid
        bad[k + 1] = 0
    run_calls(gather, calls, nxt, args.calls, bad, ranks.device)
    torch.cuda.synchronize(ranks.device)
    gather.check()
    gather.box.barrier()
    armed = gather.box.armed()
    wrong = int(bad.sum())
    report = _gathered(ranks, (checked is not None, raised, wrong, armed))
    if late:
        ok = all(c and r is not None and r[0] == k + 2 and w == 0 and a for c, r, w, a in report)
    else:
        ok = all(not c and r is None and w == 0 and a for c, r, w, a in report)
    if ranks.is_root:
        what = (f"rank {args.slow_rank} {args.slow_s} s late (budget {args.budget} s)"
                + (" with a late push before reset" if args.late_push else ""))
        lines = "; ".join(f"rank {r}: check {'raised' if c else 'quiet'}, "
                          f"{'raised at call ' + str(x[0] - k) + ' after' if x else 'served'}, "
                          f"{w} bad calls, armed {a}" for r, (c, x, w, a) in enumerate(report))
        verdict = ("every rank raised at the same call (the second after the late one), none "
                   "served; right again after reset()" if late else "every output right")
        print(f"ranks slow: tp={ranks.world}, {what}: {verdict}{'' if ok else ' FAILED'} "
              f"({lines})", flush=True)
        for r, (_, x, _, _) in enumerate(report):
            if x:
                print(f"  rank {r}: {x[1]}", flush=True)
    return ok


def _late_push(gather, ranks, peer):
    """Behind a GPU sleep, overwrite row 0 of ``peer``'s parity-0 box with data, as a
    push of the abandoned call would if it landed late."""
    _sleep_s(0.3, ranks.device)
    gather.box.peer_view(peer)[: gather.width * gather.dtype.itemsize // 4].fill_(0x12345678)


def _contexts(ranks):
    """(this rank's GPU UUID, the UUIDs of the GPUs whose compute apps list this
    process): nvidia-smi sees every context on the host, whatever this process sees."""
    import subprocess

    from lamport_head.mailbox import device_key

    torch.distributed.barrier()  # every rank built: every context there is exists
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=60).stdout
    on = sorted({uuid.strip() for pid, uuid in (line.split(",", 1) for line in out.splitlines()
                                                 if "," in line) if pid.strip() == str(os.getpid())})
    torch.distributed.barrier()
    return device_key(ranks.device)[1], on


def install(args, ranks, calls):
    import tempfile

    from lamport_head import install_logits_gather

    shard = args.vocab // ranks.world
    served = [r for r in calls.rows if r != calls.rows[-2]]  # one row count stays stock
    if ranks.is_root:
        name = torch.cuda.get_device_name(ranks.device)
        text = (f"schema: 1\ndevices:\n  {name}:\n  - tp: {ranks.world}\n    dcp: 1\n"
                + f"    vocab: {args.vocab}\n    dtype: {args.dtype}\n    rows:\n"
                + "".join(f"      {m}: {{ctas: 8, enabled: true}}\n" for m in served)
                + f"      {calls.rows[-2]}: {{ctas: 8, enabled: false}}\n")
        fd, path = tempfile.mkstemp(suffix=".yaml")
        os.write(fd, text.encode())
        os.close(fd)
    else:
        path = None
    path = _gathered(ranks, path)[0]
    os.environ["LAMPORT_HEAD_TABLE"] = path
    if args.fail_alloc_rank == ranks.rank:
        refuse_allocation()
    model, stock_calls = _vllm_shaped(ranks, shard, calls.dtype)
    got = install_logits_gather(model, None, ranks.world, ranks.rank, ranks.device).rows
    from lamport_head.table import load_table

    entries = load_table(path).entries(torch.cuda.get_device_name(ranks.device), ranks.world, 1,
                                       vocab=args.vocab, dtype=args.dtype)
    want_rows = () if args.fail_alloc_rank is not None else tuple(
        sorted(m for m, e in entries.items() if e.enabled))  # measured rows and filled gaps
    bad = _bitwise(model, calls, min(args.calls, 60), ranks, want_rows)
    if args.contexts:
        seen = _gathered(ranks, _contexts(ranks))
        if ranks.is_root:
            wrong = [f"rank {r}: on {on or 'no GPU seen'} (own {own})"
                     for r, (own, on) in enumerate(seen) if on != [own]]
            print(f"ranks contexts: tp={ranks.world}: " + (
                "every rank's process holds a context on its own GPU only" if not wrong
                else "FAILED " + "; ".join(wrong)), flush=True)
        bad += sum(1 for own, on in seen if on != [own])
    expect_stock = sum(1 for i in range(min(args.calls, 60)) if calls.m[i] not in want_rows)
    report = _gathered(ranks, (list(got), bad, len(stock_calls)))
    ok = all(tuple(g) == want_rows and b == 0 and s == expect_stock for g, b, s in report)
    if ranks.is_root:
        os.unlink(path)
        print(f"ranks install: tp={ranks.world}"
              + (f", rank {args.fail_alloc_rank}'s mailbox allocation refused" if
                 args.fail_alloc_rank is not None else "")
              + f": served rows {report[0][0] or 'none (stock)'} on every rank, "
              f"{min(args.calls, 60)} calls bitwise, {report[0][2]} took stock"
              + ("" if ok else f" FAILED {report}"), flush=True)
    return ok


def refuse_allocation():
    """Every mailbox this process builds from now on fails to allocate, as a device out
    of memory would: each real-rank backend's entry in ``mailbox.MAILBOXES`` (the
    public seam a build constructs its box through) becomes one that raises, in the
    build's local allocation step."""
    from lamport_head.mailbox import MAILBOXES

    def refused(group, device, tp, rank, cap, words):
        raise torch.cuda.OutOfMemoryError("injected: mailbox allocation refused")

    for kind in MAILBOXES:
        MAILBOXES[kind] = refused


def _vllm_shaped(ranks, shard, dtype=torch.bfloat16):
    """A model shaped as vLLM's (LogitsProcessor + vocab-parallel BF16 lm_head, its
    head_dtype ``dtype``: float32 for an FP32 lm_head) whose stock gather is vLLM's; and
    the list of row counts that took stock."""
    import types

    from lamport_head.tuning.support.stock import all_gather_logits

    stock_calls = []

    def stock(x):
        stock_calls.append(x.shape[0])
        return all_gather_logits(x, ranks.group)

    lp = types.SimpleNamespace(logits_as_input=False, use_all_gather=True, _gather_logits=stock,
                               head_dtype=None if dtype == torch.bfloat16 else dtype)
    head = types.SimpleNamespace(weight=torch.zeros(shard, 16, dtype=torch.bfloat16,
                                                    device=ranks.device), tp_size=ranks.world)
    return types.SimpleNamespace(logits_processor=lp, lm_head=head), stock_calls


def _bitwise(model, calls, count, ranks, served):
    """Calls 0 .. count-1 through the model's gather: how many differ from what they
    must be (served rows: the Lamport gather's bytes, sentinel words scrubbed; other
    rows: the stock all-gather's bytes)."""
    from lamport_head.tuning.support.reference import reference_gather

    bad = 0
    for i in range(count):
        shards = calls.shards(i)
        out = model.logits_processor._gather_logits(shards[ranks.rank])
        want = reference_gather(shards) if calls.m[i] in served else torch.cat(shards, dim=1)
        bad += int(not torch.equal(out.view(torch.int32), want.view(torch.int32)))
    gather = getattr(model.logits_processor, "head_gather", None)
    if gather is not None:
        torch.cuda.synchronize(ranks.device)
        gather.check()
    return bad


def autotune(args, ranks):
    """First-use tuning at install on a model with no table entry; see the module doc."""
    import logging
    from pathlib import Path

    from lamport_head import install_logits_gather
    from lamport_head.table import user_path

    os.environ.pop("LAMPORT_HEAD_TABLE", None)
    os.environ.setdefault("LAMPORT_HEAD_AUTOTUNE", "1")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lamport_head").addHandler(handler)
    logging.getLogger("lamport_head").setLevel(logging.INFO)
    cap = max(int(x) for x in args.rows.split(","))
    rows = tuple(range(1, cap + 1))  # what a server of cap rows gathers
    shard = args.vocab // ranks.world
    dtype = getattr(torch, args.dtype)
    model, stock_calls = _vllm_shaped(ranks, shard, dtype)
    torch.cuda.synchronize(ranks.device)
    start = time.monotonic()
    outcome = install_logits_gather(model, None, ranks.world, ranks.rank, ranks.device,
                                    rows=rows)
    seconds = time.monotonic() - start
    served, measured = outcome.rows, outcome.measured
    calls = Calls(list(rows), ranks.world, shard, ranks.device, dtype)
    count = min(args.calls, 200)
    bad = _bitwise(model, calls, count, ranks, served)
    report = _gathered(ranks, (list(served), measured, bad, len(stock_calls), seconds))
    expect = {"yes": True, "no": False, None: measured}[args.expect_measure]
    ok = all(r[:2] == report[0][:2] and r[2] == 0 for r in report) and measured == expect
    if ranks.is_root:
        for line in lines:
            print(f"  rank 0 log: {line}", flush=True)
        path = user_path()
        print(f"  user table {path}:", flush=True)
        print(Path(path).read_text() if Path(path).exists() else "  (none)", flush=True)
        print(f"ranks autotune: tp={ranks.world}, {_mode(ranks)}: install took "
              f"{max(r[4] for r in report):.1f} s, {'measured' if measured else 'measured nothing'}"
              f", served rows {report[0][0] or 'none (stock)'} on every rank, {count} calls "
              f"over rows 1-{cap} bitwise ({sum(r[2] for r in report)} wrong), "
              f"{report[0][3]} took stock" + ("" if ok else f" FAILED {report}"), flush=True)
    return ok


def main(argv=None):
    args = _args(argv)
    ranks = init_ranks()
    rows = sorted({int(x) for x in args.rows.split(",")})
    shard = args.vocab // ranks.world
    calls = Calls(rows, ranks.world, shard, ranks.device, getattr(torch, args.dtype))
    if args.install or args.autotune:
        ok = autotune(args, ranks) if args.autotune else install(args, ranks, calls)
        dist.destroy_process_group()
        return 0 if ok else 1
    from lamport_head.all_to_all import AllToAll
    from lamport_head.head_gather import HeadGather
    from lamport_head.mailbox_collective import Setup
    from lamport_head.status import RECOVERABLE

    collective = AllToAll if args.all_to_all else HeadGather
    gather = collective.default(None, ranks.device, ranks.world, ranks.rank, shard, rows,
                                mode=RECOVERABLE, dtype=calls.dtype,
                                setup=Setup(budget_s=args.budget))
    if args.kill_rank is not None:
        os._exit(0 if kill(args, ranks, gather, calls) else 1)  # a peer is gone: no teardown
    if args.graph:
        ok = graph(args, ranks, gather, calls)
    elif args.slow_rank is not None:
        ok = slow(args, ranks, gather, calls)
    else:
        ok = check(args, ranks, gather, calls)
    gather.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
