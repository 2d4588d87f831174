"""One rank of an engine-shaped decode loop, run as a process (``tests/test_multiproc.py``).

What vLLM does every decode step, and nothing more: the logits gather (routed by
``install_logits_gather``, as the plugin does), a greedy sample (argmax), the tokens
copied to the host. No ``check()``, no ``reset()``, no sync beyond the copy. The
data is real (random BF16, no planted NaN), so a NaN column where a peer's
fragments are missing would change the argmax: a wrong token is visible.

Faults (one rank): ``--kill-rank R --at S`` exits after step S-1's tokens reached its
host; ``--stall-rank R --at S --stall-s T`` sleeps T seconds on the host before step S
(a GC pause, a host stall). Every rank prints one ``engine-step`` JSON line: the
steps whose tokens reached its host, how many differ from the reference tokens,
the error that stopped it (type and text; or the watchdog's line when the library ended
the process because its GPU context did not stop), the seconds from the start of
the step that failed to the error, and the lamport-head log lines (which name the missing
ranks). Each rank checks its tokens against the reference on its own CPU (every
rank builds every shard from the step's seed), so nothing needs a live peer.

The drafter path (``--draft-vocab VD``, off by default; issue 32): a draft head of
another vocabulary (an EAGLE3 head of 32000) gets its own gather, installed as the
plugin installs a drafter's (``install_drafter_gather`` on a stand-in draft model, after
the target's: a shard width other than the target's, so its own HeadGather, mailbox
and table section, serving mode, the same budget). Each step then runs as vLLM's
greedy EAGLE step does: the target's gather -> argmax -> host, then ``--draft-tokens K``
times the draft gather of fresh data (its own seed per step and draft token) -> argmax
-> host. The report adds ``draft_served`` (the draft gather's rows), ``draft_shared``
(true would mean it rode the target's gather), ``draft_steps`` (steps whose K draft
tokens all reached the host), ``draft_tokens`` (draft tokens on the host, one a row),
``draft_wrong`` (how many of them differ from the reference) and ``failed_in`` (which
gather raised). A fault at step S still comes before the target's gather of step S.
Without ``--draft-vocab`` the loop, its table and its report are what they were.

The all-to-all path (``--all-to-all``, off by default; issue 43): vLLM 0.34's
batch-sharded sampling in place of the gather. Each step's M rows are split over the
ranks anew (``step_splits``: from the step alone, so the same on every rank; ranks with
no rows included), every rank exchanges its ``[M, V/TP]`` through
``all_to_all_vocab_shards`` (routed by the install core on a site whose collective is
the all-to-all, ``stock: nccl-all-to-all``, as vLLM's route is; its stock here gloo's
``all_to_all_single`` + permute), samples its own ``[splits[rank], V]`` (argmax) and
copies the tokens to its host as vLLM's async output does (a non-blocking copy, then an
event synchronized: it waits for the step even where this rank has no rows). Its
reference is its own rows of the step's logits. The report adds ``tokens`` (tokens on
the host) and ``empty_steps`` (steps in which this rank had no rows).
"""

import argparse
import faulthandler
import json
import os
import random
import sys
import tempfile
import time
import types

import torch
from helpers import capture_log

from lamport_head.table import ALL_TO_ALL_STOCK
from lamport_head.benches.diagnostics.ranks import draw_splits


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", type=float, default=2.0)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--stall-rank", type=int)
    p.add_argument("--stall-s", type=float, default=4.0)
    p.add_argument("--at", type=int, default=60)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the draft head's vocabulary VD (its own gather, shard VD/TP); 0: no "
                        "drafter")
    p.add_argument("--draft-tokens", type=int, default=3,
                   help="draft gathers per step (K), after the target's")
    p.add_argument("--all-to-all", action="store_true",
                   help="the target's logits exchanged by the all-to-all of vocab shards "
                        "(batch-sharded sampling) instead of gathered")
    p.add_argument("--linger", type=float, default=0.0,
                   help="seconds a stopped rank stays alive (its context and box) before exiting")
    p.add_argument("--trace", action="store_true",
                   help="timestamps of each step from the fault on, and a report of a rank "
                        "still inside a step 8 s after the budget (diagnosis, not the test)")
    args = p.parse_args(argv)
    if args.all_to_all and args.draft_vocab:
        p.error("--all-to-all samples the target's logits only: no --draft-vocab")
    return args


