"""Resolve what the engine loads: the embedded default, a path, and optional quantization at load."""
from __future__ import annotations

from atlasjax.default_model import ensure_default_model
from atlasjax.loader import LoadedModel, load_model



def quantizing_converter(fmt: str):
    """convert(path, array) for assemble_params: quantize linear projections, leave the rest."""
    from atlasjax.quantization import is_projection_kernel, quantize  # noqa: PLC0415

    def convert(path, array):
        if is_projection_kernel(path, array):
            # int4: asymmetric (scale + offset per group of 128), clearly better than symmetric for RTN.
            return quantize(array, fmt, symmetric=fmt != "int4")
        return None
    return convert


def load_for_engine(config, dtype) -> LoadedModel:
    path = config.model or ensure_default_model()
    convert = quantizing_converter(config.quantization) if config.quantization else None
    keep = config.keep_gguf_quantized
    if keep is None:
        import jax  # noqa: PLC0415
        keep = jax.default_backend() == "gpu"
    return load_model(path, dtype, convert, keep_gguf_quantized=keep)
