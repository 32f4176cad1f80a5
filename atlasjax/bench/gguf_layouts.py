"""GGUF-shaped presets: random weights laid out as a llama.cpp file of a given type loads.

`--quantization gguf-q4_k_m` (or gguf-q8_0, gguf-q4_0) on a preset quantizes each tensor into the
on-device layout the loader keeps that file's tensor in (`atlasjax.gguf_blocks.like_gguf`), with
the tensor types llama.cpp's quantizer picks for that file type (`llama_cpp_type`). So the bench
runs the kernels, the fusions and the LM head that a real file of that type would, without one.
The values are this quantizer's, not llama.cpp's: the bytes and the kernels are what is measured.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LAYOUTS = ("gguf-q4_k_m", "gguf-q8_0", "gguf-q4_0")
_BASE = {"gguf-q4_k_m": "Q4_K", "gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0"}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in the *_K_M types:
    the first and last eighth, and every third layer between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def llama_cpp_type(layout: str, projection: str, layer: int | None, num_layers: int) -> str:
    """The GGML type llama.cpp stores a projection in for a file type (llama-quant.cpp's choice for
    Llama-shaped models): `projection` is q/k/v/o_proj, gate/up/down_proj or "lm_head"."""
    if layout not in _BASE:
        raise ValueError(f"unknown GGUF layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    base = _BASE[layout]
    if projection == "lm_head":   # output.weight: Q6_K unless the file type is Q8_0
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if layout == "gguf-q4_k_m" and projection in ("v_proj", "down_proj") and use_more_bits(layer, num_layers):
        return "Q6_K"
    return base


def quantize_like_gguf(params: Mapping[str, Any], layout: str, num_layers: int) -> dict[str, Any]:
    """The param tree with every projection kernel (and the untied LM head) in the layout a GGUF file
    of type `layout` loads into; embeddings and norms unchanged."""
    from atlasjax.gguf_blocks import like_gguf  # noqa: PLC0415
    from atlasjax.quantization import is_lm_head_kernel, is_projection_kernel, map_params  # noqa: PLC0415

    def lay_out(path: tuple[str, ...], leaf: Any) -> Any:
        if is_lm_head_kernel(path, leaf):
            return like_gguf(leaf, llama_cpp_type(layout, "lm_head", None, num_layers))
        if is_projection_kernel(path, leaf):   # layers_<i>/<module>/<projection>/kernel
            return like_gguf(leaf, llama_cpp_type(layout, path[-2], int(path[0].removeprefix("layers_")), num_layers))
        return leaf

    return map_params(params, lay_out)