def _shards(step, rows, tp, shard, seed=None):
    """Every rank's ``[rows, shard]`` BF16 logits of ``step`` (host; the same on every
    rank); ``seed`` (default: the step's) for a draft gather's own data."""
    g = torch.Generator().manual_seed(1_000_003 * step + 7 if seed is None else seed)
    full = torch.randn(rows, tp * shard, generator=g).to(torch.bfloat16)
    return full, [full[:, r * shard:(r + 1) * shard].contiguous() for r in range(tp)]


def _draft_seed(step, k):
    """The seed of draft token ``k``'s logits at ``step``: never a step's own seed
    (those are 7 modulo 1_000_003; these are not, for k < 126)."""
    return 1_000_003 * step + 7 + 7919 * (k + 1)


def step_splits(step, rows, tp):
    """How ``step``'s ``rows`` split over the ``tp`` ranks (the all-to-all's
    ``send_splits``): drawn from the step alone, so the same on every rank, new every
    step (``draw_splits``: even, all to one rank, or cut at random, ranks with no rows)."""
    return draw_splits(random.Random(7_000_003 * step + 11), rows, tp)


def _table(ranks, rows, *vocabs, stock=None):
    """A real-rank section serving ``rows`` at each vocabulary of ``vocabs`` on this GPU
    (every rank writes its own copy; tables are keyed by V, so the draft head's needs
    its own section), measured against ``stock`` (None: not written, the gather's)."""
    name = torch.cuda.get_device_name(ranks.device)
    against = f"    stock: {stock}\n" if stock else ""
    text = (f"schema: 1\ndevices:\n  {name}:\n"
            + "".join(f"  - tp: {ranks.world}\n    dcp: 1\n    vocab: {vocab}\n{against}"
                      "    rows:\n"
                      + "".join(f"      {m}: {{ctas: 8, enabled: true}}\n" for m in rows)
                      for vocab in dict.fromkeys(vocabs)))
    fd, path = tempfile.mkstemp(suffix=".yaml")
    os.write(fd, text.encode())
    os.close(fd)
    return path


