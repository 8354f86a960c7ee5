"""Buffer by buffer: what Inductor's generated code holds at each compiled graph's peak, against the memory model.

Plans one model of `speed.py --quick`, lora.py's LoRA GPT-2 (with its AdamW, outputs="loss"), or plan_time.py
--quick's 2-layer HF BERT (`bert`: a biased output head, the logits returned, its loss chunked near the floor), under
compiler="inductor" at a budget (verify off, so the plan is the first one), runs one step (the backward
compiles at its first call), keeps the wrapper code Inductor generates for the final forward and backward
modules (caches off, so every graph is generated), and replays each module's `call()` statically: a buffer
lives from its `empty_strided_cpu` to its `del`, a `# reuse` line hands a buffer to a new name (in
place or from the pool), an `# alias` is a view; the graph's inputs other than parameters and tangents
(saved activations, donated to the backward) live until their `del`. Printed per module: that replay's
peak and the largest buffers then; then the memory model's peak for each graph and phase, and the
measured step's activations (as verification measures them). Buffers Inductor writes are named `buf<k>`; the `# Topologically Sorted Source Nodes`
comment in the code (kept under --dump) names the graph nodes each kernel computes.

    python benchmarks/inductor_buffers.py --model stack [--dropout 0.1] [--budget BYTES] [--dump DIR] [--out NAME]
    PYTHONPATH=.:benchmarks python benchmarks/inductor_buffers.py --model lora --budget 28437381 --out inductor_buffers_lora_cpu
    PYTHONPATH=.:benchmarks python benchmarks/inductor_buffers.py --model bert --budget 5096980 --out inductor_buffers_bert_cpu

A probe for where the memory model and Inductor's generated code part: prints, and writes benchmarks/results/NAME.md under --out.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from common import SEED, bert, git_state, head_lm, lora_step, make_step, speed_configs, split

DTYPE_BYTES = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.bool": 1, "torch.int64": 8,
               "torch.int32": 4, "torch.uint8": 1, "torch.int8": 1}
ALLOC = re.compile(r"(buf\d+) = empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), (torch\.\w+)\)")
INPUT = re.compile(r"(\w+) = rand_strided\(\(([^)]*)\), \(([^)]*)\), device='\w+', dtype=(torch\.\w+)\)")
KERNEL = re.compile(r"(cpp_fused\w*|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")


def storage_bytes(shape: str, stride: str, dtype: str) -> int:
    sizes = [int(x) for x in shape.split(",") if x.strip()]
    strides = [int(x) for x in stride.split(",") if x.strip()]
    if any(s == 0 for s in sizes):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(sizes, strides))) * DTYPE_BYTES[dtype]


def replay(code: str) -> tuple[int, str, dict[str, int]]:
    """(peak bytes, the kernel running then, live buffers then) of one wrapper's call()."""
    body = code[code.index("def call(self, args):"):]
    body = body[: body.index("runner = Runner")] if "runner = Runner" in body else body
    names = re.search(r"\n\s+(.*) = args\n", body).group(1).split(", ")
    sizes = {m.group(1): storage_bytes(m.group(2), m.group(3), m.group(4)) for m in INPUT.finditer(code)}
    live = {a: sizes.get(a, 0) for a in names if not a.startswith(("primals", "tangents"))}
    owner: dict[str, str | None] = {}
    peak, at, then = sum(live.values()), "entry", dict(live)
    for line in body.splitlines():
        s = line.strip()
        m = ALLOC.match(s)
        if m:
            live[m.group(1)] = storage_bytes(m.group(2), m.group(3), m.group(4))
            continue
        if s.endswith("# reuse"):
            new, old = re.match(r"(buf\d+) = (?:reinterpret_tensor\()?(\w+)", s).groups()
            owner[new] = owner.get(old, old)
            continue
        if s.endswith("# alias"):
            owner[s.split(" = ")[0]] = None
            continue
        for d in re.findall(r"del (\w+)", s):
            key = owner.get(d, d)
            if key is not None:
                live.pop(key, None)
        if KERNEL.match(s):
            total = sum(live.values())
            if total > peak:
                peak, at, then = total, KERNEL.match(s).group(1), dict(live)
    return peak, at, then


