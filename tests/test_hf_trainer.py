"""HF Trainer with a planned module (examples/hf_trainer.py at a tiny size), and what the module forwards.

A real `transformers.Trainer` run: GPT-2 built from its config (no download), planned by
`autoremat.optimize` under a budget where the plan recomputes, trained for a few steps with one
step measured by a TrainerCallback.
"""

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

import autoremat

_spec = importlib.util.spec_from_file_location(
    "hf_trainer_example", Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py")
hf_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_trainer)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run() -> dict:
    return hf_trainer.main(["--steps", "8", "--n-layer", "2", "--n-embd", "64", "--seq", "64", "--batch", "4",
                            "--lr", "3e-3", "--compiler", "eager"])


@pytest.mark.slow  # the Trainer run behind these takes about 2.5 minutes on 2 cores
def test_trainer_trains_the_planned_step_under_the_budget(run: dict) -> None:
    plan, module = run["plan"], run["module"]
    assert any(g.recomputed for g in plan.graphs) and plan.overhead > 0  # the plan does recompute
    assert plan.predicted_peak <= run["budget"]
    assert run["measured"].peak_bytes <= run["budget"], (run["measured"], run["budget"])
    assert len(module.plans) == 1  # the Trainer's batches are the example's shape: no second plan
    losses = [loss for _, loss in run["losses"]]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    assert run["eval_after"] < run["eval_before"]
    assert {"config.json", "model.safetensors"} <= set(run["saved"]) and run["reloaded_same"]


@pytest.mark.slow  # the Trainer run behind these takes about 2.5 minutes on 2 cores
def test_the_module_stands_in_for_the_hf_model(run: dict) -> None:
    module = run["module"]
    model = module.model
    assert module.config is model.config and module.main_input_name == "input_ids"
    assert list(inspect.signature(module.forward).parameters)[:1] == ["input_ids"]
    assert "labels" in inspect.signature(module.forward).parameters
    # state_dict: the model's keys and tensors, and it loads back
    assert list(module.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(module.state_dict(keep_vars=True).values(),
                                      model.state_dict(keep_vars=True).values()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
    assert all(v.abs().sum() == 0 for v in model.state_dict().values())
    module.load_state_dict(before)
    # inside another module the keys nest under its name and load back the same way
    outer = torch.nn.ModuleDict({"lm": module})
    assert list(outer.state_dict())[0] == "lm." + next(iter(before))
    outer.load_state_dict(outer.state_dict())
    ids = torch.arange(6).unsqueeze(0)
    out = module.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 9) and torch.equal(out[:, :6], ids)
    with pytest.raises(AttributeError, match="nor has the GPT2LMHeadModel it wraps"):
        module.no_such_thing  # noqa: B018


@pytest.mark.slow  # the Trainer run behind these takes about 2.5 minutes on 2 cores
def test_hf_checkpointing_is_refused(run: dict, tmp_path: Path) -> None:
    module = run["module"]
    for enable in (module.gradient_checkpointing_enable, module.activation_checkpointing_enable):
        with pytest.raises(RuntimeError, match="autoremat already plans recomputation"):
            enable()
    module.gradient_checkpointing_disable()  # nothing on: nothing to do
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none",
                             activation_checkpointing=True)
    with pytest.raises(RuntimeError, match="autoremat already plans recomputation"):
        Trainer(model=module, args=args, train_dataset=hf_trainer.corpus_chunks(64, 4)).train()


def test_public_names() -> None:
    assert autoremat.measure_peak.__module__ == "autoremat.measure"
    assert "measure_peak" in autoremat.__all__ and "PeakMeasurement" in autoremat.__all__
