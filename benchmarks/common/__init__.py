"""The benchmarks' shared helpers: the one module every script imports (`from common import ...`), which
imports no script (tests/test_benchmark_layout.py checks both). Its files split it by job, each readable
on its own:

- steps.py: a training step, its timing (paired, with the noise), the peer rows' builders (eager,
  checkpointing, PyTorch's activation_memory_budget, Inductor, autoremat), the run's facts (git, load);
- rows.py: the row runners (`Bench`, the floor rows) and their tables;
- models.py: the models and sizes several scripts measure;
- plans.py: helpers that plan without timing a step (meta-device parts, planning at scale, live-at-peak).

Importing it puts the repository on sys.path, for `examples`.
"""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository, for `examples`; appended: PYTHONPATH wins

from .models import (  # noqa: E402, F401
    FLOOR_SIZES,
    LORA_BATCH,
    LORA_SIZES,
    SCALE_MODELS,
    ResidualBlock,
    ResNetDropout,
    bert,
    floor_configs,
    gpt2_small_meta,
    gqa_decoder,
    head_lm,
    llama_7b,
    lora_step,
    resnet,
    speed_configs,
    vit,
)
from .plans import (  # noqa: E402, F401
    LOSS_GOALS,
    SCALE_DEVICE,
    SCALE_MODES,
    TINY,
    GiB,
    chunking_off,
    inductor_limits,
    live_at_peak,
    meta_part,
    meta_table,
    scale_floor,
    scale_optimize,
    scale_step,
)
from .rows import (  # noqa: E402, F401
    Bench,
    error_fields,
    floor_of,
    floor_row,
    fmt_row_line,
    mib,
    row_line,
    run_row,
    smallest_budget,
    table,
    timing_noise,
)
from .steps import (  # noqa: E402, F401
    FLOOR_PT_BUDGETS,
    GRAD_NOISE_FLOOR,
    OUTPUTS,
    REPO,
    SEED,
    Build,
    GitState,
    MiB,
    ar_build,
    bootstrap_median_interval,
    checkpoint_every_block,
    compiled_graphs,
    eager_build,
    error_status,
    git_state,
    grad_errors,
    grad_rel_err,
    grads_of,
    head_to_head,
    inductor_build,
    load_average,
    make_step,
    paired_times,
    param_rel_errs,
    pt_build,
    split,
    sync,
    to_device,
    zero,
)
