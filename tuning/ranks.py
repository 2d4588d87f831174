"""Real-rank checks under torchrun (one process per GPU, NCCL, symmetric memory).

    torchrun --nproc-per-node N -m lamport_head.tuning.ranks [--calls 10000]
    torchrun --nproc-per-node N -m lamport_head.tuning.ranks --kill-rank 1 --kill-after 500

Check: HeadGather on symmetric memory against NCCL's all-gather (vLLM's stock path,
sentinel words scrubbed) on fresh planted data every call, M drawn from 1..64 by a
seed every rank shares. Kill: one rank exits mid-run; every other rank must get
``GatherTimeout`` naming it within the spin budget, and its GPU must stay usable.
NVLink multicast stays off in every process (forced here before anything starts).
"""

import argparse
import os
import random
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROWS = tuple(range(1, 65))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m lamport_head.tuning.ranks")
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-after", type=int, default=500)
    p.add_argument("--budget", type=float, default=2.0)
    args = p.parse_args(argv)

    from lamport_head.head_gather import GatherTimeout, HeadGather
    from lamport_head.reference import planted, scrub
    from lamport_head.stock import all_gather_logits

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, tp = dist.get_rank(), dist.get_world_size()
    shard = args.vocab // tp
    gather = HeadGather(dist.group.WORLD, device, tp, rank, shard, ROWS, budget_s=args.budget)
    rng = random.Random(1234)  # the same M sequence on every rank
    errors = torch.zeros((), dtype=torch.int64, device=device)
    for call in range(args.calls):
        rows = rng.choice(ROWS)
        if args.kill_rank is not None and call == args.kill_after:
            return _after_kill(args, gather, rank, rows, shard, device, GatherTimeout)
        x = planted(rows, shard, device=device)
        out = gather(x, lambda v: all_gather_logits(v))
        want = scrub(all_gather_logits(x)).view(torch.int32)
        errors += (out.view(torch.int32) != want).any()
    dist.all_reduce(errors)
    gather.check()
    ok = errors.item() == 0
    if rank == 0:
        print(f"ranks check: tp={tp}, {args.calls} calls, M in 1..64, V={args.vocab}: "
              f"{'bitwise equal to NCCL all-gather on every rank and call' if ok else f'{errors.item()} bad rank-calls'}",
              flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def _after_kill(args, gather, rank, rows, shard, device, GatherTimeout):
    from lamport_head.reference import planted

    if rank == args.kill_rank:
        os._exit(17)  # dies without a word: its peers wait for pushes that never come
    x = planted(rows, shard, device=device)
    start = time.monotonic()
    gather(x, lambda v: None)  # the kernel that waits for the dead rank
    try:
        torch.cuda.synchronize(device)
        gather.check()
    except GatherTimeout as exc:
        waited = time.monotonic() - start
        named = args.kill_rank in exc.peers
        torch.ones(1, device=device).add_(1).item()  # the GPU is still usable
        print(f"rank {rank}: {exc} after {waited:.2f} s", flush=True)
        os._exit(0 if named and waited < args.budget + 1.0 else 1)
    print(f"rank {rank}: no timeout reported", flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
