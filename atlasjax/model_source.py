"""Resolve what the engine loads: the embedded default, a path, and optional quantization at load."""
from __future__ import annotations

from atlasjax.default_model import ensure_default_model
from atlasjax.loader import LoadedModel, load_model



def quantizing_converter(fmt: str, quantize_lm_head: bool = False, group_size: int | None = None,
                         symmetric: bool | None = None):
    """convert(path, array) for assemble_params: quantize linear projections (and, with
    quantize_lm_head, the untied LM head `lm_head/kernel`), leave the rest. Embeddings are never
    quantized, so a tied LM head (the embedding table) never is either. group_size / symmetric: None
    takes the format's default (int4 asymmetric, groups of 128; int8 and fp8 per channel)."""
    from atlasjax.quantization import quantization_predicate, quantize  # noqa: PLC0415
    include = quantization_predicate(quantize_lm_head)

    def convert(path, array):
        if include(path, array):
            return quantize(array, fmt, group_size=group_size, symmetric=symmetric)
        return None
    return convert


def smooths_int8_activations(config) -> bool:
    """Whether the engine quantizes a float checkpoint to int8 itself after smoothing its activations
    for int8 W8A8 (atlasjax/smoothing.py): `quantization="int8"` with `activation_quantization="int8"`,
    in one process (one device, or tensor parallelism on one host). The checkpoint then loads as
    floats and is quantized once smoothed."""
    from atlasjax import distributed  # noqa: PLC0415
    return (config.quantization == "int8" and config.activation_quantization == "int8"
            and not distributed.is_multiprocess())


def load_for_engine(config, dtype) -> LoadedModel:
    """Load config.model; with tensor_parallel_size > 1, sharded over a new mesh while it loads. An fp8
    KV cache (config.kv_cache_dtype) takes the checkpoint's calibrated KV-cache scales into the weights."""
    import jax  # noqa: PLC0415

    from atlasjax.engine_config import resolve_kv_cache_dtype  # noqa: PLC0415
    from pallas_kernels.kv_write import is_fp8  # noqa: PLC0415
    if config.load_format == "dummy":
        return dummy_model(config, dtype)
    path = config.model or ensure_default_model()
    at_load = config.quantization and not smooths_int8_activations(config)   # else quantized once smoothed
    convert = quantizing_converter(config.quantization, config.quantize_lm_head, config.quantization_group_size,
                                   config.quantization_symmetric) if at_load else None
    if config.activation_quantization == "int8" and config.quantization == "int8" and at_load:
        import logging  # noqa: PLC0415
        logging.getLogger("atlasjax.engine").info(
            "int8 activations on several hosts: the weights are quantized as they load, without "
            "smoothing (it calibrates in one process)")
    keep = config.keep_gguf_quantized
    if keep is None:
        keep = jax.default_backend() == "gpu"
    mesh = None
    if config.tensor_parallel_size > 1:
        from atlasjax.sharding import make_mesh  # noqa: PLC0415
        mesh = make_mesh(config.tensor_parallel_size)
    kv_cache_fp8 = is_fp8(resolve_kv_cache_dtype(config.kv_cache_dtype, dtype))
    loaded = load_model(path, dtype, convert, keep_gguf_quantized=keep, mesh=mesh, kv_cache_fp8=kv_cache_fp8)
    if config.quantize_lm_head:
        from atlasjax.quantization import warn_if_tied_lm_head  # noqa: PLC0415
        warn_if_tied_lm_head(loaded.config, True)
    return loaded


