"""The real-rank checker's fault injection goes through public seams (issue 30 item 3).

``benches/diagnostics/ranks.py --fail-alloc-rank R`` makes rank R's mailbox allocation
fail; it used to overwrite ``IpcMailbox._allocate``. Now ``refuse_allocation()``
replaces the entries of ``mailbox.MAILBOXES``, the constructor a build looks up. Here
on gloo CPU ranks (helpers.fake_cuda's kernels and CPU boxes, registered in that same
table) the install core must take every rank to stock, the refusing rank naming the
injected cause; without the injection the same ranks serve.
"""

import pytest
from helpers import capture_log, fake_cuda, model
from spawn import spawn
from tables import TWO_RANKS as TABLE


def _worker(rank, nprocs, table, refuse_rank):
    import os

    from lamport_head import build, mailbox
    from lamport_head.engines.vllm import install_logits_gather
    from lamport_head.benches.diagnostics import ranks

    os.environ["LAMPORT_HEAD_TABLE"] = table
    fake_cuda(setattr, rank, "ok")
    # the CPU boxes registered where a real process's build finds its backends
    mailbox.MAILBOXES.update(build.MAILBOXES)
    build.MAILBOXES = mailbox.MAILBOXES
    if rank == refuse_rank:
        ranks.refuse_allocation()
    seen = capture_log()
    m = model(lm__tp_size=nprocs)
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    return {"served": list(served), "log": [x for x in seen if "stays stock" in x]}


@pytest.mark.parametrize("refuse_rank", [None, 1])
def test_refuse_allocation_takes_every_rank_to_stock(tmp_path, refuse_rank):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE.replace("tp: 2", "tp: 3"))
    results = spawn(_worker, 3, tmp_path, str(table), refuse_rank)
    for rank, r in enumerate(results):
        if refuse_rank is None:
            assert r["served"] == [1, 2, 4] and r["log"] == []
            continue
        assert r["served"] == [] and len(r["log"]) == 1, r
        if rank == refuse_rank:
            assert "OutOfMemoryError: injected: mailbox allocation refused" in r["log"][0]
        else:
            assert "another rank failed" in r["log"][0]
