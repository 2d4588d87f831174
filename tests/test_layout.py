"""The module map of docs/design.md is the code (issue 50 item 1), and the runtime
package holds serving code only (issue 30 item 3).

The map's table names each room's modules and the rooms it may import; every module of
``lamport_head/``, ``kernels/``, ``tuning/`` and ``benches/`` sits in exactly one room, every import
(lazy ones included) stays inside its room or goes to a room the map allows, and no
import closes a circle but the one the map names.

``lamport_head/`` (the runtime: engines, install core, build, gather, mailbox, tables)
is what a serving process loads. The tools that serve the tuner, the CLI and the
tests (TP virtual ranks on one GPU, processes under torchrun, the stock stand-in, the
reference and planted data) live in the tuner's wing, ``tuning/support/`` (installed
as ``lamport_head.tuning.support``), and the vLLM log bridge lives in the vLLM
adapter. Read from the source (imports, lazy ones included), so a module that serving
never reaches, or a runtime import of a tool, fails here before it ships.
"""

import ast
import fnmatch
import importlib.util
import re
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "lamport_head"
SUPPORT = "lamport_head.tuning.support"
TOOLS = ("emulate", "procs", "reference", "stock")  # the tuner's, the CLI's, the tests'
# Where serving enters the runtime: the package, the engines' entry points
# (pyproject.toml).
ENTRIES = ("lamport_head", "lamport_head.engines.vllm", "lamport_head.engines.sglang")
TOP = ("lamport_head.cli",)  # the command: beside the engines, may import the tuner


# The trees and the names they install under (pyproject.toml's package-dir).
HOMES = ((RUNTIME, "lamport_head"), (ROOT / "kernels", "lamport_head.kernels"),
         (ROOT / "tuning", "lamport_head.tuning"), (ROOT / "benches", "lamport_head.benches"))