def dummy_model(config, dtype) -> LoadedModel:
    """load_format="dummy" (vLLM's): the architecture of config.model's config.json with random weights built on
    the device (quantized as they are made, with config.quantization), and its tokenizer if it has one; no
    weight file is read, so a published model's shapes can be served or benchmarked from its config alone."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from atlasjax.config import from_hf_config  # noqa: PLC0415
    from atlasjax.errors import CheckpointError, EngineConfigError  # noqa: PLC0415
    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    path = config.model or ensure_default_model()
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise EngineConfigError(f"load_format='dummy' builds random weights for a Hugging Face config.json; "
                                f"{path} has none")
    try:
        with open(config_path) as f:
            cfg = from_hf_config(json.load(f))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {config_path}: {e}") from e
    tokenizer = Tokenizer.from_dir(path, cfg.eos_token_ids)
    return random_model(cfg, dtype, config.seed, config.tensor_parallel_size, tokenizer, f"{path} (dummy weights)",
                        config.quantization, config.quantize_lm_head, config.quantization_group_size,
                        config.quantization_symmetric)


def random_model(cfg, dtype, seed: int, tensor_parallel_size: int, tokenizer, source: str, quantization=None,
                 quantize_lm_head: bool = False, group_size: int | None = None, symmetric: bool | None = None
                 ) -> LoadedModel:
    """A LoadedModel of random weights for `cfg`, built on the device (threefry: the same values on one device or
    sharded over a tensor-parallel mesh), each quantized as it is made with `quantization` (then split)."""
    from atlasjax.loader import random_params  # noqa: PLC0415
    from atlasjax.step_options import use_process_flags  # noqa: PLC0415
    use_process_flags(tensor_parallel_size)   # before the weights start the jax backend
    plan = None
    if tensor_parallel_size > 1 and not quantization:
        from atlasjax.sharding import TensorParallel, make_mesh  # noqa: PLC0415
        plan = TensorParallel(make_mesh(tensor_parallel_size), cfg)
    if quantization:
        from atlasjax.engine_config import check_quantization_layout  # noqa: PLC0415
        from atlasjax.quantization import leaf_quantizer, warn_if_tied_lm_head  # noqa: PLC0415
        check_quantization_layout(quantization, group_size, symmetric)
        params = random_params(cfg, dtype, seed, plan, each=leaf_quantizer(
            quantization, group_size=group_size, symmetric=symmetric, quantize_lm_head=quantize_lm_head))
        warn_if_tied_lm_head(cfg, quantize_lm_head)
    else:
        params = random_params(cfg, dtype, seed, plan)
    loaded = LoadedModel(cfg, params, tokenizer=tokenizer, source=source, plan=plan)
    return shard_loaded(loaded, tensor_parallel_size, dtype)   # quantized: split after quantizing


def with_user_settings(loaded: LoadedModel, config, chat_template: str | None) -> LoadedModel:
    """The loaded model with what the user set beside its own files: `config.tokenizer` instead of the model's,
    `chat_template` (read by `read_chat_template`) instead of the tokenizer's, the generation_config.json
    defaults that `config.generation_config` selects, unless the model carries them already (a saved checkpoint), with
    `config.override_generation_config` over them, and `config.hf_overrides` (RoPE and positions over the model's
    config; a classifier head)."""
    import dataclasses  # noqa: PLC0415
    import logging  # noqa: PLC0415

    from atlasjax import generation_config  # noqa: PLC0415
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    if config.tokenizer is not None:
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer_for(config.tokenizer, loaded.config))
    if chat_template is not None:
        if loaded.tokenizer is None:
            raise EngineConfigError("a chat template needs the model's tokenizer, and this model has none")
        loaded = dataclasses.replace(loaded, tokenizer=loaded.tokenizer.with_chat_template(chat_template))
    if loaded.generation is None:
        loaded = dataclasses.replace(loaded, generation=generation_config.resolve(config.generation_config,
                                                                                    loaded.source))
    loaded = dataclasses.replace(loaded, generation=generation_config.with_overrides(
        loaded.generation, config.override_generation_config))
    if loaded.generation:
        logging.getLogger("atlasjax.engine").info("%s: defaults from %s: %s", loaded.source,
                                                  loaded.generation.source, loaded.generation.describe())
    from atlasjax.cross_encoder import head_from_tokens, is_classifier  # noqa: PLC0415
    from atlasjax.hf_overrides import with_model_overrides  # noqa: PLC0415
    loaded = dataclasses.replace(loaded, config=with_model_overrides(loaded.config, config.hf_overrides))
    if is_classifier(config.hf_overrides):    # a causal LM read as a classifier / reranker (atlasjax/cross_encoder.py)
        head = head_from_tokens(loaded.params, loaded.config.tie_word_embeddings, loaded.tokenizer,
                                config.hf_overrides)
        loaded = dataclasses.replace(loaded, classifier=head)
    return loaded


def tokenizer_for(path: str, cfg):
    """The tokenizer in directory `path` for a model of config `cfg` (vLLM's --tokenizer), refused with the reason
    when there is none or when it has more tokens than the model's embedding has rows."""
    import os  # noqa: PLC0415

    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    tok = Tokenizer.from_dir(path, cfg.eos_token_ids) if os.path.isdir(path) else None
    if tok is None:
        raise EngineConfigError(f"tokenizer={path!r}: no tokenizer.json there (a directory as a Hugging Face "
                                "model ships it)")
    if tok.vocab_size > cfg.vocab_size:
        raise EngineConfigError(f"tokenizer={path!r} has {tok.vocab_size} tokens; the model's vocabulary has "
                                f"{cfg.vocab_size}")
    return tok


def with_weight_settings(params, config, cfg, tokenizer, dtype, kv_dtype, max_len: int, plan=None):
    """The loaded params with the engine's settings that change weights, not how they load:
    int8 quantization after smoothing for int8 activations (`smooths_int8_activations`),
    `calculate_kv_scales` (scales measured at start and folded in, atlasjax/kv_calibration.py), both
    on one device's model (under tensor parallelism, `plan`, the tree gathered to one device, then
    placed again); and `activation_quantization` (per-channel fp8 / int8 weights marked for 8-bit
    activations; a model without them is a configuration error, not a silent no-op)."""
    import logging  # noqa: PLC0415

    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    smooths = smooths_int8_activations(config) and has_float_projections(params)
    if smooths or config.calculate_kv_scales:
        params = _on_one_device(plan, cfg, dtype, params, lambda params: _calibrated(
            params, config, cfg, tokenizer, dtype, kv_dtype, max_len, smooths))
    if config.activation_quantization:
        from atlasjax.quantization import with_activations  # noqa: PLC0415
        from pallas_kernels.w8a8 import MIN_ROWS  # noqa: PLC0415
        acts = config.activation_quantization
        params, count = with_activations(params, acts)
        if not count:
            raise EngineConfigError(
                f"activation_quantization={acts} needs {acts} weights with one scale per output channel "
                f"(quantization='{acts}', or an {acts.upper()} checkpoint quantized per channel); this model "
                "has none")
        logging.getLogger("atlasjax.engine").info("%d %s weights take %s activations from %d rows on",
                                                  count, acts, acts, MIN_ROWS)
    return params


def _calibrated(params, config, cfg, tokenizer, dtype, kv_dtype, max_len: int, smooths: bool):
    """One device's params after the settings that measure the model on the calibration text: the
    smoothing and int8 quantization for int8 activations, then `calculate_kv_scales`."""
    if smooths:
        from atlasjax.quantization import quantize_params  # noqa: PLC0415
        from atlasjax.smoothing import smooth_for_int8_activations  # noqa: PLC0415
        params = smooth_for_int8_activations(cfg, params, tokenizer, dtype, max_len)
        params = quantize_params(params, "int8", symmetric=config.quantization_symmetric,
                                 quantize_lm_head=config.quantize_lm_head)
    if config.calculate_kv_scales:
        from atlasjax.kv_calibration import calculate_kv_scales  # noqa: PLC0415
        params = calculate_kv_scales(cfg, params, tokenizer, dtype, kv_dtype, max_len)
    return params


def _on_one_device(plan, cfg, dtype, params, change):
    """change(params) on one device's tree. A tensor-parallel tree (`plan`, one process) is gathered in
    checkpoint layout onto the first device, changed there, and placed on the mesh again, so each
    shard holds what one device's engine would (the whole model sits on the first device meanwhile;
    both moves go device to device, not through the host)."""
    if plan is None:
        return change(params)
    import jax  # noqa: PLC0415

    from atlasjax import distributed  # noqa: PLC0415
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    from atlasjax.sharding import logical_axes  # noqa: PLC0415
    if distributed.is_multiprocess():
        raise EngineConfigError("calculate_kv_scales=True runs in one process; on several hosts, load a "
                                "checkpoint with calibrated k_scale / v_scale")
    first = jax.devices()[0]
    check_fits_one_device(sum(leaf.nbytes for leaf in jax.tree.leaves(params)), first)
    logical = logical_axes(cfg, dtype)
    one_device = change(plan.gather(params, logical, device=first))
    return plan.shard_params(one_device, logical)


def check_fits_one_device(nbytes: int, device, headroom: float = 1.1) -> None:
    """Refuse, before anything moves, a calibration whose model cannot sit whole on `device` beside its
    shard (a device that reports no memory statistics, such as the CPU, is not checked)."""
    from atlasjax.device_memory import memory_stats  # noqa: PLC0415
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    stats = memory_stats(device)
    if not stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if nbytes * headroom > free:
        raise EngineConfigError(
            f"the calibration at start (calculate_kv_scales, or smoothing for int8 activations) runs on the "
            f"whole model on one device: {nbytes / 2**30:.1f} GiB, and {device} has {free / 2**30:.1f} GiB free. "
            "Load a checkpoint with calibrated k_scale / v_scale, or one saved smoothed and quantized "
            "(`atlasjax save` on a machine where it fits)")


def has_float_projections(params) -> bool:
    """Whether any linear projection of the tree is still a float array (not quantized yet)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from atlasjax.quantization import is_projection_kernel, map_params  # noqa: PLC0415
    found = []
    map_params(params, lambda path, leaf: found.append(
        is_projection_kernel(path, leaf) and isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)))
    return any(found)


def shard_loaded(loaded: LoadedModel, tensor_parallel_size: int, dtype) -> LoadedModel:
    """A model loaded on one device (e.g. a benchmark preset), placed over a tensor-parallel mesh."""
    import dataclasses  # noqa: PLC0415

    from atlasjax.sharding import TensorParallel, logical_axes, make_mesh  # noqa: PLC0415
    if tensor_parallel_size == 1 or loaded.plan is not None:
        return loaded
    plan = TensorParallel(make_mesh(tensor_parallel_size), loaded.config)
    return dataclasses.replace(loaded, params=plan.shard_params(loaded.params, logical_axes(loaded.config, dtype)),
                               plan=plan)
