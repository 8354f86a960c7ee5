"""The pages cannot drift from what the code does.

What runs here, and what does not:
- every block marked `<!-- run: ... -->` (not `slow`) in README.md and docs/*.md is run again and its
  output compared with the page's, durations and progress lines masked (`docs/regenerate.py`);
- blocks marked `slow` (minutes each: GPT-2 small's shape, the main training job) are NOT run to
  completion here: each of their `autoremat` commands is parsed by the CLI's own parser, each
  `python examples/...` script answers `--help`, a `torchrun` script compiles, and the main job runs
  end to end at a small size;
- every `autoremat` command line shown anywhere in the pages is one that a run mark makes, or the
  usage synopsis of docs/cli.md;
- the DDP script docs/distributed.md shows is examples/train_ddp.py, character for character;
- the benchmark figures in README.md and benchmarks/README.md are those `benchmarks/report.py`
  writes from benchmarks/results/ (the benchmarks themselves are not run: they take many minutes).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from autoremat import cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import regenerate  # noqa: E402
import report  # noqa: E402

BLOCKS = [b for page in regenerate.PAGES for b in regenerate.find_blocks(page)]
FAST = [b for b in BLOCKS if not b.slow]
SLOW = [b for b in BLOCKS if b.slow]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_the_pages_have_marked_blocks_of_both_kinds() -> None:
    pages = {b.page.name for b in BLOCKS}
    assert {"README.md", "cli.md", "python-api.md", "index.md"} <= pages
    assert len(FAST) >= 5 and len(SLOW) >= 4


@pytest.mark.parametrize("block", FAST, ids=[b.name for b in FAST])
def test_a_fast_block_shows_what_its_commands_print(block: regenerate.Block) -> None:
    now = regenerate.normalize(regenerate.run_block(block))
    shown = regenerate.normalize(block.shown)
    assert now == shown, f"{block.name} drifted: run `python docs/regenerate.py {block.page.relative_to(ROOT)}`"


def test_a_slow_block_parses() -> None:
    parser = cli.make_parser()
    helped = set()
    for block in SLOW:
        for command in block.commands:
            words = shlex.split(command)
            if words[0] == "autoremat":
                args = parser.parse_args(words[1:])
                assert args.run is not None
            elif words[0] == "python" and words[1].startswith("examples/"):
                if words[1] in helped:
                    continue
                helped.add(words[1])
                proc = subprocess.run([sys.executable, words[1], "--help"], cwd=ROOT, env=ENV, capture_output=True,
                                      text=True, timeout=120)
                assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr[-2000:]
            elif "torchrun" in words:
                script = ROOT / words[-1]  # the ranks run it; here it must exist and compile
                compile(script.read_text(), str(script), "exec")
            else:
                pytest.fail(f"{block.name}: no cheap check for {command!r}")


@pytest.mark.slow
def test_the_main_job_runs_small() -> None:
    """README's first command (`python examples/train_gpt.py`), at a small size: it plans a step that
    recomputes, trains, and prints the predicted and measured peaks against the budget. (At this size
    half of the no-recompute step is below the smallest budget that fits, hence 0.7.)"""
    proc = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--steps", "4", "--eval-every", "2", "--n-layer", "2", "--d", "64",
         "--seq", "64", "--batch", "8", "--corpus-mb", "0.3", "--budget-fraction", "0.7", "--no-progress",
         "--compiler", "eager"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    overhead = float(re.search(r"predicted recompute overhead ([\d.]+)%", out).group(1))
    assert overhead > 0, out
    for line in ("predicted by autoremat", "measured, autoremat (step 2)"):
        assert re.search(rf"{re.escape(line)} .* within the budget", out), out
    assert "measured, without autoremat" in out and "step    4: train loss" in out


def test_every_cli_command_shown_is_run_by_a_mark() -> None:
    marked = {c for b in BLOCKS for c in b.commands}
    unmarked = []
    for page in regenerate.PAGES:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if regenerate.FENCE.match(line):
                inside = not inside
                continue
            command = line[2:] if line.startswith("$ ") else line
            if inside and re.match(r"autoremat (plan|show|ledger)\b(?!:)", command) and command not in marked:
                unmarked.append(f"{page.name}:{number}: {command}")
    # the usage synopsis names arguments in capitals (TARGET, BYTES, COUNT): it is not a command
    unmarked = [u for u in unmarked if not re.search(r"\b(TARGET|PLAN\.json|COUNT)\b", u)]
    assert not unmarked, unmarked


def test_the_ddp_page_shows_the_script_as_it_is() -> None:
    page = (ROOT / "docs" / "distributed.md").read_text()
    script = (ROOT / "examples" / "train_ddp.py").read_text()
    assert f"```python\n{script}```" in page


def test_benchmark_figures_come_from_the_results() -> None:
    for page in report.PAGES:
        assert report.render(page) == page.read_text().splitlines(), (
            f"{page}: run `python benchmarks/report.py`")
    assert "<!-- report: floor" in (ROOT / "README.md").read_text()


def test_a_drifted_block_is_caught(tmp_path: Path) -> None:
    """The check can fail: a page whose shown output was edited by hand differs from the run."""
    page = tmp_path / "page.md"
    page.write_text("<!-- run: autoremat ledger --params 1B -->\n```\n$ autoremat ledger --params 1B\n"
                    "1,000,000,000 parameters, fp32, adamw: fixed memory of one training step\n[exit 0]\n```\n")
    (block,) = regenerate.find_blocks(page)
    assert regenerate.normalize(regenerate.run_block(block)) != regenerate.normalize(block.shown)
