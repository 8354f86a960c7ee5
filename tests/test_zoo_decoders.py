"""The quick zoo, decoder families (examples/zoo.py at its TINY size): each is captured and planned at one budget
below its eager peak; the measured peak holds it, the gradients are eager's, and the loss region (the vocabulary
projection to the cross-entropy) is found. A transformers release that changes how a family writes its step
fails here. benchmarks/zoo.py measures the same families at the zoo's size against HF checkpointing."""

from __future__ import annotations

import pytest

from examples import zoo
from tests.zoo_check import check_family


@pytest.mark.parametrize("family", zoo.DECODERS)
def test_a_decoder_family_plans_holds_its_budget_and_chunks_its_loss(family: str) -> None:
    plan = check_family(family)
    assert plan.loss.get("rows") == zoo.TINY.batch * zoo.TINY.tokens, plan.loss
    assert not plan.loss.get("skipped"), plan.loss
