"""The kernel lowering memo (pallas_kernels/lowering_memo.py): a kernel of this package is lowered once
per process for every program that calls it with the same shapes and parameters, and afresh when
anything it is made from differs. jax's lowering is stood in for here; on a GPU the memo wraps jax's."""
import dataclasses
import os
import types

import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import lowering_memo

OURS = os.path.join(os.path.dirname(pallas_kernels.__file__), "decode_matmul.py")


@dataclasses.dataclass
class FakeJaxpr:
    text: str
    source: str = f"kernel at {OURS}:10"

    @property
    def debug_info(self):
        return types.SimpleNamespace(func_src_info=self.source)

    def __str__(self):
        return self.text


def _counting_lower():
    calls = []

    def lower(*args, outer_traceback=None):
        calls.append(args)
        return object()      # a new module each time
    return lower, calls


def _args(jaxpr, grid=(4,), in_shapes=("f32[8,256]",), params="CompilerParams()", consts=()):
    return (None, ("x",), grid, (128, 1, 1), (), in_shapes, ("f32[8,128]",), jaxpr, params, consts)


def test_a_kernel_is_lowered_once_for_every_program_that_calls_it():
    lower, calls = _counting_lower()
    memoized = lowering_memo.memoize(lower)
    first = memoized(*_args(FakeJaxpr("{ lambda ; a. let b = dot a }")))
    again = memoized(*_args(FakeJaxpr("{ lambda ; a. let b = dot a }")), outer_traceback="another program")
    assert again is first and len(calls) == 1
    assert memoized.stats == {"hits": 1, "misses": 1}


@pytest.mark.parametrize("change", [
    dict(jaxpr=FakeJaxpr("{ lambda ; a. let b = add a }")),                  # another body
    dict(jaxpr=FakeJaxpr("{ lambda ; a. let b = dot a }", f"other at {OURS}:99")),   # another kernel's source
    dict(grid=(8,)), dict(in_shapes=("bf16[8,256]",)), dict(params="CompilerParams(approx_math=True)"),
    dict(consts=(np.arange(4),)),
], ids=["body", "source", "grid", "shapes", "params", "consts"])
def test_anything_the_module_is_made_from_lowers_afresh(change):
    lower, calls = _counting_lower()
    memoized = lowering_memo.memoize(lower)
    base = dict(jaxpr=FakeJaxpr("{ lambda ; a. let b = dot a }"))
    first = memoized(*_args(**base))
    other = memoized(*_args(**{**base, **change}))
    assert other is not first and len(calls) == 2


def test_kernels_from_elsewhere_are_never_memoized():
    lower, calls = _counting_lower()
    memoized = lowering_memo.memoize(lower)
    theirs = FakeJaxpr("{ lambda ; a. let b = dot a }", "kernel at /site-packages/someone/kernels.py:3")
    memoized(*_args(theirs))
    memoized(*_args(theirs))
    assert len(calls) == 2 and memoized.stats == {"hits": 0, "misses": 0}


def test_installed_on_the_jax_it_was_written_against():
    """Fails when a jax upgrade changes the function the memo wraps: then it would silently stop
    working (and a restarted server would lower every kernel again)."""
    from jax._src.pallas.mosaic_gpu import lowering
    assert lowering_memo.install()
    assert hasattr(lowering.lower_jaxpr_to_module, "stats")
