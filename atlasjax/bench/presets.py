"""Model presets (published architectures with random weights) and building an engine for a benchmark.

A preset is a `ModelConfig` with the exact shapes of a published checkpoint, so the bytes, FLOPs
and kernels match the real model while nothing is downloaded: `load_preset` builds the weights
directly on the device with `atlasjax.loader.random_params`. The config table is plain Python
(no jax), so the HF comparison subprocess can read it without initializing a JAX backend.
"""
from __future__ import annotations

import sys

from atlasjax.bench.gguf_layouts import LAYOUTS as GGUF_LAYOUTS
from atlasjax.config import ModelConfig, RopeScaling

_LLAMA3 = dict(family="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
               bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


PRESETS: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                                num_kv_heads=8, head_dim=64, rope_scaling=_llama3_rope(32.0),
                                tie_word_embeddings=True),
    "llama-3.2-3b": ModelConfig(**_LLAMA3, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                                num_kv_heads=8, head_dim=128, rope_scaling=_llama3_rope(32.0),
                                tie_word_embeddings=True),
    "llama-3.1-8b": ModelConfig(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                                num_kv_heads=8, head_dim=128, rope_scaling=_llama3_rope(8.0),
                                tie_word_embeddings=False),
    "qwen3-8b": ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                            qk_norm=True, eos_token_ids=(151645,)),
    # Qwen3-Embedding-0.6B (Qwen3-0.6B's architecture; its vocabulary)
    "qwen3-embedding-0.6b": ModelConfig(family="qwen3", vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                                        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                                        rope_theta=1000000.0, max_position_embeddings=32768,
                                        tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151643,)),
    # the embedded default (SmolLM2-135M-Instruct)
    "smollm2-135m": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,)),
    # for tests: compiles in about a second on a CPU
    "tiny": ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                        tie_word_embeddings=False),
}


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def quantization_available() -> bool:
    try:
        import atlasjax.quantization  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def synthetic_tokenizer(cfg: ModelConfig):
    """A word-level tokenizer for a preset: token i is the word "w{i}" (unknown words: w0).

    Every token decodes to non-empty text, so servers stream one chunk per token and text
    prompts ("w17 w4 ...") work; detokenization costs what a small real tokenizer costs.
    """
    import tokenizers  # noqa: PLC0415

    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    model = tokenizers.models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, eos_token_ids=cfg.eos_token_ids)


def load_preset(name: str, dtype, quantization: str | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                quantize_lm_head: bool = False, group_size: int | None = None, symmetric: bool | None = None):
    """LoadedModel with random weights of preset `name`, built on the default device, or built
    sharded over a tensor-parallel mesh (the same values either way: threefry is sharding-invariant).
    quantize_lm_head: with `quantization`, the untied LM head is quantized too (see EngineConfig).
    group_size, symmetric: EngineConfig's quantization_group_size and quantization_symmetric."""
    from atlasjax.loader import LoadedModel, random_params  # noqa: PLC0415
    from atlasjax.model_source import random_model, shard_loaded  # noqa: PLC0415
    if quantize_lm_head and not quantization:
        from atlasjax.errors import EngineConfigError  # noqa: PLC0415
        raise EngineConfigError("quantize_lm_head=True needs quantization (int8, fp8 or int4)")
    cfg = PRESETS[name]
    if quantization in GGUF_LAYOUTS:   # as a llama.cpp file of that type loads, its LM head included
        from atlasjax.bench.gguf_layouts import quantize_like_gguf  # noqa: PLC0415
        from atlasjax.step_options import use_process_flags  # noqa: PLC0415
        use_process_flags(tensor_parallel_size)
        params = quantize_like_gguf(random_params(cfg, dtype, seed), quantization, cfg.num_layers)
        loaded = LoadedModel(cfg, params, tokenizer=synthetic_tokenizer(cfg), source=f"preset:{name}")
        return shard_loaded(loaded, tensor_parallel_size, dtype)
    return random_model(cfg, dtype, seed, tensor_parallel_size, synthetic_tokenizer(cfg), f"preset:{name}",
                        quantization, quantize_lm_head, group_size, symmetric)


