"""Private torch APIs: Inductor: its compilers, settings and the configuration the memory model reads (listed in the package docstring)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["ORDERS_TAG", "has_triton", "inductor_compilers", "inductor_cpp_compiler", "inductor_kernel_probe", "inductor_max_pointwise_cat_inputs", "inductor_realize_reads_threshold", "inductor_vector_width"]


def inductor_compilers() -> tuple[Callable, Callable, dict]:
    """Inductor's forward and backward compilers for aot_autograd, and its decomposition table."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    fw = _with_our_settings(compile_fx_inner)
    with config.patch(fallback_random=True):  # the table Inductor decomposes with under the compile's settings
        table = select_decomp_table()
    return fw, _with_our_settings(functools.partial(compile_fx_inner, is_backward=True)), table


def inductor_vector_width() -> int:
    """Bits of the vector ISA Inductor's CPU code generator uses here (after ATEN_CPU_CAPABILITY); 0 for none."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return int(isa.bit_width()) if isa else 0


def _with_our_settings(compile_fn: Callable) -> Callable:
    """compile_fn with config.cpp.simdlen set to the width Inductor would pick anyway, with
    config.layout_optimization off, and with the kernel orders Inductor tries for peak memory cut to
    the two the memory model knows (module docstring).

    Pinning simdlen leaves the generated code as it was; the FX graph cache key then says which vector
    ISA it is for. A simdlen the user set is left alone. Cutting the kernel orders can change the
    code (the order its kernels run in); `_orders_the_model_knows` keeps that code apart in the cache.
    Without layout optimisation every value keeps the strides the graph was traced with, eager's: a
    dropout mask is drawn in eager's order, and no layout copies that the memory model does not know
    of are made. With fallback_random every random op (rand, randn, randint, bernoulli and their `_like`
    forms) runs eager's own kernel on torch's generator: the draws are eager's, in eager's stream, and a
    graph that calls them lowers at all (Inductor's own random lowering needs its joint-graph pass, which
    autoremat's partitioner takes the place of).
    """
    from torch._inductor import config

    @functools.wraps(compile_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        patch: dict[str, Any] = {"layout_optimization": False, "fallback_random": True}
        if config.cpp.simdlen is None:
            patch["cpp.simdlen"] = inductor_vector_width()
        with config.patch(patch), _orders_the_model_knows():
            return compile_fn(*args, **kwargs)
    return run


ORDERS_TAG = "autoremat: reorder_for_peak_memory weighs the graph's order and lpmf only (1)"


@contextlib.contextmanager
def _orders_the_model_knows() -> Iterator[None]:
    """While Inductor compiles one of autoremat's graphs, its peak-memory reordering weighs the graph's
    own order against least-peak-first only. The scheduler imports `reorder_for_peak_memory` from
    torch._inductor.memory when it runs, so the module attribute is what it calls.

    The FX graph cache key does not see that attribute, so code cached without it (by an older autoremat,
    or by torch.compile on the same graph) would be reused. The key does include the uuid of
    config.post_grad_custom_post_pass: a pass that runs the user's own (if any) and whose uuid adds
    ORDERS_TAG keeps the two apart."""
    from torch._inductor import config, memory
    from torch._inductor.custom_graph_pass import CustomGraphPass

    users = config.post_grad_custom_post_pass  # None, a pass, or (torch 2.13) a list of passes
    theirs = list(users) if isinstance(users, (list, tuple)) else [] if users is None else [users]

    class Tagged(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in theirs:
                p(graph)

        def uuid(self) -> Any:
            ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in theirs]
            if None in ids:
                return None  # a pass of theirs Inductor cannot key: it bypasses its cache, as it would anyway
            return (ORDERS_TAG, *ids) if ids else ORDERS_TAG

    original = memory.reorder_for_peak_memory
    memory.reorder_for_peak_memory = functools.partial(original, methods=[memory.topological_sort_lpmf])
    try:
        with config.patch(post_grad_custom_post_pass=Tagged()):
            yield
    finally:
        memory.reorder_for_peak_memory = original


def inductor_kernel_probe() -> None:
    """Compile and run one small CPU kernel (pointwise ops into a reduction) through `inductor_compilers`.

    Raises what Inductor raises when its generated C++ does not build or load here.
    """
    from torch._functorch.aot_autograd import aot_function

    fw, _, table = inductor_compilers()
    x = torch.arange(64, dtype=torch.float32)  # long enough for vector code with a scalar tail
    fn = aot_function(lambda t: ((t * 0.5).sin() + 1.0).sum(), fw_compiler=fw, decompositions=table)
    with torch.no_grad():
        got = fn(x)
    want = ((x * 0.5).sin() + 1.0).sum()
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"Inductor's probe kernel computed {got.item()} instead of {want.item()}")


def inductor_cpp_compiler() -> str:
    """The C++ compiler Inductor's CPU backend calls (a path or a name); raises when none is found."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def inductor_realize_reads_threshold() -> int:
    """Readers of a pointwise value beyond which Inductor stores it instead of inlining it."""
    from torch._inductor import config

    return int(config.realize_reads_threshold)


def inductor_max_pointwise_cat_inputs() -> int:
    """Inputs up to which Inductor may lower a cat on a GPU as one pointwise kernel (beyond: a ConcatKernel)."""
    from torch._inductor import config

    # torch 2.13 splits the limit in two (complex inputs, simple inputs); a cat is a ConcatKernel past both
    return max(int(config.max_pointwise_cat_inputs), int(getattr(config, "max_complex_pointwise_cat_inputs", 0)))


def has_triton() -> bool:
    """Whether Triton imports and supports a device here (what Inductor's GPU backend needs)."""
    from torch.utils._triton import has_triton as triton_here

    return bool(triton_here())
