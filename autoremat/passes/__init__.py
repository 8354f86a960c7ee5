"""The graph passes: every rewrite of an FX graph autoremat makes, one module each.

- `remat`: the save/recompute split of a joint graph into forward and backward modules, in the
  simulated order (`split`, `reorder`).
"""

from autoremat.passes.remat import reorder, split

__all__ = ["reorder", "split"]
