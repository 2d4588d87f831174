"""lamport_head.provenance: the kernel build's identity, the runtime facts a timing
depends on (lamport-head's version from package metadata), and when a table section
is stale."""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys

import pytest

from lamport_head import provenance


def test_kernel_identity_follows_sources_and_dsl_version(tmp_path, monkeypatch):
    installed = importlib.util.find_spec("lamport_head.kernels").submodule_search_locations[0]
    copy = tmp_path / "kernels"
    shutil.copytree(installed, copy)
    ident = provenance.kernel_identity()
    assert len(ident) == 12 and int(ident, 16) >= 0
    assert provenance.kernel_identity(copy) == ident
    (copy / "gather.py").write_bytes((copy / "gather.py").read_bytes() + b"\n# edited\n")
    assert provenance.kernel_identity(copy) != ident
    monkeypatch.setattr(provenance.importlib.metadata, "version", lambda name: "0.0.0-other")
    assert provenance.kernel_identity() != ident
    # Computed without importing the kernels (or cutlass).
    code = ("import sys; from lamport_head.provenance import kernel_identity; kernel_identity(); "
            "assert 'cutlass' not in sys.modules and 'lamport_head.kernels.compile' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_facts_carry_the_package_version():
    facts = provenance.runtime_facts()
    assert facts["lamport_head"] == importlib.metadata.version("lamport-head")
    assert set(provenance.STALE_KEYS) <= set(facts)


@pytest.mark.parametrize("changed, state", [({}, "current"),
                                            ({"driver": "1", "kernel": "x"}, "stale: driver, kernel")])
def test_only_the_user_tables_sections_go_stale(changed, state, monkeypatch):
    import types

    from lamport_head.table import section_status, user_path

    now = {k: "v" for k in provenance.STALE_KEYS}
    monkeypatch.setattr(provenance, "facts", lambda: now)
    old = types.SimpleNamespace(source=str(user_path()), provenance=dict(now, **changed))
    assert section_status(old) == state
    assert section_status(types.SimpleNamespace(source="/packaged.yaml",
                                                provenance={})) == "current"
    assert section_status(None) == "missing"


def test_the_commit_is_this_checkouts_and_says_when_its_code_differs(tmp_path):
    """``source_commit``: the checkout's HEAD when ``lamport_head`` is its own package
    directory, ``+dirty`` once a tracked code file differs (a copied tree whose git is
    older than its files), a table edit alone is not; None for a package directory
    inside another project's repository or outside any."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git")

    def run(*args, cwd):
        subprocess.run([git, *args], cwd=cwd, check=True, capture_output=True)

    repo = tmp_path / "checkout"
    (repo / "lamport_head").mkdir(parents=True)
    (repo / "tables").mkdir()
    (repo / "lamport_head" / "provenance.py").write_text("x = 1\n")
    (repo / "tables" / "head_gather.yaml").write_text("devices: []\n")
    run("init", "-q", cwd=repo)
    run("add", ".", cwd=repo)
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c", cwd=repo)
    head = subprocess.run([git, "rev-parse", "--short=12", "HEAD"], cwd=repo,
                          capture_output=True, text=True).stdout.strip()
    assert provenance.source_commit(repo / "lamport_head") == head
    (repo / "tables" / "head_gather.yaml").write_text("devices: [1]\n")
    assert provenance.source_commit(repo / "lamport_head") == head
    (repo / "lamport_head" / "provenance.py").write_text("x = 2\n")
    assert provenance.source_commit(repo / "lamport_head") == head + "+dirty"
    nested = repo / "venv" / "site-packages" / "lamport_head"  # another project's tree
    nested.mkdir(parents=True)
    assert provenance.source_commit(nested) is None
    outside = tmp_path / "wheel" / "lamport_head"
    outside.mkdir(parents=True)
    assert provenance.source_commit(outside) is None
