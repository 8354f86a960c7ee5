"""Write the benchmark figures quoted in README.md, benchmarks/README.md and docs/fit.md from benchmarks/results/.

A quoted section sits between two comments, and everything between them is this script's:

    <!-- report: floor results/floor_cpu.json -->
    (generated)
    <!-- /report -->

Kinds (paths relative to benchmarks/):

- `floor FILE.json`: per model, autoremat's smallest budget against checkpointing every block, and
  its prediction against the measurement there (`floor.py`'s results);
- `grad-error FILE.json`: the range of gradient errors per method (`remat_vs_peers.py`'s results);
- `table FILE.md [N]`: the N-th (default 1st) Markdown table of a result file, verbatim, with the
  file's `Command:` line;
- `goal FILE.md`: the file's `Goal check` line and the list under it, verbatim.

    python benchmarks/report.py            # rewrite the sections
    python benchmarks/report.py --check    # exit 1, with a diff, if a section differs from the results
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGES = [ROOT / "README.md", HERE / "README.md", ROOT / "docs" / "fit.md"]
OPEN = re.compile(r"^<!-- report: (?P<kind>[\w-]+) (?P<args>.+?) -->$")
CLOSE = "<!-- /report -->"
MIB = 2**20


def _commit(meta: dict) -> str:
    git = meta.get("git") or {}
    return git.get("head") or meta.get("repo_git") or "?"


def _err(row: dict) -> float | None:
    """A row's gradient error: over all parameters together, or in results written before that field, the
    largest per-parameter error (which a parameter whose true gradient is zero can inflate to O(1))."""
    return row.get("grad_rel_err", row.get("max_grad_rel_err"))


def _err_label(rows: list[dict]) -> str:
    return "max gradient error" if any("max_grad_rel_err" in r for r in rows) else "gradient error"


def floor(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = [
        "| model | autoremat's smallest budget (MiB) | measured there (MiB) | checkpoint every block (MiB) "
        "| smallest budget / checkpoint | predicted / measured | step time at checkpoint's peak / checkpoint's "
        f"| {_err_label(data['rows'])} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, goals in data["goals"].items():
        rows = [r for r in data["rows"] if r["model"] == model]
        # the floor row, or its retry at the budget that planning-time verification asked for
        ours = next(r for r in rows if r["method"] == "autoremat" and r["setting"].startswith("floor")
                    and r["status"] == "ok")
        ckpt = next(r for r in rows if r["method"] == "checkpoint")
        t = goals.get("time", {})
        at = f"{t['ratio']:.2f} ± {t['noise']:.2f}" if "ratio" in t else t.get("why", "")
        lines.append(f"| {model} | {ours['budget'] / MIB:.2f} | {ours['steady_peak'] / MIB:.2f} | "
                     f"{ckpt['steady_peak'] / MIB:.2f} | {goals['floor']['ratio']:.3f} | "
                     f"{ours['predicted_vs_measured']:.3f} | {at} | {_err(ours):.1e} |")
    lines += ["", f"From `benchmarks/{path.relative_to(HERE)}` (`{meta['command']}`, {meta['date'][:16]}, "
                  f"commit {_commit(meta)}, torch {meta['torch']}, {meta['threads']} thread; the machine shared)."]
    return lines


def grad_error(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    by: dict[str, list[float]] = {}
    for r in data["rows"]:
        err = _err(r)
        if err is None:
            continue
        label = r["method"] if r["method"] != "pt-budget" else (
            "activation_memory_budget = 1" if r["setting"] == "amb=1.0" else "activation_memory_budget < 1")
        by.setdefault(label, []).append(err)
    meta = data["meta"]
    parts = [f"{label}: {min(v):.1e} to {max(v):.1e}" if min(v) != max(v) else f"{label}: {v[0]:.1e}"
             for label, v in by.items()]
    what = ("Largest relative gradient error against eager, over parameters" if _err_label(data["rows"]).startswith(
        "max") else "Relative gradient error against eager, all parameters together")
    return [f"{what} (dropout on): {'; '.join(parts)} "
            f"(`benchmarks/{path.relative_to(HERE)}`, `{meta['command']}`, {meta['date'][:16]}, commit "
            f"{_commit(meta)})."]


def _tables(text: list[str]) -> list[list[str]]:
    tables, current = [], []
    for line in text:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def table(path: Path, n: str = "1") -> list[str]:
    text = path.read_text().splitlines()
    command = [line for line in text if line.startswith("Command:")][:1]
    return [*command, *([""] if command else []), *_tables(text)[int(n) - 1],
            "", f"(`benchmarks/{path.relative_to(HERE)}`)"]


def goal(path: Path) -> list[str]:
    text = path.read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("Goal check"))
    end = start + 1
    while end < len(text) and text[end].startswith("- "):
        end += 1
    return text[start:end]


KINDS = {"floor": floor, "grad-error": grad_error, "table": table, "goal": goal}


def render(page: Path) -> list[str]:
    """The page with every section written from its result file."""
    lines = page.read_text().splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        if m.group("kind") not in KINDS:
            raise ValueError(f"{page}:{i + 1}: unknown report kind {m.group('kind')!r}; known: {', '.join(KINDS)}")
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == CLOSE), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: no {CLOSE} after this section")
        name, *rest = m.group("args").split()
        out += KINDS[m.group("kind")](HERE / name, *rest)
        out.append(CLOSE)
        i = end + 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a section differs")
    args = p.parse_args(argv)
    stale = False
    for page in PAGES:
        now = page.read_text().splitlines()
        new = render(page)
        if new == now:
            continue
        if args.check:
            stale = True
            sys.stdout.writelines(difflib.unified_diff([x + "\n" for x in now], [x + "\n" for x in new],
                                                       f"{page.name} (now)", f"{page.name} (from results)"))
        else:
            page.write_text("\n".join(new) + "\n")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
