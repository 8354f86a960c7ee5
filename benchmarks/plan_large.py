"""Plan a large model's training step on the meta device (no memory, no GPU) and time it.

    python benchmarks/plan_large.py [--budgets 200GB 140GB 120GB] [--seq 2048]     # 7B Llama shape
    python benchmarks/plan_large.py --model gpt2-small --budgets 14GB 18GB 22GB --device a100

Prints, per budget: wall time of the whole `autoremat.optimize` call (tracing included), the solver's
own time and path, the predicted peak and recompute overhead, or the smallest budget that fits.
Writes the table to benchmarks/results/plan_<model>_cpu.md (plan_llama-7b_cpu.md by default).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autoremat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama-7b", "gpt2-small"], default="llama-7b")
    ap.add_argument("--budgets", nargs="+", default=["200GB", "140GB", "120GB"])
    ap.add_argument("--seq", type=int, default=None, help="default: 2048 for llama-7b, 1024 for gpt2-small")
    ap.add_argument("--device", default="h100")
    args = ap.parse_args()
    torch.set_num_threads(1)

    if args.model == "llama-7b":
        seq, batch = args.seq or 2048, 1
        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=seq, use_cache=False)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    else:
        sys.path.insert(0, str(Path(__file__).parent.parent))
        from examples.models import gpt2_small

        seq, batch = args.seq or 1024, 8
        with torch.device("meta"):
            model, inputs = gpt2_small(batch=batch, seq=seq)
        ids = inputs["input_ids"]
    params = sum(p.numel() for p in model.parameters())
    rows = ["| budget | wall s (trace + plan) | solver s | path | predicted peak | overhead |", "|---|---|---|---|---|---|"]
    for budget in args.budgets:
        t0 = time.perf_counter()
        try:
            om = autoremat.optimize(model, budget=budget, example_inputs={"input_ids": ids, "labels": ids},
                                    device=args.device, optimizer="adamw", compiler="eager")
            s = om.plan.solver
            row = (f"| {budget} | {time.perf_counter() - t0:.1f} | {s['solve_time_s']:.1f} | {s['path']} | "
                   f"{om.plan.predicted_peak / 2**30:.2f} GiB | {100 * om.plan.overhead:.1f}% |")
        except autoremat.BudgetError as e:
            row = (f"| {budget} | {time.perf_counter() - t0:.1f} | | BudgetError | smallest that fits "
                   f"{e.smallest_budget / 2**30:.2f} GiB | |")
        print(row, flush=True)
        rows.append(row)
    text = (f"# {args.model} step planned on the meta device\n\n{params / 1e9:.2f}B parameters, fp32, AdamW, batch "
            f"{batch} x {seq}, {args.device} roofline, torch {torch.__version__}, 2-core CPU, 1 thread.\n\n"
            + "\n".join(rows) + "\n")
    out = Path(__file__).parent / "results" / f"plan_{args.model}_cpu.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