def weights_label(quantization: str | None, quantize_lm_head: bool = False, activations: str | None = None
                  ) -> str | None:
    """How the bench names a weight format in its tables: "int8", "int8 + LM head", "fp8 W8A8" (fp8
    activations; int8 alike), "gguf-q4_k_m" (its LM head as the file has it), or None (unquantized)."""
    if not quantization:
        return None
    if quantization in GGUF_LAYOUTS:
        return quantization
    label = f"{quantization} + LM head" if quantize_lm_head else quantization
    return f"{label} W8A8" if activations and activations == quantization else label


def args_weights_label(args) -> str | None:
    """`weights_label` of the formats the bench's flags name."""
    return weights_label(args.quantization, args.quantize_lm_head, getattr(args, "activation_quantization", None))


def build_engine(args, **overrides):
    """An LLMEngine from the common bench flags (`--preset` or `--model`, engine flags); overrides win."""
    import jax  # noqa: PLC0415

    from atlasjax.__main__ import long_context_decode_setting  # noqa: PLC0415
    from atlasjax.engine import LLMEngine, resolve_dtype  # noqa: PLC0415
    from atlasjax.engine_config import EngineConfig  # noqa: PLC0415
    if args.quantization and not quantization_available():
        raise SystemExit("--quantization is unavailable: atlasjax.quantization cannot be imported")
    if args.quantization in GGUF_LAYOUTS and not args.preset:
        raise SystemExit(f"--quantization {args.quantization} lays out a --preset's random weights as that GGUF "
                         "type loads; a .gguf --model loads its own layout (leave --quantization unset)")
    kw = dict(model=args.model, load_format=getattr(args, "load_format", None), dtype=args.dtype,
              kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
              calculate_kv_scales=getattr(args, "calculate_kv_scales", False) or None,
              max_num_seqs=args.max_num_seqs,
              decode_batch_sizes=getattr(args, "decode_batch_sizes", None), max_model_len=args.max_model_len,
              page_size=args.page_size, num_pages=args.num_pages, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
              enable_prefix_caching=not args.no_prefix_caching, attention_backend=args.attention_backend,
              long_context_decode=long_context_decode_setting(args),
              async_scheduling=not getattr(args, "no_async_scheduling", False),
              num_scheduler_steps=getattr(args, "num_scheduler_steps", None),
              quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
              activation_quantization=getattr(args, "activation_quantization", None),
              quantization_group_size=getattr(args, "quantization_group_size", None),
              quantization_symmetric=getattr(args, "quantization_symmetric", None),
              seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              speculative_config=getattr(args, "speculative_config", None),
              hf_overrides=getattr(args, "hf_overrides", None),
              enable_lora=getattr(args, "enable_lora", False) or None, max_loras=getattr(args, "max_loras", None),
              max_lora_rank=getattr(args, "max_lora_rank", None),
              compile_at_start=getattr(args, "compile_at_start", False) or None)
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None}     # unset flags: EngineConfig's defaults
    loaded = None
    if args.preset:
        quantize_lm_head = kw.pop("quantize_lm_head", False)
        group_size, symmetric = kw.pop("quantization_group_size", None), kw.pop("quantization_symmetric", None)
        kw["quantization"] = None    # the preset is quantized here, not by the checkpoint loader
        label = args_weights_label(args)
        what = f"preset {args.preset}" + (f" ({label})" if label else "")
        progress(f"building {what} with random weights on {jax.devices()[0].device_kind}")
        loaded = load_preset(args.preset, resolve_dtype(args.dtype), args.quantization, args.seed,
                             args.tensor_parallel_size, quantize_lm_head=quantize_lm_head, group_size=group_size,
                             symmetric=symmetric)
        jax.block_until_ready(loaded.params)
    else:
        progress(f"loading {args.model or 'the embedded default model'}")
    return LLMEngine(EngineConfig(**kw), loaded=loaded)


def model_config(args) -> ModelConfig:
    """The ModelConfig the flags name, without loading weights (HF dirs: config.json)."""
    if args.preset:
        return PRESETS[args.preset]
    if args.model and not args.model.endswith(".gguf"):
        from atlasjax import hub  # noqa: PLC0415
        from atlasjax.config import load_hf_config  # noqa: PLC0415
        return load_hf_config(hub.resolve(args.model))
    if args.model is None:
        return PRESETS["smollm2-135m"]
    raise SystemExit("this needs the model's shape: pass --preset, or --model with a Hugging Face directory")
