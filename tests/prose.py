"""The share of a tree's non-blank lines that are prose: docstrings (any string
statement) and comments. ``python tests/prose.py kernels lamport_head`` prints it per
file and per tree; ``tests/test_layout.py`` holds each tree to ``PROSE_LIMIT``."""

import ast
import io
import pathlib
import sys
import tokenize

PROSE_LIMIT = 0.20


def prose_lines(source: str) -> set:
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    return lines


def share(root) -> tuple:
    """(prose lines, non-blank lines, {file: (prose, non-blank)}) of every .py under root."""
    files = {}
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        source = path.read_text()
        files[str(path)] = (len(prose_lines(source)),
                            sum(1 for line in source.splitlines() if line.strip()))
    return (sum(p for p, _ in files.values()), sum(n for _, n in files.values()), files)


if __name__ == "__main__":
    for root in sys.argv[1:]:
        prose, lines, files = share(root)
        for name, (p, n) in sorted(files.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1)):
            print(f"{100 * p / max(n, 1):5.1f}% {p:4d}/{n:4d} {name}")
        print(f"{root}: {prose}/{lines} = {100 * prose / lines:.1f}% (limit {100 * PROSE_LIMIT:.0f}%)")
