"""The graph passes: every rewrite of an FX graph autoremat makes, one module each.

- `decompositions`: applied while AOTAutograd traces the joint graph (capture): dropout as a saved
  bool mask and a recomputable masked scale; BatchNorm / LayerNorm / dropout backward traced in their
  kernels' layouts.
- `rng_replay`: each random draw of a joint graph saves the generator state before it, so the backward
  may replay the draw instead of keeping its output (a dropout mask costs its state, not its bytes).
- `matmul_accumulation`: a weight gradient summed over the matmuls that read the weight (a chunked loss's
  projection, a tied weight) accumulated by them (`addmm`), so the backward holds the running sum, not
  every product until a fused sum.
- `weight_casts`: a weight's 16-bit copy cast again for the backward, so it is not held from the forward.
- `grad_upcast`: a 16-bit weight gradient and its fp32 upcast computed as one op over blocks of rows
  (`autoremat::mm_upcast`), so no whole 16-bit copy sits beside the fp32 gradient.
- `joint`: what the passes over a joint graph share (its backward side).
- `dtypes`: the dtype rewrite of a dynamo graph for precision= (`apply_dtypes`), before tracing;
  `fused_attention`: an attention run in 16 bits as one fused op (`autoremat::attention`: output and
  logsumexp kept, scores recomputed in its backward); `attention`: the plain-op form used with dropout.
- `loss_chunks`: a vocabulary projection + cross-entropy of a dynamo graph rewritten into chunks of
  token rows, before tracing; the planner chooses the chunk count (`outputs="loss"` drops the logits);
  `fused_loss`: a 16-bit site left whole computes its cross-entropy as one fused op;
  `fused_linear_loss`: under outputs="loss", a 16-bit head and its loss as one op over the fp32 weight.
- `remat`: the save/recompute split of a joint graph into forward and backward modules, in the
  simulated order (`split`, `reorder`), once the plan is solved; a recomputed batch norm runs without
  its running-stat update, and the forward draws each random value once.

The passes take graphs and plans as arguments and import no pipeline stage (the call kinds precision
reads, `op_kinds`, and the naming of values recomputed twice, `recompute_names`, live here), so every stage
may use them:
capture applies the decompositions, the profile reads which draws replay and which buffers are
reused, the planner applies the split.
"""

from autoremat.passes.remat import reorder, split

__all__ = ["reorder", "split"]