def _model(name: str, dropout: float):
    """(model, example inputs, optimizer, outputs) of `name`: speed.py --quick's stack or GPT-2, or lora.py's
    LoRA GPT-2 with AdamW over its adapter (its own dropout, 0.1)."""
    if name == "lora":
        model, batch, opt = lora_step()
        return model, batch, opt, "loss"
    if name == "bert":  # plan_time.py --quick's 2-layer BERT (its floor under Inductor)
        torch.manual_seed(SEED)
        model, ex = bert(4, 64, 2, 64, 4, 1024)
        return model, ex, None, "all"
    if name == "head":  # plan_time.py --cliff's `biased` head, loss only (its floor under Inductor)
        torch.manual_seed(SEED)
        model, ex = head_lm(4, 64, 4096, 32, bias=True, gate=False)
        return model, ex, None, "loss"
    cfg = next(c for c in speed_configs(True, dropout) if c["name"] == name)
    torch.manual_seed(SEED)
    model, ex = cfg["factory"](**cfg["kwargs"])
    return model, ex, None, "all"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stack", choices=("stack", "gpt2", "lora", "bert", "head"))
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--budget", type=int, default=1 << 50, help="bytes (default: no recomputation)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--dump", default="", help="a folder to write each generated module to")
    ap.add_argument("--out", default="", help="also write what is printed to benchmarks/results/<OUT>.md")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    import autoremat
    from autoremat.measure import measure_peak
    from autoremat.model.devices import get_device
    from autoremat.planning.verify import measure_step
    from autoremat.solve.decision import evaluate

    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    codes: list[str] = []
    config.force_disable_caches = True
    GraphLowering.save_output_code = staticmethod(codes.append)
    model, ex, opt, outputs = _model(a.model, a.dropout)
    model.train()
    om = autoremat.optimize(model, budget=a.budget, example_inputs=ex, optimizer=opt, compiler="inductor",
                            verify=False, progress=False, outputs=outputs)
    args, kwargs = split(ex)
    step = make_step(om, args, kwargs)
    step()  # AOTAutograd compiles each backward at its first call
    model.zero_grad(set_to_none=True)
    n = om.num_graphs
    # the last compiles: each graph's forward (planning compiled the step), then the backwards, last graph first
    final = codes[-2 * n:]
    for k, code in enumerate(final):
        kind = "forward" if k < n else "backward"
        peak, at, then = replay(code)
        say(f"module {k} ({kind}): peak {peak} B at {at}")
        for name, size in sorted(then.items(), key=lambda kv: -kv[1])[: a.top]:
            say(f"    {name:14s} {size}")
        if a.dump:
            Path(a.dump).mkdir(parents=True, exist_ok=True)
            (Path(a.dump) / f"module{k}_{kind}.py").write_text(code)
    profiles = om._planners[0].sequence()
    _, tl, _ = evaluate(profiles, [set(g.saved) | set(g.again) for g in om.plan.graphs], get_device("cpu").alloc_granularity)
    peaks: dict[tuple[int, str], tuple[int, str]] = {}
    for s in tl.steps:
        if s.during > peaks.get((s.graph, s.phase), (-1, ""))[0]:
            peaks[(s.graph, s.phase)] = (s.during, s.node)
    say("memory model, live activations at each graph's peak (all graphs' values):")
    for (graph, phase), (during, node) in peaks.items():
        say(f"    graph {graph} {phase:8s} {during} B at {node}")
    _, compiled, planner, _ = next(iter(om._shapes.values()))  # the example inputs' plan (a PlannedStep)
    measured = measure_step(model, compiled, planner, args, kwargs, torch.device("cpu"))
    say(f"activations: predicted {om.plan.activation_peak} B, measured {measured} B on a steady-state step "
        f"(the outputs held through the backward, as verification measures) ({measured / om.plan.activation_peak - 1:+.2%})")
    if outputs == "all":
        step()
        step()
        _, m = measure_peak(step, device=torch.device("cpu"), baseline_objs=(model, ex))
        say(f"predicted peak {om.plan.predicted_peak} B, measured {m.peak_bytes} B "
            f"({om.plan.predicted_peak / m.peak_bytes - 1:+.2%})")
    if a.out:
        out = Path(__file__).parent / "results" / f"{a.out}.md"
        head = (f"# Inductor's buffers against the memory model: `{' '.join(['python', *sys.argv])}`\n\n"
                f"torch {torch.__version__}, 1 thread, repo {git_state().line()}. Modules: each graph's forward, then "
                f"the backwards (last graph first); a module's peak counts its own buffers and the inputs it holds.\n")
        out.write_text(head + "\n```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