def main(argv=None):
    from lamport_head import install_logits_gather
    from lamport_head.tuning.support.procs import init_ranks
    from lamport_head.tuning.support.stock import all_gather_logits

    args = _args(argv)
    lines = capture_log()

    ranks = init_ranks()
    rows = sorted(int(x) for x in args.rows.split(","))
    shard = args.vocab // ranks.world
    drafts = args.draft_tokens if args.draft_vocab else 0
    os.environ["LAMPORT_HEAD_TABLE"] = _table(ranks, rows, args.vocab,
                                              *([args.draft_vocab] if drafts else []),
                                              stock=ALL_TO_ALL_STOCK if args.all_to_all else None)
    os.environ["LAMPORT_HEAD_BUDGET_S"] = str(args.budget)  # the user's setting, agreed
    lp = types.SimpleNamespace(logits_as_input=False, head_dtype=None, use_all_gather=True,
                               _gather_logits=lambda x: all_gather_logits(x, ranks.group))
    head = types.SimpleNamespace(weight=torch.zeros(shard, 16, dtype=torch.bfloat16,
                                                    device=ranks.device), tp_size=ranks.world)
    model = types.SimpleNamespace(logits_processor=lp, lm_head=head)
    exchange = None  # the routed all_to_all_vocab_shards (--all-to-all)
    if args.all_to_all:
        served, exchange = _install_all_to_all(ranks, head)
    else:
        served = install_logits_gather(model, None, ranks.world, ranks.rank, ranks.device).rows
    if drafts:  # the drafter's install follows the target's, as the plugin's does
        dshard = args.draft_vocab // ranks.world
        dlp, drafter = _install_drafter(ranks, model, dshard, drafts,
                                        lambda x: all_gather_logits(x, ranks.group))
    # A rank stuck anywhere (a copy that never returns) shows where, then exits.
    faulthandler.dump_traceback_later(args.budget + args.stall_s + 40, exit=True)

    report = {"rank": ranks.rank, "served": list(served), "steps": 0, "wrong": 0,
              "wrong_steps": [], "error": None, "stopped_after_s": None}
    if exchange is not None:
        report.update(tokens=0, empty_steps=0)
    if drafts:
        report.update(draft_served=list(drafter.served), draft_shared=drafter.outcome.shared,
                      draft_why=drafter.outcome.message, draft_steps=0, draft_tokens=0, draft_wrong=0,
                      draft_wrong_at=[])
    gather = "target"  # the gather of the step now running, for the report
    step, started = 0, time.monotonic()
    _report_before_the_watchdog_exits(report, lines, lambda: (step, started))
    if args.trace:
        _trace(args, report, lines, lambda: (step, started))
    try:
        for step in range(args.steps):
            if step == args.at and ranks.rank == args.kill_rank:
                report["killed"] = True
                print("engine-step " + json.dumps(report), flush=True)
                os._exit(0)  # gone without a word: its peers wait for pushes that never come
            if step == args.at and ranks.rank == args.stall_rank:
                time.sleep(args.stall_s)
            m = rows[step % len(rows)]
            full, shards = _shards(step, m, ranks.world, shard)
            if exchange is not None:  # this rank samples its own rows of the step
                splits = step_splits(step, m, ranks.world)
                first, mine = sum(splits[:ranks.rank]), splits[ranks.rank]
                full = full[first:first + mine]
            want = full.float().argmax(dim=-1)
            started = time.monotonic()
            if args.trace and step >= args.at - 1:
                print(f"trace rank {ranks.rank}: step {step} starts at {time.time():.3f}",
                      flush=True)
            gather = "target"
            if exchange is None:
                logits = lp._gather_logits(shards[ranks.rank].to(ranks.device))
                tokens = logits.argmax(dim=-1).cpu()  # the engine's copy of the tokens
            else:
                logits = exchange(shards[ranks.rank].to(ranks.device), splits, mine)
                tokens = _to_host(logits.argmax(dim=-1))
                report["tokens"] += tokens.numel()
                report["empty_steps"] += int(mine == 0)
            report["steps"] += 1
            if step % 20 == 0 or step >= args.at:
                print(f"rank {ranks.rank}: step {step} tokens on the host", flush=True)
            if not torch.equal(tokens, want):
                report["wrong"] += 1
                report["wrong_steps"].append(step)
            for k in range(drafts):  # K greedy draft tokens, a gather each, at the step's rows
                gather = f"draft {k}"
                dfull, dshards = _shards(step, m, ranks.world, dshard, seed=_draft_seed(step, k))
                dwant = dfull.float().argmax(dim=-1)
                drafted = dlp._gather_logits(dshards[ranks.rank].to(ranks.device))
                dtokens = drafted.argmax(dim=-1).cpu()  # the engine's copy of the draft
                report["draft_tokens"] += dtokens.numel()
                bad = int((dtokens != dwant).sum()) if dtokens.shape == dwant.shape else m
                if bad:
                    report["draft_wrong"] += bad
                    report["draft_wrong_at"].append([step, k])
            if drafts:
                report["draft_steps"] += 1
    except Exception as exc:  # what the engine's worker would see
        # Kept to the end (os._exit): freeing its traceback would free the CUDA tensors
        # its frames hold (``_to_host``'s tokens), and a CUDA free after the context
        # stopped throws from a destructor, which ends the process before its report.
        _KEPT.append(exc)
        report["stopped_after_s"] = round(time.monotonic() - started, 3)
        report["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        report["failed_step"] = step
        if drafts:
            report["failed_in"] = gather
        time.sleep(0.3)  # the watcher's line, if it is still on its way
        if args.trace:
            print(f"trace rank {ranks.rank}: raised at {time.time():.3f}", flush=True)
        time.sleep(args.linger)
    report["log"] = [x for x in lines if "lamport-head" in x][-6:]
    print("engine-step " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a peer may be gone, and a stopped context cannot sync


_KEPT = []  # what must outlive the loop: freed only by os._exit


def _no_first_use(*args, **kwargs):
    """First-use tuning: never asked for here (the loop's table has the all-to-all's
    section); if it were, raised alike on every rank (every rank stays stock)."""
    from lamport_head.collective import together

    raise together(NotImplementedError("the engine-shaped loop measures nothing"))


def _install_all_to_all(ranks, head):
    """The all-to-all's route, as vLLM's batch-sharded sampling gets it: the install core
    (collective, fail-stop) on a site whose collective is ``all_to_all_vocab_shards``
    (``stock: nccl-all-to-all``; its stand-in here gloo's ``all_to_all_single`` + the
    permute) over the vocab-parallel ``head``. (The served rows, the routed
    ``exchange(shard, send_splits, num_local_rows)``.)"""
    from lamport_head import install
    from lamport_head.outcome import Ranks
    from lamport_head.tuning.support.stock import all_to_all_logits

    holder = types.SimpleNamespace(
        exchange=lambda x, splits, rows: all_to_all_logits(x, splits, ranks.group))
    site = install.GatherSite(processor=holder, attr="exchange", weight=head.weight,
                              head_tp=head.tp_size, where="engine_step's all_to_all_vocab_shards",
                              stock=ALL_TO_ALL_STOCK)
    outcome = install.install(site, Ranks(None, ranks.world, ranks.rank, ranks.device),
                              measure=_no_first_use)
    return outcome.rows, holder.exchange


def _to_host(tokens):
    """``tokens`` on the host as vLLM's async model output copies them: a non-blocking
    copy, then an event recorded behind it and synchronized. The event waits for the
    step's kernels even where this rank sampled no rows (a copy of nothing waits for
    nothing, so a rank of no rows would run on unchecked)."""
    host = tokens.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host


def _install_drafter(ranks, target, dshard, drafts, stock):
    """The draft head's stand-in model (an EAGLE3 head: its own LogitsProcessor, whose
    stock gather is ``stock``, and a vocab-parallel lm_head of ``dshard`` columns a
    rank), routed as the plugin routes a drafter once the ``target`` is installed:
    ``install_drafter_gather`` (collective: every rank calls it, in this order). Its
    processor and the ``Drafter`` saying how it was served."""
    from lamport_head.engines.vllm import install_drafter_gather
    from lamport_head.outcome import Ranks

    dlp = types.SimpleNamespace(logits_as_input=False, head_dtype=None, use_all_gather=True,
                                _gather_logits=stock)
    dhead = types.SimpleNamespace(weight=torch.zeros(dshard, 16, dtype=torch.bfloat16,
                                                     device=ranks.device), tp_size=ranks.world)
    draft = types.SimpleNamespace(logits_processor=dlp, lm_head=dhead)
    drafter = install_drafter_gather(draft, target, Ranks(None, ranks.world, ranks.rank,
                                                          ranks.device),
                                     paths=((f"drafter compute_logits x {drafts}",), ()))
    return dlp, drafter


def _report_before_the_watchdog_exits(report, lines, where):
    """The watcher ends a process whose GPU context did not stop (``status.Watcher``),
    right after its CRITICAL line: print this rank's report from that line, as the
    engine's log would show it, since ``main`` never gets to."""
    import logging

    def emit(record):
        if record.levelno >= logging.CRITICAL:
            step, started = where()
            report.update(stopped_after_s=round(time.monotonic() - started, 3),
                          error=f"ended by the watchdog: {record.getMessage()[:300]}",
                          failed_step=step, log=[x for x in lines if "lamport-head" in x][-6:])
            print("engine-step " + json.dumps(report), flush=True)

    handler = logging.Handler()
    handler.emit = emit
    logging.getLogger("lamport_head").addHandler(handler)


def _trace(args, report, lines, where):
    """A daemon thread: once a step has run past budget + 8 s, print what this rank
    knows (its log lines, the GPU's compute processes) so a hang can be told apart
    from a slow stop."""
    import subprocess
    import threading

    def watch():
        while True:
            time.sleep(0.5)
            step, started = where()
            if report["error"] is None and time.monotonic() - started > args.budget + 8:
                smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader"], capture_output=True, text=True)
                print(f"trace rank {report['rank']} (pid {os.getpid()}): still in step {step} "
                      f"{time.monotonic() - started:.1f} s after it began, at {time.time():.3f}; "
                      f"log {[x[:160] for x in lines[-3:]]}; compute apps "
                      f"{smi.stdout.split()}", flush=True)
                return

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
