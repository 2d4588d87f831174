"""Issue 29 item 3: LAMPORT_HEAD_BUDGET_S has a floor (``settings.MIN_BUDGET_S``),
the trap grace it gives (1/8 of it) one of its own (``settings.MIN_GRACE_S``), and
a non-finite or non-positive value is refused: install takes every rank stock with
one line each (2 gloo ranks, the engines' install, kernels stood in)."""

import os

import pytest
import torch
from helpers import capture_log, fake_cuda, model
from spawn import spawn
from tables import TWO_RANKS as TABLE

from lamport_head import settings


@pytest.mark.parametrize("text,why", [
    ("1e-7", "below the floor of 0.5 s"),  # the case: a 75 ns give-up, a 12 ns grace
    ("0.499", "below the floor of 0.5 s"),
    ("nan", "expected seconds in (0, 3600]"),
    ("inf", "expected seconds in (0, 3600]"),
    ("-inf", "expected seconds in (0, 3600]"),
    ("0", "expected seconds in (0, 3600]"),
    ("-2", "expected seconds in (0, 3600]"),
])
def test_a_budget_out_of_bounds_is_refused_naming_the_variable(monkeypatch, text, why):
    monkeypatch.setenv(settings.BUDGET_ENV, text)
    with pytest.raises(ValueError) as raised:
        settings.spin_budget_s()
    assert str(raised.value).startswith(f"LAMPORT_HEAD_BUDGET_S={text!r}: ") and why in str(
        raised.value)


@pytest.mark.parametrize("text,value", [("0.5", 0.5), ("2", 2.0), ("3600", 3600.0), ("", 10.0)])
def test_a_budget_within_bounds_is_taken(monkeypatch, text, value):
    monkeypatch.setenv(settings.BUDGET_ENV, text)
    assert settings.spin_budget_s() == value


def test_the_floors_hold_together():
    """The budget's floor never gives a grace under the grace's floor."""
    assert settings.MIN_BUDGET_S >= 0.5
    assert settings.trap_grace_s(settings.MIN_BUDGET_S) >= settings.MIN_GRACE_S > 0


def test_the_grace_has_a_floor_of_its_own(monkeypatch):
    """With a lower budget floor (a future change), a budget whose eighth is under
    ``MIN_GRACE_S`` is still refused, for its grace."""
    monkeypatch.setattr(settings, "MIN_BUDGET_S", 0.1)
    monkeypatch.setenv(settings.BUDGET_ENV, "0.2")
    with pytest.raises(ValueError, match=r"trap grace \(0.025 s, 1/8 of it\) is below the floor "
                                         r"of 0.05 s"):
        settings.spin_budget_s()
    monkeypatch.setenv(settings.BUDGET_ENV, "0.4")  # grace 0.05 s: taken
    assert settings.spin_budget_s() == 0.4


def _worker(rank, nprocs, table, value, where):
    os.environ["LAMPORT_HEAD_TABLE"] = table
    if where == "everywhere" or rank == 1:
        os.environ[settings.BUDGET_ENV] = value
    fake_cuda(setattr, rank, "ok")
    from lamport_head.engines.vllm import install_logits_gather

    seen = capture_log()
    m = model(lm__tp_size=nprocs)
    served = install_logits_gather(m, None, nprocs, rank, "cpu").rows
    routed = m.logits_processor._gather_logits(torch.zeros(1, 64, dtype=torch.bfloat16))
    return {"served": list(served), "warnings": [x for x in seen if "stays stock" in x],
            "routed": list(routed)}


@pytest.mark.parametrize("value,where", [("1e-7", "everywhere"), ("0.1", "rank 1"),
                                         ("inf", "everywhere")])
def test_install_takes_every_rank_stock_for_a_budget_out_of_bounds(tmp_path, value, where):
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    for rank, r in enumerate(spawn(_worker, 2, tmp_path, str(table), value, where)):
        assert r["served"] == [] and r["routed"] == ["stock", 1], r
        assert len(r["warnings"]) == 1, r["warnings"]  # one line per rank
        assert f"LAMPORT_HEAD_BUDGET_S={value!r}" in r["warnings"][0], r