def _modules():
    """{installed module name: path} of every module of the trees."""
    out = {}
    for home, package in HOMES:
        for path in sorted(home.rglob("*.py")):
            parts = list(path.relative_to(home).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _runtime():
    """{module name: path} of the runtime package (kernels/ and tuning/ sit outside it)."""
    return {n: p for n, p in _modules().items() if p.is_relative_to(RUNTIME) and n not in TOP}


def _import_statements(name, path):
    """Each import of ``name``'s source (at the top or lazily) as ``(base, names)``:
    ``import X`` is ``(X, ())``, ``from X import y, z`` is ``(X, (X.y, X.z))``, relative
    imports resolved; ``__init__``'s lazy names (``importlib.import_module(".x",
    __name__)``) each a ``(lamport_head.x, ())``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            base = ".".join(base + ([node.module] if node.module else [])) if node.level \
                else node.module
            out.append((base, tuple(f"{base}.{a.name}" for a in node.names)))
    if path.name == "__init__.py" and name == "lamport_head":
        lazy = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", None) == "_LAZY")
        out.extend((f"lamport_head.{ast.literal_eval(v)[0]}", ()) for v in lazy.values)
    return out


def _imports(name, path):
    """Every module ``name`` imports (``from X import y`` counts ``X`` and ``X.y``)."""
    return {m for base, names in _import_statements(name, path) for m in (base, *names)}


def test_the_tools_live_in_the_tuners_wing_not_the_runtime():
    for tool in TOOLS:
        assert not (RUNTIME / f"{tool}.py").exists(), f"lamport_head/{tool}.py is in the runtime"
        spec = importlib.util.find_spec(f"{SUPPORT}.{tool}")
        assert spec is not None and Path(spec.origin).resolve() == ROOT / "tuning" / "support" \
            / f"{tool}.py"
    assert not (RUNTIME / "log.py").exists(), "the vLLM log bridge belongs to engines/vllm/route.py"


def test_no_runtime_module_imports_a_tool():
    for name, path in _runtime().items():
        tools = sorted(m for m in _imports(name, path) if m.startswith(SUPPORT)
                       or m in {f"lamport_head.{t}" for t in TOOLS})
        assert tools == [], f"{name} imports {tools}"


def test_only_the_engines_lazy_first_use_names_the_tuner():
    for name, path in _runtime().items():
        tuner = sorted(m for m in _imports(name, path) if m.startswith("lamport_head.tuning"))
        want = ["lamport_head.tuning.firstuse", "lamport_head.tuning.firstuse.measure"] \
            if name == "lamport_head.engines" else []
        assert tuner == want, f"{name} imports {tuner}"


def test_only_the_vllm_adapter_imports_vllm():
    for name, path in _runtime().items():
        vllm = sorted(m for m in _imports(name, path) if m.split(".")[0] == "vllm")
        adapter = name == "lamport_head.engines.vllm" or name.startswith("lamport_head.engines.vllm.")
        assert vllm == [] or adapter, f"{name} imports {vllm}"


def test_every_runtime_module_is_one_serving_reaches():
    """From the entries, through every import (lazy ones too): nothing in the runtime is
    there for the tools alone."""
    runtime = _runtime()
    seen, todo = set(), list(ENTRIES)
    while todo:
        name = todo.pop()
        if name in seen or name not in runtime:
            continue
        seen.add(name)
        todo.extend(_imports(name, runtime[name]))
    assert sorted(set(runtime) - seen) == []


def test_the_walk_sees_relative_lazy_and_string_imports(tmp_path):
    """The reader itself: each import form a module uses is found (else the tests above
    could pass on a module they do not read)."""
    pkg = tmp_path / "lamport_head" / "engines"
    pkg.mkdir(parents=True)
    path = pkg / "x.py"
    path.write_text("from .. import install, log\nfrom . import y\n"
                    "def f():\n    from lamport_head.tuning.support.emulate import E\n"
                    "    import vllm.logger\n")
    got = _imports("lamport_head.engines.x", path)
    assert {"lamport_head.install", "lamport_head.log", "lamport_head.engines.y",
            "lamport_head.tuning.support.emulate", "vllm.logger"} <= got
    init = tmp_path / "lamport_head" / "__init__.py"
    init.write_text('_LAZY = {"E": ("emulate", "E")}\n')
    assert "lamport_head.emulate" in _imports("lamport_head", init)


def test_serving_loads_no_tool(tmp_path):
    """Every runtime module and every public name of the package, imported in a fresh
    process: no tool, no tuner module, no optuna among the loaded modules.

    The one exception is first-use tuning: when no table section serves this GPU model,
    TP, DCP, V and stock, install's ``engines.measure_first_use`` imports
    ``tuning.firstuse``, the Optuna sweep and ``tuning.support`` inside the engine's
    ``load_model`` (README, "First-use tuning"; docs/tuning.md). ``LAMPORT_HEAD_AUTOTUNE=0``
    turns it off. A process whose tables cover it imports none of them:
    ``tests/test_install.py::test_serving_from_a_table_imports_neither_the_tuner_nor_optuna_nor_the_cli``."""
    names = sorted(n for n in _runtime() if n != "lamport_head")
    code = ("import importlib, json, sys\nimport lamport_head\n"
            "[getattr(lamport_head, n) for n in lamport_head.__all__]\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('lamport_head.tuning', 'lamport_head.benches'))"
            f" or m.split('.')[0] == 'optuna' or m in {[f'lamport_head.{t}' for t in TOOLS]!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# Private names the diagnostics may reach, none of them ours: why each is allowed.
NOT_OURS = {"_exit": "os._exit (a killed rank leaves without teardown)",
            "_sleep": "torch.cuda._sleep (a GPU spin)",
            "_gather_logits": "vLLM's LogitsProcessor gather, the one install routes"}


def test_diagnostics_reach_the_runtime_through_public_names_only():
    """No private attribute of a runtime object is read, called or overwritten by the
    diagnostics (fault injection goes through ``mailbox.MAILBOXES``; timers through
    ``build.TOOLCHAIN`` and ``status_address``)."""
    for path in sorted((ROOT / "benches" / "diagnostics").glob("*.py")):
        private = sorted({n.attr for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                          if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                          and not n.attr.startswith("__") and n.attr not in NOT_OURS})
        assert private == [], f"{path.name} reaches {private}"


def test_every_package_of_the_tree_is_in_the_distribution():
    """A package pyproject.toml does not list is left out of a built wheel (an editable
    install, as the tests run, still finds it): every folder with an ``__init__.py``
    under lamport_head/, kernels/, tuning/, benches/ and tables/ is listed, under its installed name."""
    import tomllib

    root = RUNTIME.parent
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    dirs = config["tool"]["setuptools"]["package-dir"]
    homes = {root / path: name for name, path in dirs.items()}
    homes.setdefault(root / "lamport_head", "lamport_head")
    found = set()
    for home, name in homes.items():
        for init in home.rglob("__init__.py"):
            parts = init.parent.relative_to(home).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert found - listed == set(), f"packages missing from pyproject.toml: {found - listed}"


def test_the_kernels_import_nothing_of_the_runtime():
    """kernels/ is device code and its plain-Python constants: it names no module of the
    runtime, the tuner or an engine (docs/design.md, the module map)."""
    for name, path in _modules().items():
        if not (name + ".").startswith("lamport_head.kernels."):
            continue
        ours = sorted(m for m in _imports(name, path) if m.startswith("lamport_head")
                      and not m.startswith("lamport_head.kernels"))
        assert ours == [], f"{path.name} imports {ours}"


# ---- the map -------------------------------------------------------------------------

MAP = ROOT / "docs" / "design.md"


def _map(text=None):
    """``({room: (module patterns, rooms it may import)}, the named circles)`` from
    docs/design.md's module map: its table's rows, and the circle its text names."""
    text = MAP.read_text(encoding="utf-8") if text is None else text
    section = text.split("## 4. The module map", 1)[1].split("\n## ", 1)[0]
    rooms, table = {}, False
    for line in section.splitlines():
        if not line.startswith("|"):
            if table:
                break  # the first table is the map
            continue
        table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "room" or set(cells[0]) <= set("- "):
            continue
        rooms[cells[0]] = (re.findall(r"`([\w.*]+)`", cells[1]),
                           {r.strip() for r in cells[2].split(",") if r.strip()})
    circles = [frozenset(pair) for pair in
               re.findall(r"`(lamport_head[\w.]*)` <-> `(lamport_head[\w.]*)`", section)]
    return rooms, circles


def _graph(modules):
    """{module: the modules of ours it imports}, statement by statement: ``from X import
    y`` is the module ``X.y`` where there is one, else (a name of ``X``) ``X`` itself;
    ``import X.y`` is the deepest of our modules it names."""
    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        edges = set()
        for base, names in _import_statements(name, path):
            edges.update(n if n in modules else resolve(base) for n in names or (base,))
        graph[name] = {m for m in edges if m and m != name}
    return graph


def _room(rooms, module):
    return [r for r, (patterns, _) in rooms.items()
            if any(fnmatch.fnmatchcase(module, p) for p in patterns)]


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _crossings(graph, rooms):
    """Every import the map forbids: ``(module, its room, imported, that room)``."""
    bad = []
    for name, imported in sorted(graph.items()):
        (mine,) = _room(rooms, name)
        for m in sorted(imported):
            (theirs,) = _room(rooms, m)
            if theirs != mine and theirs not in rooms[mine][1]:
                bad.append((name, mine, m, theirs))
    return bad


def test_every_module_sits_in_one_room():
    rooms, _ = _map()
    modules = _modules()
    assert {r: len(_room(rooms, m)) for m in modules for r in [m]
            if len(_room(rooms, m)) != 1} == {}
    unused = [(r, p) for r, (patterns, _) in rooms.items() for p in patterns
              if not any(fnmatch.fnmatchcase(m, p) for m in modules)]
    assert unused == [], f"map patterns matching no module: {unused}"
    assert all(may <= set(rooms) for _, may in rooms.values())


def test_every_import_follows_the_map():
    rooms, _ = _map()
    assert _crossings(_graph(_modules()), rooms) == []


def test_no_import_closes_a_circle():
    _, named = _map()
    assert sorted(map(sorted, _circles(_graph(_modules())))) == sorted(map(sorted, named))


def test_the_map_catches_a_wrong_import_and_a_circle(tmp_path):
    """The rules themselves, on a made-up tree: a runtime module importing the install
    core is a crossing; two modules importing each other (one lazily) are a circle."""
    rooms, _ = _map()
    graph = {"lamport_head.table": {"lamport_head.install"},
             "lamport_head.install": {"lamport_head.table"}}
    assert _crossings(graph, rooms) == [
        ("lamport_head.table", "runtime", "lamport_head.install", "install")]
    assert _circles(graph) == [frozenset(graph)]
    path = tmp_path / "tablefile.py"
    path.write_text("def f():\n    from .table import load_table\n")
    modules = {"lamport_head.tablefile": path, "lamport_head.table": path}
    assert _graph(modules)["lamport_head.tablefile"] == {"lamport_head.table"}
    # statement by statement: a package import beside a submodule's is still an edge
    path = tmp_path / "x.py"
    path.write_text("from lamport_head import build\nimport lamport_head\n")
    modules = {"lamport_head.x": path, "lamport_head": path, "lamport_head.build": path}
    assert _graph(modules)["lamport_head.x"] == {"lamport_head", "lamport_head.build"}


def test_the_public_names_are_the_contracts():
    """``lamport_head.__all__`` is the list docs/design.md's contract names, and every
    name resolves (lazily) without a GPU or an engine."""
    import lamport_head

    contract = MAP.read_text(encoding="utf-8").split("## 3. The public contract", 1)[1]
    listed = contract.split("Public names", 1)[1].split("It imports lazily", 1)[0]
    names = re.findall(r"`(\w+)`", listed.split("checks the two agree):", 1)[1])
    assert sorted(names) == sorted(lamport_head.__all__)
    assert all(getattr(lamport_head, n) is not None for n in lamport_head.__all__)


def test_every_lazy_name_of_a_package_resolves_to_a_module_that_exists():
    """A package's ``_LAZY`` names (``lamport_head``, ``lamport_head.kernels``) load their
    module only when asked, so no import reads them: each target module must exist (a
    moved module once left ``kernels.DriverLaunch`` pointing at nothing)."""
    for package in ("lamport_head", "lamport_head.kernels"):
        path = _modules()[package]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lazy = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", None) == "_LAZY")
        for value in lazy.values:
            target = ast.literal_eval(value)
            module = target[0] if isinstance(target, tuple) else target
            assert importlib.util.find_spec(f"{package}.{module}") is not None, (package, module)


def test_each_constructor_takes_at_most_nine_parameters():
    """Issue 50 item 3: the seed's six (who the ranks are, the shard, the plan) and a few
    keywords; how a collective is built travels as one value (``Setup``)."""
    import inspect

    from lamport_head.all_to_all import AllToAll
    from lamport_head.head_gather import HeadGather

    for cls in (HeadGather, AllToAll):
        for ctor in (cls.__init__, cls.default):
            names = [n for n in inspect.signature(ctor).parameters if n not in ("self", "cls")]
            assert len(names) <= 9, (cls.__name__, ctor.__name__, names)
            assert names[:6] == ["group", "device", "tp", "rank", "shard_width",
                                 "plan" if ctor.__name__ == "__init__" else "row_counts"]


def test_prose_is_at_most_a_fifth_of_the_runtime_and_the_kernels():
    """Issue 50 item 5: docstrings and comments are at most ``PROSE_LIMIT`` of the
    non-blank lines of ``kernels/`` and ``lamport_head/`` (``tests/prose.py``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from prose import PROSE_LIMIT, share

    for tree in ("kernels", "lamport_head"):
        prose, lines, files = share(ROOT / tree)
        worst = sorted(files, key=lambda f: files[f][0] / max(files[f][1], 1))[-3:]
        assert prose <= PROSE_LIMIT * lines, (tree, prose, lines, worst)
