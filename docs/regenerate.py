"""Run the commands that README.md and docs/*.md show, and write their real output into the page.

A marked block is one or more `run` comments (invisible when the Markdown is rendered) directly
above a fenced block:

    <!-- run: autoremat ledger --params 7B -->
    <!-- run: autoremat plan examples/models.py:mlp --budget 8MB -->
    ```
    $ autoremat ledger --params 7B
    (its stdout and stderr, as one stream)
    [exit 0]
    $ autoremat plan examples/models.py:mlp --budget 8MB
    ...
    ```

Each command runs from the repository root with `bash`, `autoremat` meaning this checkout's
`python -m autoremat` and `python` this interpreter; the block becomes `$ command`, its output and
`[exit N]`, for each command in turn. `<!-- run: python -->` instead runs the ```python block right
below it as a script (in a fresh folder, this checkout on PYTHONPATH) and writes its output into
the next fenced block after the script (a line of prose may sit between them). Options go between `run` and the colon:

- `slow`: takes minutes; `--fast` skips it and tests/test_docs.py does not diff it (the test checks
  that such a command parses, or runs it small);
- `head N`: show only the first N lines of the output, then `...`.

Python warnings are off (PYTHONWARNINGS=ignore) and torch's C++ warning lines (`[W...]`, stamped
with the time) are left out, so a page shows what the command prints for its own part.

    python docs/regenerate.py                 # every block (the slow ones take about 10 minutes)
    python docs/regenerate.py --fast          # only the fast ones
    python docs/regenerate.py --check         # exit 1, with a diff, if a fast block's output changed
    python docs/regenerate.py docs/cli.md     # one page
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- run(?P<opts>[^:]*): (?P<command>.*) -->$")
FENCE = re.compile(r"^(`{3,})")
TIMEOUT_S = 900


@dataclass
class Block:
    """Commands (or one Python script) and the fenced output block they write."""

    page: Path
    line: int  # 1-based line of the first mark
    commands: list[str]
    slow: bool = False
    head: int | None = None
    script: str | None = None  # the ```python block's code, for `run: python`
    out_start: int = 0  # 0-based index of the output block's opening fence
    out_end: int = 0  # ... and of its closing fence
    shown: list[str] = field(default_factory=list)  # the output lines now in the page

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _fenced(lines: list[str], start: int, page: Path, prose: bool = False) -> tuple[int, int]:
    """(opening, closing) indices of the fenced block that opens at `start`, after blank lines (or,
    with `prose`, after any text that is not a fence)."""
    i = start
    while i < len(lines) and (not lines[i].strip() or (prose and not FENCE.match(lines[i]))):
        i += 1
    m = FENCE.match(lines[i]) if i < len(lines) else None
    if m is None:
        raise ValueError(f"{page}:{start + 1}: a run mark must sit right above a fenced block")
    for j in range(i + 1, len(lines)):
        if lines[j].startswith(m.group(1)) and not lines[j].strip("`"):
            return i, j
    raise ValueError(f"{page}:{i + 1}: fenced block never closed")


def find_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if m is None:
            i += 1
            continue
        opts = m.group("opts").replace(",", " ").split()
        block = Block(page, i + 1, [], slow="slow" in opts)
        if "head" in opts:
            block.head = int(opts[opts.index("head") + 1])
        first = m.group("opts")
        while i < len(lines) and (m := MARK.match(lines[i])):
            if m.group("opts") != first:
                raise ValueError(f"{page}:{i + 1}: the marks of one block share their options ({first!r}); "
                                 "a mark with other options needs a block of its own")
            block.commands.append(m.group("command"))
            i += 1
        if block.commands == ["python"]:
            start, end = _fenced(lines, i, page)
            block.script = "\n".join(lines[start + 1:end]) + "\n"
            i = end + 1
        block.out_start, block.out_end = _fenced(lines, i, page, prose=block.script is not None)
        block.shown = lines[block.out_start + 1:block.out_end]
        blocks.append(block)
        i = block.out_end + 1
    return blocks


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               COLUMNS="120", TERM="dumb")
    return env


def _clean(text: str, head: int | None) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines() if not re.match(r"^\[W\d{4} ", line)]
    if head is not None and len(lines) > head:
        lines = [*lines[:head], "..."]
    return lines


def run_block(block: Block) -> list[str]:
    """The block's output lines, from running its commands now."""
    Path("/tmp/docrun/cli").mkdir(parents=True, exist_ok=True)  # where the pages' commands write files
    if block.script is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "snippet.py"
            path.write_text(block.script)
            proc = subprocess.run([sys.executable, str(path)], cwd=tmp, env=_env(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        return _clean(proc.stdout, block.head)
    out: list[str] = []
    python = f"'{sys.executable}'"
    for command in block.commands:
        real = re.sub(r"^autoremat\b", f"{python} -m autoremat", command)
        real = re.sub(r"^python\b", python, real)
        proc = subprocess.run(["bash", "-c", real], cwd=ROOT, env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        out += [f"$ {command}", *_clean(proc.stdout, block.head), f"[exit {proc.returncode}]"]
    return out


def normalize(lines: list[str]) -> list[str]:
    """What must not change between runs: progress lines (they appear only past a time) and
    measured durations are taken out."""
    keep = []
    for line in lines:
        if re.match(r"^autoremat: .*\.\.\.( \(\d+(\.\d+)? s\))?$", line) or \
                re.match(r"^autoremat: planned \(\d+(\.\d+)? s\)$", line):
            continue
        line = re.sub(r"\d+(\.\d+)? s\b", "<t> s", line)
        line = re.sub(r"[\d,]+ tok/s", "<n> tok/s", line)
        keep.append(line)
    return keep


def rewrite(page: Path, outputs: dict[int, list[str]]) -> None:
    """Replace the output blocks (keyed by their opening fence's index) with new lines."""
    lines = page.read_text().splitlines()
    for block in sorted(find_blocks(page), key=lambda b: -b.out_start):
        if block.out_start in outputs:
            lines[block.out_start + 1:block.out_end] = outputs[block.out_start]
    page.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pages", nargs="*", type=Path, help="pages to regenerate (default: README.md and docs/*.md)")
    p.add_argument("--fast", action="store_true", help="skip blocks marked slow")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a fast block's output differs")
    args = p.parse_args(argv)
    failed = False
    for page in [path.resolve() for path in args.pages] or PAGES:
        outputs = {}
        for block in find_blocks(page):
            if block.slow and (args.fast or args.check):
                continue
            print(f"{block.name}: {' ; '.join(block.commands)}", file=sys.stderr, flush=True)
            new = run_block(block)
            if args.check:
                if normalize(new) != normalize(block.shown):
                    failed = True
                    sys.stdout.writelines(difflib.unified_diff(
                        [line + "\n" for line in normalize(block.shown)], [line + "\n" for line in normalize(new)],
                        f"{block.name} (in the page)", f"{block.name} (run now)"))
            else:
                outputs[block.out_start] = new
        if outputs:
            rewrite(page, outputs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
