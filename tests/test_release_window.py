"""The test bed's window of vLLM releases (helpers.VLLM_RELEASES): a release inside it is
taken, one outside it is never counted as covered (CI's LAMPORT_HEAD_REQUIRE_VLLM=1 fails
it), and engine_cpu refuses to guess the CPU quirks of a release it does not know."""

import importlib.metadata

import helpers
import pytest
from engine_cpu import release_quirks


@pytest.mark.parametrize("release", helpers.VLLM_RELEASES)
def test_every_release_of_the_window_is_taken(monkeypatch, release):
    monkeypatch.setattr(helpers, "installed_vllm", lambda: release)
    monkeypatch.setenv("LAMPORT_HEAD_REQUIRE_VLLM", "1")
    assert helpers.require_vllm() == release


@pytest.mark.parametrize("release", ["0.32.0", "0.35.0", None])
def test_a_release_outside_the_window_fails_under_ci_and_skips_elsewhere(monkeypatch, release):
    monkeypatch.setattr(helpers, "installed_vllm", lambda: release)
    monkeypatch.setenv("LAMPORT_HEAD_REQUIRE_VLLM", "1")
    with pytest.raises(pytest.fail.Exception, match=f"found {release}"):
        helpers.require_vllm()
    monkeypatch.setenv("LAMPORT_HEAD_REQUIRE_VLLM", "0")
    with pytest.raises(pytest.skip.Exception, match=" or ".join(helpers.VLLM_RELEASES)):
        helpers.require_vllm()


def test_the_quirks_of_an_unknown_release_are_not_guessed(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.35.0")
    with pytest.raises(AssertionError, match="VLLM_RELEASE_QUIRKS in tests/engine_cpu.py"):
        release_quirks()
