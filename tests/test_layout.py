"""The package's layout, as README.md's stage table states it: one folder per stage, every module in the
folder the table names, and a module imports only modules of its own stage or earlier ones (data flows one
way). The passes are a library every stage may call; they import only precision's call helpers, the naming
of values recomputed twice and the private-torch module. Imports under `TYPE_CHECKING` count as imports: a
type hint that names a later stage, or closes a cycle, ties the modules together as much as a run-time import.
Also: no import cycles, and private torch only in `torch_internals/`.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoremat"
USED_BY_EVERY_STAGE = {"measure", "units", "switches", "torch_internals"}  # README: "used by every stage"
NOT_A_STAGE = {"__init__", "__main__"}  # the lazy public namespace and `python -m autoremat`
PASSES_MAY_IMPORT = {"torch_internals"}  # README: the passes import no stage


def _table() -> dict[str, tuple[int, str]]:
    """{module: (position of its stage, its folder)} from README's "| stage | folder | modules | job |" table.
    Modules are named as dotted paths under the package: `solve.ilp`, `api` (a face, at the top)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| stage | folder | modules | job |")
    table: dict[str, tuple[int, str]] = {}
    for position, line in enumerate(lines[start + 2:]):
        if not line.startswith("|"):
            break
        _, _, folder_cell, modules_cell, *_ = line.split("|")
        folder = folder_cell.strip().strip("`").rstrip("/")
        prefix = "" if folder == "autoremat" else folder + "."
        for path in re.findall(r"`([\w/]+)\.py`", modules_cell):  # `sub/name.py`: a module of a subpackage
            name = path.replace("/", ".").removesuffix(".__init__")
            assert prefix + name not in table, f"{prefix}{name} is listed twice"
            table[prefix + name] = (position, folder)
    return table


def _module(path: Path) -> str:
    """The dotted name of a module under the package; a folder's `__init__` is the folder, and a shared
    package (torch_internals/) is one module whatever file of it."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[0] in USED_BY_EVERY_STAGE:
        return parts[0]
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports(path: Path, type_hints: bool = True) -> list[tuple[str, int]]:
    """The autoremat modules `path` imports: (dotted module under the package, line). With `type_hints=False`,
    only those it imports at run time (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    hints = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
             for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in hints and not type_hints:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name.split(".", 1)[1], node.lineno) for a in node.names if a.name.startswith("autoremat.")]
        if not isinstance(node, ast.ImportFrom) or not node.module or node.module.split(".")[0] != "autoremat":
            continue
        under = node.module.split(".")[1:]
        for alias in node.names:  # `from autoremat.solve import ilp` imports the module solve.ilp
            as_module = PACKAGE.joinpath(*under, alias.name)
            if as_module.with_suffix(".py").exists() or (as_module / "__init__.py").exists():
                found.append((".".join([*under, alias.name]), node.lineno))
            elif under:
                found.append((".".join(under), node.lineno))
    return [(t.split(".")[0] if t.split(".")[0] in USED_BY_EVERY_STAGE else t, line) for t, line in found]


def _stage_of(module: str, table: dict) -> int | None:
    """A module's stage position; None for the shared modules and the passes' library."""
    if module in USED_BY_EVERY_STAGE or module.split(".")[0] == "passes":
        return None
    return table[module][0] if module in table else table[module.split(".")[0]][0]


