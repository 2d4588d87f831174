"""collective.step (issue 29 item 4), in one process on a 1-rank gloo group: a step's
collectives run on the caller's thread; its local parts before a collective
(``attempt``) are bounded; a step blocking in code of its own is given up on at the
deadline, and its thread, once it unblocks, never issues a collective."""

import threading
import time

import pytest
import torch.distributed as dist

from lamport_head import collective
from lamport_head.collective import StepAbandoned, all_min, attempt, step


@pytest.fixture
def group(tmp_path, monkeypatch):
    """A 1-rank gloo group, and the threads that issued each all_reduce on it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    issued = []
    real = dist.all_reduce

    def all_reduce(*args, **kwargs):
        issued.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    yield issued
    dist.destroy_process_group()


def test_a_steps_collectives_run_on_the_callers_thread(group):
    def fn():
        return all_min(5) + all_min(2)

    assert step(1.0, "two collectives", fn) == 7
    assert group == [threading.current_thread()] * 2


def test_a_local_part_before_a_collective_is_bounded(group):
    """A rank blocked before a collective still reaches it, its timeout for an error."""
    def fn():
        _, error = attempt(time.sleep, 5)
        return error, all_min(1)

    started = time.monotonic()
    error, met = step(0.3, "a blocked export", fn)
    assert isinstance(error, TimeoutError) and met == 1
    assert time.monotonic() - started < 2.0 and len(group) == 1


def test_a_step_blocking_in_its_own_code_is_given_up_on_and_enters_nothing_later(group):
    after = []
    woke = threading.Event()

    def fn():
        time.sleep(0.8)  # code of its own (a peer's mapping, a sync): no collective yet
        try:
            all_min(1)
        except BaseException as exc:
            after.append(exc)
        woke.set()

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="a blocked map did not return within 0.3 s"):
        step(0.3, "a blocked map", fn)
    assert 0.3 <= time.monotonic() - started < 0.8
    assert woke.wait(5)
    assert len(after) == 1 and isinstance(after[0], StepAbandoned)
    assert group == []  # the late collective never reached the group


def test_a_collective_inside_a_local_part_is_refused(group):
    def fn():
        _, error = attempt(all_min, 1)
        return error

    error = step(1.0, "a collective in an attempt", fn)
    assert isinstance(error, RuntimeError) and "inside a local part" in str(error)
    assert group == []


def test_a_step_raises_its_own_error_and_outside_a_step_nothing_changes(group):
    def fn():
        raise ValueError("local failure")

    with pytest.raises(ValueError, match="local failure"):
        step(1.0, "failing", fn)
    assert all_min(3) == 3 and collective._STEP.get() is None
    assert group == [threading.current_thread()]
