"""The planning stage's modules import one another one way: no cycle, counting the imports made only for type
hints (`if TYPE_CHECKING:`) too. tests/test_layout.py checks run-time imports across the whole package; here a
type a module shares with others lives in a module of its own rather than in one that imports them."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNING = Path(__file__).resolve().parents[1] / "autoremat" / "planning"


def _modules(root: Path) -> dict[str, Path]:
    """{dotted name under the planning folder: file}; a subpackage's `__init__` is the subpackage."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The planning modules `path` imports anywhere in it, `if TYPE_CHECKING:` blocks and functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoremat.planning"):
            under = node.module.removeprefix("autoremat.planning").lstrip(".")
            if under in modules:
                found.add(under)
            found |= {f"{under}.{a.name}".lstrip(".") for a in node.names if f"{under}.{a.name}".lstrip(".") in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("autoremat.planning.") for a in node.names
                      if a.name.removeprefix("autoremat.planning.") in modules}
    return found


def import_cycles(root: Path = PLANNING) -> list[list[str]]:
    """Each cycle of imports among the modules under `root`, as the path around it (empty: none)."""
    modules = _modules(root)
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    cycles, done, path = [], set(), []

    def visit(m: str) -> None:
        if m in path:
            cycles.append(path[path.index(m):] + [m])
            return
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    return cycles


def test_planning_has_no_import_cycle_type_hints_included():
    assert import_cycles() == []


def test_the_check_sees_a_cycle_through_a_type_hint(tmp_path):
    (tmp_path / "a.py").write_text("from autoremat.planning.b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from autoremat.planning import a\n")
    (tmp_path / "c.py").write_text("from autoremat.planning.a import A\n")
    assert import_cycles(tmp_path) == [["a", "b", "a"]]
