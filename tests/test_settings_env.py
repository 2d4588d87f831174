"""``settings`` is the one reader of the environment (issue 30 item 4): no other module
of the runtime, the kernels or the tuner reads ``os.environ`` / ``os.getenv``, so every
switch has one definition and one reader (and install can carry its value in the
rank's vote). Writes are allowed (switching torch's multicast off, a child process's
environment), and the tools' torchrun variables (``WORLD_SIZE``, ``LOCAL_RANK``: who
launched the tool, not a setting) are read where the tools start."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# module -> why it may read the environment
READERS = {
    "lamport_head/settings.py": "the reader",
    "tuning/support/procs.py": "torchrun's rank variables (tools)",
    "lamport_head/cli.py": "torchrun's WORLD_SIZE (tools)",
    "tuning/targets.py": "torchrun's WORLD_SIZE (tools)",
}


def _reads(tree):
    """Line numbers where the environment is read (not written or deleted)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node)
    reads = []
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in lines:
        up = parents.get(node)
        if node.attr == "environ" and isinstance(up, ast.Subscript) \
                and isinstance(up.ctx, (ast.Store, ast.Del)):
            continue  # os.environ[X] = ... / del os.environ[X]
        if node.attr == "environ" and isinstance(up, ast.Attribute) \
                and up.attr in ("pop", "setdefault", "update") \
                and isinstance(parents.get(up), ast.Call) and _discarded(parents, parents[up]):
            continue  # a write whose answer nobody reads
        reads.append(node.lineno)
    return reads


def _discarded(parents, call):
    return isinstance(parents.get(call), ast.Expr)


def _modules():
    for folder in ("lamport_head", "kernels", "tuning", "benches"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path


@pytest.mark.parametrize("name", [n for n, _ in _modules()])
def test_only_settings_reads_the_environment(name):
    path = ROOT / name
    reads = _reads(ast.parse(path.read_text(encoding="utf-8")))
    if name in READERS:
        return
    assert not reads, (f"{name} reads the environment at line(s) {reads}: read it through "
                       "lamport_head.settings (one definition, one reader)")


def test_the_checker_sees_a_read_and_passes_a_write():
    assert _reads(ast.parse("import os\nx = os.environ.get('A')\n")) == [2]
    assert _reads(ast.parse("import os\nx = os.environ['A']\n")) == [2]
    assert _reads(ast.parse("import os\nx = os.getenv('A')\n")) == [2]
    assert _reads(ast.parse("import os\nos.environ['A'] = '1'\n")) == []
    assert _reads(ast.parse("import os\nos.environ.pop('A', None)\n")) == []
