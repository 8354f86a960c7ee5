"""The quick zoo's other families (examples/zoo.py at its TINY size): mixture-of-experts decoders (data-dependent
routing), encoders, encoder-decoders and vision models, and decoders with a PEFT LoRA adapter. Each is captured
and planned at one budget below its eager peak; the measured peak holds it and the gradients are eager's."""

from __future__ import annotations

import pytest

from examples import zoo
from tests.zoo_check import check_family


@pytest.mark.parametrize("family", zoo.MOE)
def test_a_mixture_of_experts_family_plans_and_holds_its_budget(family: str) -> None:
    plan = check_family(family)
    assert plan.loss.get("rows") == zoo.TINY.batch * zoo.TINY.tokens, plan.loss


@pytest.mark.parametrize("family", zoo.ENCODERS + zoo.SEQ2SEQ + zoo.VISION)
def test_an_encoder_seq2seq_or_vision_family_plans_and_holds_its_budget(family: str) -> None:
    check_family(family)


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt"])
def test_a_decoder_with_a_lora_adapter_plans_and_holds_its_budget(family: str) -> None:
    check_family(family, lora=True)


@pytest.mark.slow  # about 75 s: a floor query and a plan of a LoRA model whose hook breaks the graph
def test_a_model_plans_again_after_a_floor_query_and_checkpointing_switched_on_and_off() -> None:
    """The sequence a user runs to compare with HF checkpointing, in one process: a floor query, HF
    checkpointing on (one step) and off, then a plan. transformers leaves an input-grad hook behind, whose graph
    break puts its shared deprecation wrapper past dynamo's recompile limit after a few plans; the plan must
    still be made (never a frame run unplanned) and must name the hook that makes it differ from a fresh one."""
    import autoremat

    model, batch = zoo.build("llama", zoo.TINY)
    model = zoo.lora(model)
    with pytest.raises(autoremat.BudgetError) as e:
        autoremat.optimize(model, budget=1, example_inputs=batch, optimizer=None, compiler="eager", progress=False)
    floor = e.value.smallest_budget
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(**batch).loss.backward()
    base.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    om = autoremat.optimize(model, budget=int(1.1 * floor), example_inputs=batch, optimizer=None,
                            compiler="eager", progress=False)
    om(**batch).loss.backward()
    assert any("make_inputs_require_grads" in n for n in om.plan.notes), om.plan.notes
