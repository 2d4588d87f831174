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

    from lamport_head.table import user_path

    now = {k: "v" for k in provenance.STALE_KEYS}
    monkeypatch.setattr(provenance, "facts", lambda: now)
    old = types.SimpleNamespace(source=str(user_path()), provenance=dict(now, **changed))
    assert provenance.section_status(old) == state
    assert provenance.section_status(types.SimpleNamespace(source="/packaged.yaml",
                                                           provenance={})) == "current"
    assert provenance.section_status(None) == "missing"
