"""Steps with eager code between or after their graphs, planned at the floor the floor query names.

What autograd saves for eager code before a graph is counted in the ledger from the planning trace
("saved by eager code"); what eager code after the last graph saves is left to the real step's verification.
For three models, in one process: the floor query (budget=1), then a plan at that floor and at 1.05 x it,
each verified on a real step: planned or refused, re-planned or not, predicted against measured activations,
and the seconds each took.

  gated   tests.models.HeadLM with its eager gate between the trunk and the vocabulary head (plan_time --cliff)
  around  six residual MLP blocks in two graphs, the eager gate between them and the loss computed eagerly
  gpt2    a 2-layer GPT-2 from config whose cross-entropy is computed eagerly on the logits

    PYTHONPATH=.:benchmarks python benchmarks/eager_code.py --out eager_code_cpu

Results: benchmarks/results/<out>.{md,json}. Runs at any commit (it uses only the public API and
tests/models.py), so that a commit before the ledger counted eager code can be run side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoremat
from autoremat.model.ledger import Ledger
from tests.models import HeadLM, eager_gate

RESULTS = Path(__file__).resolve().parent / "results"


@torch._dynamo.disable
def _eager_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@torch._dynamo.disable
def _eager_mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean()


class Around(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        x = x + b[1](x + b[0](x))
        x = eager_gate(x)
        return _eager_mean_square(x + b[3](x + b[2](x)))


class EagerLossGPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1024, n_positions=64,
                                             use_cache=False, eos_token_id=None, bos_token_id=None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _eager_cross_entropy(self.lm(input_ids=ids).logits, ids)


def models() -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, 2048, (4, 64))
    gated = (HeadLM(2048, 32, bias=False, gate=True), {"ids": ids, "labels": ids}, None)
    around = (Around(), (torch.randn(32, 16, 64),), "adamw")
    gpt_ids = torch.randint(0, 1024, (2, 64))
    return {"gated": gated, "around": around, "gpt2": (EagerLossGPT2(), (gpt_ids,), None)}


def plan_at(model, inputs, optimizer, budget: int) -> dict:
    t0 = time.perf_counter()
    try:
        om = autoremat.optimize(model, budget, inputs, optimizer=optimizer, compiler="eager", progress=False)
    except autoremat.BudgetError as e:
        return {"budget": budget, "s": time.perf_counter() - t0, "result": "refused",
                "measured_refusal": bool(getattr(e, "measured", False)), "smallest_budget": e.smallest_budget}
    seconds = time.perf_counter() - t0
    notes = om.plan.notes
    verified = [n for n in notes if n.startswith("verified on one real step")]
    predicted = measured = None
    if verified:  # "... measured activation peak M B, predicted P B"
        words = verified[0].replace(",", "").split()
        measured, predicted = int(words[words.index("peak") + 1]), int(words[words.index("predicted") + 1])
    return {"budget": budget, "s": seconds, "result": "planned", "replanned": any(n.startswith("re-planned") for n in notes),
            "eager_saved": getattr(Ledger.from_dict(om.plan.ledger), "eager_saved", None),
            "first_predicted": predicted, "first_measured": measured}


def one(name: str, model, inputs, optimizer) -> dict:
    t0 = time.perf_counter()
    try:
        autoremat.optimize(model, 1, inputs, optimizer=optimizer, compiler="eager", progress=False)
        raise RuntimeError("budget=1 was not refused")
    except autoremat.BudgetError as e:
        floor = e.smallest_budget
    row = {"model": name, "floor": floor, "floor_query_s": time.perf_counter() - t0}
    row["at the floor"] = plan_at(model, inputs, optimizer, floor)
    row["1.05 x floor"] = plan_at(model, inputs, optimizer, int(floor * 1.05))
    return row


def cell(r: dict) -> str:
    if r["result"] == "refused":
        return f"refused{' (measured)' if r['measured_refusal'] else ''}, {r['s']:.1f} s"
    first = f"{r['first_predicted']} / {r['first_measured']}" if r["first_predicted"] is not None else "-"
    return f"planned{', re-planned' if r['replanned'] else ''}, {r['s']:.1f} s; first plan predicted / measured {first}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="eager_code_cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    rows = [one(name, *spec) for name, spec in models().items()]
    lines = ["# Steps with eager code, planned at the floor the floor query names", "",
             f"`PYTHONPATH=.:benchmarks python benchmarks/eager_code.py --out {args.out}` at {commit}  ",
             f"cpu, torch {torch.__version__}, 1 thread. Activations in bytes; seconds of one optimize call each.", "",
             "| model | floor | saved by eager code | floor query s | at the floor | at 1.05 x the floor |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        saved = next((p["eager_saved"] for p in (r["at the floor"], r["1.05 x floor"]) if p.get("eager_saved") is not None),
                     "not counted")
        lines.append(f"| {r['model']} | {r['floor']} | {saved} | {r['floor_query_s']:.1f} | {cell(r['at the floor'])} | "
                     f"{cell(r['1.05 x floor'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"commit": commit, "torch": torch.__version__, "rows": rows},
                                                         indent=1))


if __name__ == "__main__":
    main()
