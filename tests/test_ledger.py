import json

import pytest
import torch
from torch import nn

from autoremat.model.ledger import (
    SLACK,
    Ledger,
    ledger_for_count,
    ledger_for_model,
    optimizer_state_bytes,
)

torch.set_num_threads(1)


class Tiny(nn.Module):
    """Hand-countable: a tied embedding/head, a frozen linear, a norm and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)  # 80 elements, trainable
        self.frozen = nn.Linear(8, 8)  # 64 + 8 = 72 elements, frozen
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(8)  # 8 + 8 = 16 elements, trainable
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: no new storage, no new grad
        self.register_buffer("scale", torch.ones(4))  # 4 elements

    def forward(self, idx):
        return self.head(self.norm(self.frozen(self.embed(idx))))


ALL_ELEMS = 80 + 72 + 16 + 4  # parameters and the buffer
TRAIN_ELEMS = 80 + 16


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def take_step(model, opt):
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()


def test_tiny_model_no_optimizer():
    ledger = ledger_for_model(Tiny())
    assert ledger.parameters == ALL_ELEMS * 4
    assert ledger.gradients == TRAIN_ELEMS * 4
    assert ledger.optimizer_state == 0
    assert ledger.master_weights == 0
    assert ledger.fixed == (ALL_ELEMS + TRAIN_ELEMS) * 4


def test_adamw_inferred_then_measured():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    before = ledger_for_model(model, opt)
    assert before.optimizer_state == 2 * TRAIN_ELEMS * 4
    assert before.master_weights == 0  # a torch optimizer updates in place
    take_step(model, opt)
    assert len(opt.state) == 3  # embed.weight, norm.weight, norm.bias
    after = ledger_for_model(model, opt)
    # The measured state (step counters aside) equals the inferred figure.
    assert after.optimizer_state == before.optimizer_state


def test_adamw_amsgrad_and_bf16():
    model = Tiny().to(torch.bfloat16)
    opt = torch.optim.AdamW(trainable(model), amsgrad=True)
    assert optimizer_state_bytes(opt, trainable(model)) == 3 * TRAIN_ELEMS * 2
    take_step(model, opt)
    assert optimizer_state_bytes(opt, trainable(model)) == 3 * TRAIN_ELEMS * 2


def test_sgd_momentum_before_and_after_step():
    model = Tiny()
    opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    assert len(opt.state) == 0
    assert ledger_for_model(model, opt).optimizer_state == TRAIN_ELEMS * 4
    take_step(model, opt)
    assert ledger_for_model(model, opt).optimizer_state == TRAIN_ELEMS * 4
    plain = torch.optim.SGD(trainable(model), lr=0.1)
    assert ledger_for_model(model, plain).optimizer_state == 0


def test_per_group_settings():
    model = Tiny()
    opt = torch.optim.SGD(
        [
            {"params": [model.embed.weight], "momentum": 0.9},
            {"params": list(model.norm.parameters())},
        ],
        lr=0.1,
    )
    assert optimizer_state_bytes(opt, trainable(model)) == 80 * 4


def test_adafactor_before_and_after_step():
    model = Tiny()
    opt = torch.optim.Adafactor(trainable(model))
    # embed.weight (10, 8): a row factor of 10 and a column factor of 8; the norm's
    # 1-D weight and bias keep a full second moment each.
    expected = (10 + 8 + 8 + 8) * 4
    assert ledger_for_model(model, opt).optimizer_state == expected
    take_step(model, opt)
    assert ledger_for_model(model, opt).optimizer_state == expected
    assert optimizer_state_bytes("adafactor", trainable(model)) == expected
    assert optimizer_state_bytes("adafactor", [(10, 8), (8,), (8,)]) == expected
    # Leading dims belong to the rows: (2, 3, 4) -> a (2, 3) row and a (2, 4) column factor.
    assert optimizer_state_bytes("adafactor", [(2, 3, 4), (0, 5)]) == (6 + 8 + 0 + 5) * 4


def test_adafactor_3d_param_matches_torch():
    w = nn.Parameter(torch.randn(2, 3, 4))
    opt = torch.optim.Adafactor([w])
    before = optimizer_state_bytes(opt, [w])
    w.sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt, [w]) == before == (6 + 8) * 4


def test_optimizer_covers_only_given_and_managed_params():
    model = Tiny()
    opt = torch.optim.Adam([model.embed.weight])
    assert optimizer_state_bytes(opt, trainable(model)) == 2 * 80 * 4
    assert optimizer_state_bytes(opt, list(model.norm.parameters())) == 0


def test_unknown_optimizer_class_adds_note():
    class MyOpt(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    model = Tiny()
    ledger = ledger_for_model(model, MyOpt(trainable(model)))
    assert ledger.optimizer_state == 2 * TRAIN_ELEMS * 4
    assert any("MyOpt" in note for note in ledger.notes)


def test_named_optimizers():
    params = [(1000,), (30, 40)]
    n = 2200
    assert optimizer_state_bytes(None, params) == 0
    assert optimizer_state_bytes("none", params) == 0
    assert optimizer_state_bytes("sgd", params) == 0
    assert optimizer_state_bytes("SGD_momentum", params) == 4 * n
    assert optimizer_state_bytes("momentum", params) == 4 * n
    assert optimizer_state_bytes("lion", params) == 4 * n
    assert optimizer_state_bytes("adam", params) == 8 * n
    assert optimizer_state_bytes("AdamW", params) == 8 * n
    assert optimizer_state_bytes("adafactor", params) == 1000 * 4 + (30 + 40) * 4
    # One byte per moment per element plus one fp32 scale per 2048-element block.
    assert optimizer_state_bytes("adamw8bit", [(4096,)]) == 2 * (4096 + 2 * 4)
    assert optimizer_state_bytes("adam8bit", [(4097,)]) == 2 * (4097 + 3 * 4)
    with pytest.raises(ValueError, match="adamw"):
        optimizer_state_bytes("shampoo", params)


def test_named_optimizer_on_16bit_model_adds_master_weights():
    model = Tiny().half()
    ledger = ledger_for_model(model, "adamw")
    assert ledger.parameters == ALL_ELEMS * 2
    assert ledger.gradients == TRAIN_ELEMS * 2
    assert ledger.optimizer_state == TRAIN_ELEMS * 8  # fp32 moments
    assert ledger.master_weights == TRAIN_ELEMS * 4
    assert ledger_for_model(model, "adamw", master_weights=False).master_weights == 0
    # fp32 params need no fp32 copy, unless asked for.
    assert ledger_for_model(Tiny(), "adamw").master_weights == 0
    assert ledger_for_model(Tiny(), "adamw", master_weights=True).master_weights == TRAIN_ELEMS * 4


def test_param_dtype_override_and_meta_model():
    with torch.device("meta"):
        model = Tiny()
    ledger = ledger_for_model(model, "adamw", param_dtype=torch.bfloat16)
    # Meta storages all have data_ptr 0 and must still be told apart.
    assert ledger.parameters == ALL_ELEMS * 2
    assert ledger.gradients == TRAIN_ELEMS * 2
    assert ledger.master_weights == TRAIN_ELEMS * 4


def test_shared_storage_views_counted_once():
    base = torch.zeros(100)
    model = nn.Module()
    model.a = nn.Parameter(base[:60])
    model.b = nn.Parameter(base[60:])
    ledger = ledger_for_model(model)
    assert ledger.parameters == 100 * 4  # one storage
    assert ledger.gradients == 100 * 4  # but two .grad tensors of 60 and 40


def test_inputs_and_granularity():
    model = Tiny()
    x = torch.zeros(3, 5, dtype=torch.long)  # 120 bytes
    mask = torch.ones(7, dtype=torch.bool)  # 7 bytes
    inputs = ({"idx": x, "again": x[1:]}, [mask, "not a tensor"], None)
    assert ledger_for_model(model, inputs=inputs).inputs == 127
    ledger = ledger_for_model(model, "sgd_momentum", inputs=inputs, device_granularity=512)
    # Every allocation rounds up to 512: 5 params + 1 buffer, 3 grads, 3 momenta, 2 inputs.
    assert ledger.parameters == 6 * 512
    assert ledger.gradients == 3 * 512
    assert ledger.optimizer_state == 3 * 512
    assert ledger.inputs == 2 * 512


def test_count_7b_fp16_adamw():
    ledger = ledger_for_count(7_000_000_000, param_dtype="fp16", optimizer="adamw")
    assert ledger.parameters == 14 * 10**9
    assert ledger.gradients == 14 * 10**9
    assert ledger.optimizer_state == 56 * 10**9
    assert ledger.master_weights == 28 * 10**9
    assert ledger.fixed == 112 * 10**9
    off = ledger_for_count(7_000_000_000, param_dtype=torch.float16, master_weights=False)
    assert off.master_weights == 0
    fp32 = ledger_for_count(7_000_000_000)
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_state, fp32.master_weights) == (
        28 * 10**9, 28 * 10**9, 56 * 10**9, 0,
    )


def test_count_options():
    ledger = ledger_for_count(1000, param_dtype="bf16", grad_dtype="fp32", optimizer="sgd",
                              trainable_fraction=0.25)
    assert ledger.parameters == 2000
    assert ledger.gradients == 250 * 4
    assert ledger.optimizer_state == 0
    assert ledger.master_weights == 250 * 4  # bf16 params, fp32 update
    assert ledger_for_count(1000, optimizer=None, param_dtype="bf16").master_weights == 0
    assert ledger_for_count(1000, optimizer="adafactor").notes
    with pytest.raises(ValueError, match="adamw"):
        ledger_for_count(1000, optimizer="shampoo")
    with pytest.raises(ValueError):
        ledger_for_count(1000, param_dtype="fp8")


def test_sharding_per_rank():
    n = 1_000_000_001  # odd on purpose: ceil division
    kw = {"param_dtype": "bf16", "optimizer": "adamw", "world_size": 4}
    full = ledger_for_count(n, **kw, sharding="none")
    p, g, o, m = 2 * n, 2 * n, 8 * n, 4 * n
    parts = (full.parameters, full.gradients, full.optimizer_state, full.master_weights)
    assert parts == (p, g, o, m)
    z1 = ledger_for_count(n, **kw, sharding="zero1")
    assert (z1.parameters, z1.gradients, z1.optimizer_state, z1.master_weights) == (
        p, g, 2_000_000_002, 1_000_000_001,
    )
    z2 = ledger_for_count(n, **kw, sharding="ZeRO2")
    assert (z2.parameters, z2.gradients, z2.optimizer_state, z2.master_weights) == (
        p, 500_000_001, 2_000_000_002, 1_000_000_001,
    )
    for mode in ("zero3", "fsdp"):
        z3 = ledger_for_count(n, **kw, sharding=mode)
        assert (z3.parameters, z3.gradients, z3.optimizer_state, z3.master_weights) == (
            500_000_001, 500_000_001, 2_000_000_002, 1_000_000_001,
        )
        assert z3.world_size == 4 and z3.sharding == mode


def test_sharding_model_and_validation():
    model = Tiny()
    ledger = ledger_for_model(model, "adamw", world_size=4, sharding="fsdp")
    assert ledger.parameters == ALL_ELEMS * 4 // 4
    assert ledger.gradients == TRAIN_ELEMS * 4 // 4
    assert ledger.optimizer_state == TRAIN_ELEMS * 8 // 4
    # world_size 1 shards nothing.
    assert ledger_for_count(10, world_size=1, sharding="zero3").parameters == 40
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            ledger_for_count(10, world_size=bad)
    with pytest.raises(ValueError, match="zero2"):
        ledger_for_model(model, sharding="ddp")


def test_totals_and_headroom():
    ledger = Ledger(parameters=10, gradients=20, optimizer_state=30, master_weights=5, inputs=1)
    assert ledger.fixed == 66
    assert ledger.total == 66 and ledger.headroom is None
    ledger.activations = 34
    ledger.budget = 90
    assert ledger.total == 100
    assert ledger.headroom == -10


def test_dict_round_trip():
    ledger = ledger_for_count(7_000_000_000, param_dtype="fp16", world_size=8, sharding="zero2")
    ledger.activations = 123
    ledger.budget = 80 * 10**9
    ledger.notes.append("a note")
    d = ledger.to_dict()
    assert json.loads(json.dumps(d)) == d
    back = Ledger.from_dict(json.loads(json.dumps(d)))
    assert back == ledger
    assert back.to_dict() == d
    back.notes.append("x")  # no aliasing of the list
    assert ledger.notes == ["a note"]


def test_format():
    ledger = ledger_for_count(7_000_000_000, param_dtype="fp16")
    text = ledger.format()
    assert "master weights" in text
    assert "14.00 GB" in text and "13.04 GiB" in text
    assert "headroom" not in text
    ledger.budget = 120 * 10**9
    text = ledger.format()
    lines = text.splitlines()
    assert lines[0].startswith("parameters") and lines[-1].startswith("headroom")
    assert "8.00 GB" in lines[-1]
    assert "master weights" not in ledger_for_count(10).format()
    assert "zero1" in ledger_for_count(10, world_size=2, sharding="zero1").format()


def test_gpu_step_holds_blas_workspaces_and_a_cpu_step_none(monkeypatch):
    """A plan for a GPU counts cuBLAS's workspaces among the fixed bytes (two threads x (32 MiB cuBLAS
    + 1 MiB cuBLASLt) on an H200: devices.blas_workspace_bytes); the same model run on the CPU, whose op times are
    modelled on an H200, holds none. The budget left to activations is the same in both cases once that is added."""
    import autoremat

    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    workspaces = 2 * (32 + 1) * 2**20
    plans = {}
    for where in ("meta", "cpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(where)
        x = torch.randn(32, 64, device=where)
        om = autoremat.optimize(model, budget="1GB", example_inputs=(x,), optimizer=None, device="h200",
                                compiler="eager", progress=False)
        plans[where] = om.plan
    meta, cpu = (Ledger.from_dict(plans[w].ledger) for w in ("meta", "cpu"))
    assert meta.workspaces == workspaces and cpu.workspaces == 0
    assert meta.fixed - cpu.fixed == workspaces
    assert plans["meta"].predicted_peak - plans["cpu"].predicted_peak == workspaces
    assert "cuBLAS workspaces" in meta.format() and "cuBLAS workspaces" not in cpu.format()


def test_needs_and_room_are_the_one_budget_sum_optimizer_step_included():
    """fixed = 100 + 100 + 200 = 400 B. A step whose graphs peak at 1,000 B needs 400 + 1,000 + SLACK; when
    optimizer.step()'s 3,000 B of temporaries outgrow the activations, those count instead (never both)."""
    ledger = Ledger(parameters=100, gradients=100, optimizer_state=200, optimizer_step=3000)
    assert ledger.needs(1000) == 400 + 3000 + SLACK
    assert ledger.needs(5000) == 400 + 5000 + SLACK
    assert ledger.room(10_000) == 10_000 - 400 - SLACK
    assert ledger.needs(ledger.room(10_000)) == 10_000  # inverse where the activations are the larger


def test_what_eager_code_saved_is_held_with_the_activations_not_with_the_optimizer_step():
    """fixed = 100 + 100 + 200 (saved by eager code) = 400 B. The eager code's saved tensors live with the
    activations and are freed before optimizer.step(): its 500 B of temporaries need 500 - 200 = 300 B over
    the fixed parts, so graphs peaking at 250 B need 400 + 300; at 1,000 B, 400 + 1,000. A real step's
    measured 1,200 B above its baseline include the 200 B: 1,000 B are the graphs'."""
    ledger = Ledger(parameters=100, gradients=100, optimizer_state=0, eager_saved=200, optimizer_step=500)
    assert ledger.fixed == 400 and ledger.after_backward == 300
    assert ledger.needs(250) == 400 + 300 + SLACK
    assert ledger.needs(1000) == 400 + 1000 + SLACK
    assert ledger.of_graphs(1200) == 1000
    assert ledger.step_peak(ledger.of_graphs(1200)) == 200 + 1200  # the parameters and gradients, and the measured
    assert "saved by eager code" in ledger.format()
    assert Ledger.from_dict(ledger.to_dict()) == ledger