def _modules() -> list[tuple[str, Path]]:
    return [(_module(p), p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_is_in_the_folder_the_readme_table_names():
    table = _table()
    folders = {folder for _, folder in table.values()} - {"autoremat"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - USED_BY_EVERY_STAGE
    assert folders == packages, "one folder per stage"
    listed = set(table)
    on_disk = {m for m, _ in _modules() if m not in NOT_A_STAGE | USED_BY_EVERY_STAGE and m not in folders}
    assert on_disk - listed == set(), "modules missing from README's stage table"
    assert listed - on_disk == set(), "README's stage table names modules that are not where it says"


def _later_imports(modules: list[tuple[str, Path]], table: dict[str, tuple[int, str]]) -> list[str]:
    """Each import of `modules` (type hints included) that reaches a later stage, or that the passes or the
    shared modules may not make."""
    stage_rank = {folder: rank for rank, folder in table.values()}
    later = []
    for me, path in modules:
        if me in NOT_A_STAGE:
            continue
        mine = None if me in USED_BY_EVERY_STAGE else (stage_rank[me] if me in stage_rank else _stage_of(me, table))
        for target, line in _imports(path):
            if target in NOT_A_STAGE or target == me:
                continue
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line} imports {target}"
            if me.split(".")[0] == "passes":
                if target.split(".")[0] != "passes" and target not in PASSES_MAY_IMPORT:
                    later.append(f"{where} (the passes may not)")
            elif me in USED_BY_EVERY_STAGE:
                if target not in USED_BY_EVERY_STAGE:
                    later.append(f"{where} (a shared module imports no stage)")
            else:
                theirs = stage_rank[target] if target in stage_rank else _stage_of(target, table)
                if theirs is not None and theirs > mine:
                    later.append(f"{where}, a later stage")
    return later


def test_no_module_imports_a_later_stage():
    assert _later_imports(_modules(), _table()) == []


def _cycle(modules: dict[str, Path]) -> list[str]:
    """The first import cycle among `modules` (type hints included), as [m, ..., m]; [] when there is none."""
    graph = {m: {t for t, _ in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    done: set[str] = set()
    path: list[str] = []

    def visit(m: str) -> list[str]:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return []
        path.append(m)
        for t in sorted(graph[m]):
            found = visit(t)
            if found:
                return found
        path.pop()
        done.add(m)
        return []

    for m in sorted(graph):
        found = visit(m)
        if found:
            return found
    return []


def test_no_import_cycles():
    """Imports between modules, type hints included, form no cycle (a folder's `__init__` counts as a module)."""
    cycle = _cycle(dict(_modules()))  # torch_internals/: its files import one another, not the package
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def _hinted_source(tmp_path: Path, name: str, hint: str) -> Path:
    """A module that imports `hint` under `if TYPE_CHECKING:` only."""
    source = tmp_path / f"{name}.py"
    source.write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autoremat.{hint} import X\n")
    return source


def test_the_check_sees_a_later_import(tmp_path):
    """The import reader finds imports of every form, type hints too, and can tell the two apart."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom autoremat.planning.plan import Plan\n"
                      "from autoremat.solve import ilp\nimport autoremat.model.memory as memory\nfrom autoremat import api\n"
                      "if TYPE_CHECKING:\n    from autoremat.cli import main\n")
    run_time = [("planning.plan", 2), ("solve.ilp", 3), ("model.memory", 4), ("api", 5)]
    assert _imports(source, type_hints=False) == run_time
    assert _imports(source) == [*run_time, ("cli", 7)]


def test_the_check_sees_a_later_stage_named_in_a_type_hint(tmp_path):
    """A type hint that names a later stage is reported, as a run-time import would be; so is a pass's."""
    table = _table()
    model = _hinted_source(tmp_path, "memory", "planning.plan")
    passes = _hinted_source(tmp_path, "remat", "model.memory")
    assert _later_imports([("model.memory", model), ("passes.remat", passes)], table) == [
        "memory.py:3 imports planning.plan, a later stage", "remat.py:3 imports model.memory (the passes may not)"]


def test_the_check_sees_a_cycle_closed_by_a_type_hint(tmp_path):
    """Two modules that import each other, one of them under `TYPE_CHECKING` only, form a cycle."""
    first = tmp_path / "first.py"
    first.write_text("from autoremat.model.second import Y\n")
    second = _hinted_source(tmp_path, "second", "model.first")
    assert _cycle({"model.first": first, "model.second": second}) == ["model.first", "model.second", "model.first"]
    alone = tmp_path / "alone.py"
    alone.write_text("from typing import TYPE_CHECKING\n")
    assert _cycle({"model.first": first, "model.second": alone}) == []


def _private_torch_uses(path: Path) -> list[str]:
    """Where `path` reaches a private torch name: an import from a `_`-module of torch, or `torch._x`."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")):
                uses.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            uses += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                     if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
              and node.attr.startswith("_") and not node.attr.startswith("__")):
            uses.append(f"{path.name}:{node.lineno} torch.{node.attr}")
    return uses


def test_private_torch_is_reached_only_through_torch_internals():
    """One module holds every private torch API, so a torch release that moves one breaks one file."""
    uses = [u for path in sorted(PACKAGE.rglob("*.py")) if "torch_internals" not in path.relative_to(PACKAGE).parts
            for u in _private_torch_uses(path)]
    assert uses == []


def test_the_private_torch_check_sees_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch\nimport torch._dynamo\nfrom torch._ops import OpOverload\n"
                      "x = torch._guards.detect_fake_mode\ny = torch.__version__\nz = torch.ops.aten._to_copy\n")
    assert _private_torch_uses(source) == ["m.py:2 import torch._dynamo", "m.py:3 from torch._ops",
                                           "m.py:4 torch._guards"]


# The budget's way from the face to the ILP row (docs/architecture.md): (module, function, the callee it
# calls, the parameter the callee takes it as, the name the caller passes). `budget` is the step's bytes
# down to plan_graphs, which asks Ledger.room for the activations' share, `room` from there on;
# `_solve_model` passes `target`, the room it asks of the model this round (calibrated by the simulator).
BUDGET_PATH = [
    ("api", "optimize", "plan_step", "budget", "budget"),
    ("planning/precision_auto", "plan_step", "plan_with_dtypes", "budget", "budget"),
    ("planning/pipeline", "plan_with_dtypes", "build", "budget", "budget"),
    ("planning/pipeline", "build", "plan_graphs", "budget", "budget"),
    ("planning/budget", "plan_graphs", "solve", "room", "room"),
    ("solve/solver", "solve", "_solve_model", "room", "room"),
    ("solve/solver", "_solve_model", "solve", "room", "target"),
]
CALLEES = {"plan_step": ("planning/precision_auto", "plan_step"),
           "plan_with_dtypes": ("planning/pipeline", "plan_with_dtypes"), "build": ("planning/pipeline", "build"),
           "plan_graphs": ("planning/budget", "plan_graphs"), "_solve_model": ("solve/solver", "_solve_model")}


def _function(module: str, name: str, in_class: str | None = None) -> ast.FunctionDef:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    scope = tree.body
    if in_class is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == in_class).body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def _passes(caller: ast.FunctionDef, callee: str, name: str, position: int) -> bool:
    """Whether `caller` (nested functions included) calls `callee` with the variable `name` at `position`."""
    for node in ast.walk(caller):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called != callee:
            continue
        given = node.args[position] if len(node.args) > position else None
        if isinstance(given, ast.Name) and given.id == name:
            return True
    return False


def test_the_budget_reaches_the_ilp_row_in_seven_calls():
    """Each link of the path exists as a direct call that passes the value under its one name, so the
    budget takes at most these seven calls from `optimize` to the row, and is named `budget` or `room`."""
    solve_fn = _function("solve/solver", "solve")
    ilp_solve = _function("solve/ilp", "solve", in_class="IlpModel")
    for module, name, callee, param, passed in BUDGET_PATH:
        caller = _function(module, name)
        if callee == "solve" and module == "solve/solver":
            target = ilp_solve
        elif callee == "solve":
            target = solve_fn
        else:
            target = _function(*CALLEES[callee])
        params = [a.arg for a in target.args.args if a.arg != "self"]
        position = params.index(param)
        assert _passes(caller, callee, passed, position), f"{module}.{name} no longer passes {passed} to {callee}"
    # The last hop: the room bounds `cap`, the right-hand side of every memory row (IlpModel._capacity).
    assert "self.cap.lowBound, self.cap.upBound = (0, None) if min_peak else (room, room)" in ast.unparse(ilp_solve)
    assert len(BUDGET_PATH) <= 7


def test_the_budget_is_parsed_only_by_the_faces():
    """parse_budget turns "20GB" into bytes in the faces; a stage below them takes an int only."""
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "parse_budget" in ast.unparse(node.func):
                callers.add(_module(path))
    assert callers <= {"api", "fit", "backend", "cli", "lightning"}, callers
