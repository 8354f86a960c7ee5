"""The package's layout, as README.md's stage table states it: every module sits in one stage, and a
module imports only modules of its own stage or earlier ones (data flows one way). The passes are a
library every stage may call; they import only precision's call helpers, the naming of values
recomputed twice and the private-torch module. Imports under `TYPE_CHECKING` are type hints only.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoremat"
USED_BY_EVERY_STAGE = {"measure", "units", "torch_internals"}  # README: "used by every stage"
NOT_A_STAGE = {"__init__", "__main__"}  # the lazy public namespace and `python -m autoremat`
PASSES_MAY_IMPORT = {"precision_measure", "cuts", "torch_internals", "passes"}


def _stages() -> dict[str, int]:
    """{module: position of its stage} from the table under README's "| stage | module | job |"."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| stage | module | job |")
    rank: dict[str, int] = {}
    for position, line in enumerate(lines[start + 2:]):
        if not line.startswith("|"):
            break
        modules_cell = line.split("|")[2]
        for name in re.findall(r"`([\w/]+?)(?:\.py|/)?`", modules_cell):
            assert name not in rank, f"{name} is listed in two stages"
            rank[name] = position
    return rank


def _module(path: Path) -> str:
    first = path.relative_to(PACKAGE).with_suffix("").parts[0]
    return first


def _imports(path: Path) -> list[tuple[str, int]]:
    """The autoremat modules `path` imports at run time: (module, line)."""
    tree = ast.parse(path.read_text())
    hints = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
             for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in hints or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        parts = node.module.split(".")
        if parts[0] != "autoremat":
            continue
        targets = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
        found += [(t, node.lineno) for t in targets]
    return found


def test_every_module_is_in_one_stage_of_the_readme_table():
    rank = _stages()
    modules = {_module(p) for p in PACKAGE.rglob("*.py")} - NOT_A_STAGE - USED_BY_EVERY_STAGE
    assert modules - rank.keys() == set(), "modules missing from README's stage table"
    assert rank.keys() - modules == set(), "README's stage table names modules that do not exist"


def test_no_module_imports_a_later_stage():
    rank = _stages()
    later = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module(path)
        if me in NOT_A_STAGE or me in USED_BY_EVERY_STAGE:
            continue
        for target, line in _imports(path):
            if me == "passes":
                if target not in PASSES_MAY_IMPORT:
                    later.append(f"{path.relative_to(ROOT)}:{line} imports {target} (passes may not)")
            elif target not in USED_BY_EVERY_STAGE and target != "passes" and rank[target] > rank[me]:
                later.append(f"{path.relative_to(ROOT)}:{line} imports {target}, a later stage")
    assert later == []


def test_the_check_sees_a_later_import(tmp_path):
    """The import reader finds run-time imports of every form and skips type hints."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom autoremat.plan import Plan\nfrom autoremat import api\n"
                      "if TYPE_CHECKING:\n    from autoremat.cli import main\n")
    assert _imports(source) == [("plan", 2), ("api", 3)]


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
    uses = [u for path in sorted(PACKAGE.rglob("*.py")) if path.name != "torch_internals.py"
            for u in _private_torch_uses(path)]
    assert uses == []


def test_the_private_torch_check_sees_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch\nimport torch._dynamo\nfrom torch._ops import OpOverload\n"
                      "x = torch._guards.detect_fake_mode\ny = torch.__version__\nz = torch.ops.aten._to_copy\n")
    assert _private_torch_uses(source) == ["m.py:2 import torch._dynamo", "m.py:3 from torch._ops",
                                           "m.py:4 torch._guards"]
