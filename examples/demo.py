"""The main job on a built-in model: plan a small GPT-2 training step under a byte budget, check it.

    python examples/demo.py [--budget-fraction 0.3]

Prints the plan, then runs one step with the plan and one eagerly and compares the measured peak
with the budget and the gradients with eager's.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autoremat  # noqa: E402
from autoremat.measure import measure_peak  # noqa: E402
from autoremat.model.ledger import Ledger  # noqa: E402
from examples import models  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--budget-fraction", type=float, default=0.3,
                    help="where the budget sits between the smallest feasible (0) and no recomputation (1)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model, batch = models.gpt2(batch=4, seq=128, n_layer=4, n_embd=128, n_head=4)

# Where the budget can go: from the smallest plan that fits to saving everything.
full = autoremat.optimize(model, budget="100GB", example_inputs=batch, verify=False)
ledger = Ledger.from_dict(full.plan.ledger)
hi = ledger.fixed + full.plan.baseline_peak
try:
    autoremat.optimize(model, budget=ledger.fixed + 1, example_inputs=batch, verify=False)
except autoremat.BudgetError as e:
    lo = e.smallest_budget
budget = int(lo + args.budget_fraction * (hi - lo))
print(f"budget {autoremat.format_bytes(budget)} (no recomputation needs {autoremat.format_bytes(hi)})\n")

opt_model = autoremat.optimize(model, budget=budget, example_inputs=batch)
print(opt_model.plan.summary(), "\n")


def step(m):
    torch.manual_seed(1)
    out = m(**batch)
    out.loss.backward()
    return out.loss.detach()


step(opt_model)  # warm up: gradients now exist, as in a gradient-accumulation loop
model.zero_grad(set_to_none=False)
loss, meas = measure_peak(lambda: step(opt_model), baseline_objs=(model, batch))
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=False)
eager_loss, eager = measure_peak(lambda: step(model), baseline_objs=(model, batch))
ref = [p.grad.clone() for p in model.parameters()]
err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, ref))
measured = ledger.fixed + meas.delta_peak_bytes
print(f"measured step peak  {autoremat.format_bytes(measured)}  (budget {autoremat.format_bytes(budget)}, "
      f"{'fits' if measured <= budget else 'OVER BUDGET'})")
print(f"eager step peak     {autoremat.format_bytes(ledger.fixed + eager.delta_peak_bytes)}")
print(f"predicted           {autoremat.format_bytes(opt_model.plan.predicted_peak)}")
print(f"loss {loss.item():.6f} vs eager {eager_loss.item():.6f}; max relative gradient error {err:.1e}")
