"""The loss region's chunk count: how many pieces of token rows the output projection + cross-entropy is
computed in (autoremat.passes.loss_chunks rewrites it), chosen from the step traced at each count.

`choice` ranks the counts from their traces and plans (`CountChoice`, which the pipeline builds from),
`bounds` says where more chunks cannot lower a count's peak or time (the judgements that end the counts),
and `count_trace` is the value both read: the step traced at one count.
"""
