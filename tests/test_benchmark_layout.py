"""The benchmarks' layout: scripts share helpers through one module, `common`, never each other; and
benchmarks/results/ holds only the files benchmarks/README.md names, each the current result of a script's run.

benchmarks/ holds scripts (each runs one benchmark) and the shared module `common` (the package
benchmarks/common/, its files split by job).
Checked here, from the source alone (ast: nothing is imported, so no torch):

  - no script imports another script: a script imports benchmark code only from `common`;
  - no file of `common` imports a script;
  - so the import graph among benchmark modules has no cycle (checked directly too).

Imports inside functions and `importlib.import_module("name")` calls (gpu_check.py imports its helpers
late) count as imports.

benchmarks/README.md's table under "What `results/` holds" names, per script and run, the files that run
wrote. Every file in benchmarks/results/ must be named there, for a script that exists, and every file named
there must exist: an older rerun left beside the current one fails, as does a name the table keeps after
its file is gone (git keeps the history).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS_HEADING = "## What `results/` holds"


def is_helper(name: str) -> bool:
    return name == "common"


def imported_names(tree: ast.AST) -> set[str]:
    """Top-level module names a module imports anywhere in its body, import_module("...") calls included."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "import_module":
                out.add(node.args[0].value.split(".")[0])
    return out


def import_graph(folder: Path) -> dict[str, set[str]]:
    """Benchmark module -> the benchmark modules it imports."""
    sources = {p.stem: [p] for p in sorted(folder.glob("*.py"))}
    sources["common"] = sorted((folder / "common").glob("*.py"))  # one module, several files
    return {name: set().union(*(imported_names(ast.parse(p.read_text(), filename=str(p))) for p in paths))
            & set(sources) - {name} for name, paths in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of module names (its first and last the same), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def layout_problems(folder: Path) -> list[str]:
    graph = import_graph(folder)
    problems = [f"script {name}.py imports script {other}.py (take shared code from `common`)"
                for name, deps in graph.items() if not is_helper(name) for other in sorted(deps) if not is_helper(other)]
    problems += [f"helper {name}.py imports script {other}.py" for name, deps in graph.items() if is_helper(name)
                 for other in sorted(deps) if not is_helper(other)]
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def test_the_graph_sees_imports() -> None:
    """The checks below are only as good as the graph: it must see the imports the scripts really make."""
    graph = import_graph(BENCHMARKS)
    assert {"common", "floor", "loss_region", "gpu_check"} <= set(graph)
    assert "common" in graph["floor"] and "common" in graph["loss_region"]
    assert "common" in graph["gpu_check"]  # importlib.import_module, inside a function
    assert imported_names(ast.parse("def f():\n    import floor.x\n    from speed import y")) == {"floor", "speed"}


def test_scripts_share_helpers_only_through_common_modules_and_nothing_goes_round() -> None:
    assert layout_problems(BENCHMARKS) == []


def test_find_cycle_finds_one() -> None:
    # a cycle the layout forbids: floor.py importing loss_region.py, which imports floor.py
    assert find_cycle({"floor": {"loss_region", "common"}, "loss_region": {"floor"}, "common": set()}) \
        in (["floor", "loss_region", "floor"], ["loss_region", "floor", "loss_region"])
    assert find_cycle({"a": {"common"}, "b": {"common", "a"}, "common": set()}) is None


def results_named(readme: str) -> dict[str, str]:
    """File in results/ -> the script whose run wrote it, from the README's table under RESULTS_HEADING."""
    assert RESULTS_HEADING in readme, f"benchmarks/README.md has no section {RESULTS_HEADING!r}"
    section = readme.split(RESULTS_HEADING, 1)[1].split("\n## ", 1)[0]
    named: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue  # prose, the header or its rule
        script = cells[0].strip("`")
        for name in re.findall(r"`([^`]+)`", cells[2]):
            assert named.setdefault(name, script) == script, f"{name} named for {named[name]} and {script}"
    return named


def results_problems(folder: Path) -> list[str]:
    named = results_named((folder / "README.md").read_text())
    scripts = {p.name for p in folder.glob("*.py")}
    present = {p.name for p in (folder / "results").iterdir()}
    problems = [f"results/{name}: not named in benchmarks/README.md's table (the current result of no script's run)"
                for name in sorted(present - set(named))]
    problems += [f"results/{name}: named in benchmarks/README.md's table but not in results/"
                 for name in sorted(set(named) - present)]
    problems += [f"results/{name}: named for {script}, which is not a script in benchmarks/"
                 for name, script in sorted(named.items()) if script not in scripts]
    return problems


def test_results_hold_only_the_files_the_readme_names() -> None:
    assert results_named((BENCHMARKS / "README.md").read_text()), "the README's table names no file"
    problems = results_problems(BENCHMARKS)
    assert not problems, "\n".join(problems)


def test_a_stray_or_missing_results_file_is_found(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "floor.py").write_text("")
    (tmp_path / "README.md").write_text(f"{RESULTS_HEADING}\n\n| script | run | files |\n|---|---|---|\n"
                                        "| `floor.py` | `--quick` | `floor_cpu_quick.md`, `floor_cpu_quick.json` |\n"
                                        "| `gone.py` | no options | `gone_cpu.md` |\n\n## Next\n\n| `x.py` | a | `x.md` |\n")
    for name in ("floor_cpu_quick.md", "floor_cpu_quick.json", "gone_cpu.md", "floor_cpu_quick_before.md"):
        (tmp_path / "results" / name).write_text("")
    assert results_problems(tmp_path) == [
        "results/floor_cpu_quick_before.md: not named in benchmarks/README.md's table (the current result of no "
        "script's run)", "results/gone_cpu.md: named for gone.py, which is not a script in benchmarks/"]
    (tmp_path / "results" / "floor_cpu_quick.json").unlink()
    assert "results/floor_cpu_quick.json: named in benchmarks/README.md's table but not in results/" \
        in results_problems(tmp_path)
