"""What is live at each precision's floor peak, planned on the meta device.

    python benchmarks/precision_live_at_peak.py --model llama-7b --precision bf16 [--layers 32] [--top 25]

One row of benchmarks/precision_at_scale.py at a time: the step is planned at its smallest feasible budget
(the BudgetError of a 1 GB budget says it) and the plan is replayed in the memory model with its heap observed
(common.live_at_peak, as benchmarks/live_at_peak.py): at the step where the simulated peak falls, every live storage, largest first.
--layers cuts the Llama's depth (same widths) for a quicker look; the benchmark's rows use the full 32.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import SCALE_DEVICE, SCALE_MODELS, SCALE_MODES, live_at_peak, scale_floor, scale_optimize

from autoremat.model.devices import get_device
from autoremat.passes import loss_chunks

MiB = 2**20


def model_of(name: str, layers: int | None):
    if name == "llama-7b" and layers:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                          use_cache=False)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
            ids = torch.randint(0, cfg.vocab_size, (1, 2048))
        return model, {"input_ids": ids, "labels": ids}, f"Llama 7B widths, {layers} layers, batch 1 x 2048"
    return SCALE_MODELS[name]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(SCALE_MODELS), default="llama-7b")
    ap.add_argument("--precision", choices=SCALE_MODES, default="bf16")
    ap.add_argument("--layers", type=int, default=None, help="Llama depth (default: the model's own)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--outputs", choices=loss_chunks.OUTPUTS, default="all")
    a = ap.parse_args()
    torch.set_num_threads(1)
    loss_chunks.CANDIDATES = (a.chunks,)
    model, inputs, label = model_of(a.model, a.layers)
    t0 = time.perf_counter()
    f = scale_floor(model, inputs, a.precision, a.outputs)
    om = scale_optimize(model, inputs, f["total"], a.precision, a.outputs)
    plan = om.plan
    profiles = om._planner.profiles
    best = live_at_peak(profiles, [set(g.saved) | set(g.again) for g in plan.graphs], get_device(SCALE_DEVICE).alloc_granularity)
    g = profiles[best["graph"]]
    where = g.nodes[best["node"]]
    live = sorted(best["live"].items(), key=lambda kv: -kv[1])
    print(f"{label}, {a.precision}: floor {f['total'] / MiB:.1f} MiB (fixed {f['fixed'] / MiB:.1f}, activations "
          f"{f['activations'] / MiB:.1f}); simulated activation peak {best['during'] / MiB:.1f} MiB, live storages "
          f"{sum(best['live'].values()) / MiB:.1f} MiB; peak at graph {best['graph']} {best['phase']} "
          f"`{best['node']}` ({where.target}, {where.module}); {time.perf_counter() - t0:.0f} s")
    print("| # | graph | tensor | op | dtype | shape | module | kind | MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, ((scope, name), size) in enumerate(live[:a.top], 1):
        p = profiles[scope].nodes[name]
        print(f"| {i} | {scope} | `{name}` | {p.target} | {p.dtype} | {p.shape} | {p.module} | {p.kind} | "
              f"{size / MiB:.3f} |")
    rest = live[a.top:]
    print(f"other {len(rest)} live storages: {sum(s for _, s in rest) / MiB:.2f} MiB")


if __name__ == "__main__":
    main()
