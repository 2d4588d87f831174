"""A canary process for tests/test_multiproc.py (issue 28 item 3): it takes most of the
GPU's free memory, fills every word with a pattern, says so, waits for a line on stdin,
then counts the words that changed. Started on the GPU right after a TP rank died: if
the dead rank's box could be handed to a new process while the survivors still push
into it and mark it, the canary would hold those pages and see the stores."""

import json
import sys

import torch

PATTERN = 0x5A5A5A5A
KEEP_FREE = 2 << 30  # leave the survivors room for their own allocations


def main():
    device = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(device)
    words = max(0, free - KEEP_FREE) // 4
    canary = torch.full((words,), PATTERN, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    print(f"canary ready {words} words ({words * 4 / 2**30:.1f} GiB of {total / 2**30:.1f})",
          flush=True)
    sys.stdin.readline()
    chunk = 1 << 26  # compared a piece at a time: the GPU has 2 GiB left for it
    changed = sum(int((canary[i:i + chunk] != PATTERN).sum().item())
                  for i in range(0, words, chunk))
    print("canary " + json.dumps({"words": words, "changed": changed}), flush=True)


if __name__ == "__main__":
    main()
