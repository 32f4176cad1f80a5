"""The kernel lowering memo (pallas_kernels/lowering_memo.py, on unless switched off): a kernel is lowered once per
process for every program that calls it with the same shapes and parameters, and afresh when anything
it is made from differs. jax's lowering is stood in for here; on a GPU the memo wraps jax's."""
import dataclasses
import os
import types

import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import lowering_memo

OURS = os.path.join(os.path.dirname(pallas_kernels.__file__), "decode_matmul.py")   # a kernel's source


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


def test_a_kernel_without_a_key_is_lowered_as_jax_would():
    class Unprintable(FakeJaxpr):
        def __str__(self):
            raise TypeError("no printer for this")
    lower, calls = _counting_lower()
    memoized = lowering_memo.memoize(lower)
    memoized(*_args(Unprintable("")))
    memoized(*_args(Unprintable("")))
    assert len(calls) == 2 and memoized.stats == {"hits": 0, "misses": 0}


@pytest.mark.parametrize("value", ["off", "0", "False", " OFF "])
def test_switched_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv("ATLASJAX_KERNEL_LOWERING_MEMO", value)
    assert not lowering_memo.enabled() and not lowering_memo.install()


@pytest.mark.parametrize("value", [None, "on", "1", "true"])
def test_on_by_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("ATLASJAX_KERNEL_LOWERING_MEMO", raising=False)
    else:
        monkeypatch.setenv("ATLASJAX_KERNEL_LOWERING_MEMO", value)
    assert lowering_memo.enabled()


def test_installed_on_the_jax_it_was_written_against(monkeypatch):
    """Fails when a jax upgrade changes the function the memo wraps: then it would silently stop
    working (and a restarted server would lower every kernel again)."""
    from jax._src.pallas.mosaic_gpu import lowering
    monkeypatch.setenv("ATLASJAX_KERNEL_LOWERING_MEMO", "on")
    monkeypatch.setattr(lowering, "lower_jaxpr_to_module", lowering.lower_jaxpr_to_module)  # undone after
    monkeypatch.setattr(lowering_memo, "_installed", False)
    assert lowering_memo.stats() is None
    assert lowering_memo.install()
    assert hasattr(lowering.lower_jaxpr_to_module, "stats")
    assert lowering_memo.stats() == {"hits": 0, "misses": 0}     # what the warm-up's summary line reports


def _traced_kernel(n: int):
    """The kernel jaxpr and mesh jax hands to Mosaic GPU lowering for a decode matmul [8, 256] x [256, n],
    from a fresh trace (traced on this CPU: the lowering itself needs a GPU)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.decode_matmul import decode_matmul
    x, w = jnp.ones((8, 256), jnp.bfloat16), jnp.ones((256, n), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda x, w: decode_matmul(x, w, interpret=False))(x, w)

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "mpmd_map":
                return eqn
            for value in eqn.params.values():
                for inner in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns") and (found := find(inner)):
                        return found
    eqn = find(closed.jaxpr)
    [mesh], [kernel] = eqn.params["meshes"], eqn.params["jaxprs"]
    return lowering_memo.kernel_key(None, mesh.grid_names, mesh.grid, (128, 1, 1), mesh.cluster,
                                    [v.aval for v in eqn.invars], eqn.params["out_avals"], kernel,
                                    eqn.params["compiler_params"], ())


def test_a_real_kernel_keys_alike_in_every_trace_and_apart_at_other_shapes():
    """What makes the memo hit: the same kernel traced for two programs gives the same key."""
    assert _traced_kernel(256) == _traced_kernel(256)
    assert _traced_kernel(256) != _traced_kernel(384)
