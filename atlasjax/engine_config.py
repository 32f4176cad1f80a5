"""EngineConfig: how the engine is sized (slots, pages, buckets), validated on construction."""
from __future__ import annotations

import dataclasses
import os

from atlasjax.errors import EngineConfigError
from atlasjax.generation_config import check_setting, parse_overrides
from atlasjax.hf_overrides import parse_hf_overrides
from atlasjax.lora import check_config as check_lora_config
from atlasjax.pooling import POOLING_TYPES
from atlasjax.speculative import SpeculativeConfig

RUNNERS = ("auto", "generate", "pooling")
from atlasjax.waiting_queue import SCHEDULING_POLICIES

# interpret: the Pallas kernels in Mosaic GPU interpret mode (slow; for checking them on a CPU)
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "interpret")


# Decode iterations per launch on a GPU unless told: issuing a step costs the host 2-3 ms there (XLA's
# launch of a ~400-kernel step), longer than a small or quantized model's step runs on the device.
GPU_SCHEDULER_STEPS = 4

# Prefill steps that record prompt logprobs run one token count, this or the budget if smaller: the logits of
# every row ([tokens, vocab] f32 and their log_softmax) stay small next to the KV pool, and the step is one
# shape that the warm-up compiles. Such a request's prompt prefills in chunks of at most this many tokens.
PROMPT_LOGPROBS_TOKENS = 512


# The KV pool's dtype (vLLM's --kv-cache-dtype): auto is the model's dtype; fp8 (= fp8_e4m3) halves a
# bf16 pool's bytes per token, so twice the tokens fit and decode attention reads half the bytes.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_kv_cache_dtype(name: str, model_dtype):
    """EngineConfig.kv_cache_dtype as a jnp dtype, for a model computing in `model_dtype`."""
    import jax.numpy as jnp  # noqa: PLC0415 (this module stays importable without starting jax)
    return jnp.dtype({"auto": model_dtype, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
                      "fp8_e5m2": jnp.float8_e5m2}.get(name, name))


GROUPED_FORMATS = ("int4", "int8")   # formats quantized at load that take a group size (fp8: per channel)


def check_quantization_layout(quantization: str | None, group_size, symmetric) -> None:
    """EngineConfig's quantization_group_size / quantization_symmetric against the format they apply to."""
    def bad(msg):
        raise EngineConfigError(msg)
    if (group_size is not None or symmetric is not None) and quantization is None:
        bad("quantization_group_size and quantization_symmetric need quantization (int8, fp8 or int4)")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16
                                   or group_size & (group_size - 1)):
        bad(f"quantization_group_size must be a power of two >= 16, got {group_size!r}")
    if group_size is not None and quantization not in GROUPED_FORMATS:
        bad(f"{quantization} weights have one scale per output channel; quantization_group_size is for int4 and int8")
    if symmetric is not None and not isinstance(symmetric, bool):
        bad(f"quantization_symmetric must be True, False or None, got {symmetric!r}")
    if symmetric is False and quantization != "int4":
        bad(f"{quantization} weights are symmetric; zero points (quantization_symmetric=False) are int4's")


LOAD_FORMATS = ("auto", "dummy")


ALLOW_LONG_MAX_MODEL_LEN = "ATLASJAX_ALLOW_LONG_MAX_MODEL_LEN"
DEFAULT_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, model_config) -> int:
    """The context length an engine serves: `requested`, or the model's longest (`ModelConfig.max_positions`)
    up to 4,096. Longer than the model's is refused, as vLLM refuses it, unless ATLASJAX_ALLOW_LONG_MAX_MODEL_LEN=1."""
    longest = model_config.max_positions
    if requested is None:
        return min(longest, DEFAULT_MAX_MODEL_LEN)
    if requested > longest and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "") not in ("1", "true", "True"):
        rs = model_config.rope_scaling
        if longest == model_config.sliding_window:
            why = (f"its sliding-window attention spans {longest} tokens, and atlasjax attends to the whole "
                   "context")
        elif rs.rope_type == "yarn":
            why = (f"its yarn RoPE scaling stretches {rs.original_max_position_embeddings} positions "
                   f"{rs.factor:g} times")
        elif rs.rope_type == "linear":
            why = f"its {model_config.max_position_embeddings} positions, stretched {rs.factor:g} times"
        else:
            why = ("its max_position_embeddings; a RoPE scaling stretches them, e.g. yarn with --hf-overrides "
                   "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                   f"\"original_max_position_embeddings\": {model_config.max_position_embeddings}}}}}'")
        raise EngineConfigError(
            f"max_model_len {requested} is longer than the model's {longest} tokens ({why}). Set "
            f"{ALLOW_LONG_MAX_MODEL_LEN}=1 to run it anyway: its output past them is likely garbage")
    return requested


def resolve_scheduler_steps(num_scheduler_steps: int | None, backend: str) -> int:
    if num_scheduler_steps is not None:
        return num_scheduler_steps
    return GPU_SCHEDULER_STEPS if backend == "gpu" else 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None                 # HF dir, .gguf, saved atlasjax checkpoint; None = embedded default
    load_format: str = "auto"                # auto: the checkpoint's weights | dummy: random weights for the model's
                                             # config.json, nothing else read but its tokenizer (vLLM's; benchmarks)
    revision: str | None = None              # with a Hub id as model: its branch, tag or commit (vLLM's; hub.py)
    tokenizer: str | None = None             # a directory with tokenizer.json (and tokenizer_config.json) to use
                                             # instead of the model's own (vLLM's --tokenizer)
    dtype: str = "auto"                      # auto: bfloat16 on GPU, float32 elsewhere
    kv_cache_dtype: str = "auto"             # the KV pool's: auto (= dtype) | bfloat16 | float16 | fp8 (e4m3) |
                                             # fp8_e4m3 | fp8_e5m2 (stored unscaled, saturating; read as bf16)
    calculate_kv_scales: bool = False        # fp8 KV cache: measure each layer's K / V scales on a calibration
                                             # text at start and fold them into the attention weights
                                             # (atlasjax/kv_calibration.py; one host)
    max_num_seqs: int = 16
    decode_batch_sizes: tuple[int, ...] | None = None   # row counts the decode step is compiled for: a step
                                             # runs the smallest that holds its requests (None: 8, 16, 32, ...
                                             # below max_num_seqs, then max_num_seqs itself)
    max_model_len: int | None = None         # default: min(model's max positions, 4096)
    page_size: int = 16
    num_pages: int | None = None             # default: sized from free device memory
    gpu_memory_utilization: float = 0.85     # fraction of free device memory the KV pool may take (GPU)
    max_num_batched_tokens: int = 512        # token budget per step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None  # GiB of host memory for a second prefix-cache tier (vLLM's): pages the
                                             # device pool evicts are copied there and copied back when a prompt
                                             # needs them again, instead of computed again (atlasjax/kv_offload.py;
                                             # one host; None: off)
    kv_offloading_disk: str | None = None    # a directory for a third tier under it, in files (atlasjax/kv_disk.py):
                                             # every page saved to host memory is written there too, and the
                                             # pages outlive the process for engines of the same weights
    kv_offloading_disk_size: float | None = None   # GiB the disk tier may fill (required with kv_offloading_disk)
    scheduling_policy: str = "fcfs"          # fcfs | priority: which waiting request a free slot admits
                                             # and which running one gives way when pages run out
                                             # (atlasjax/waiting_queue.py)
    async_scheduling: bool = True            # schedule step N+1 while step N runs (False: one step at a time)
    num_scheduler_steps: int | None = None   # decode iterations per launch when a step has only decodes (the
                                             # host issues the step once for them; outputs arrive in bursts), and
                                             # verify rounds per launch for drafts proposed on the device (a draft
                                             # model's or an EAGLE-3 head's: atlasjax/verify_rounds.py);
                                             # None: `resolve_scheduler_steps` (4 on GPU, 1 elsewhere)
    long_context_decode: bool | None = None  # more programs for the 8-, 16- and 32-row decode buckets, whose
                                             # attention splits each context for fewer busy rows: a step of at
                                             # most 6 requests runs one once a context reaches 1,024 tokens
                                             # (7, 9-10 or 17-20: 2,048), a lone request past 4,096 another
                                             # (atlasjax/long_context_decode.py).
                                             # None: on a GPU with Pallas attention
    compile_at_start: bool = False           # compile every step shape serving uses while the engine starts,
                                             # before the KV pool is allocated (compiles then run in threads
                                             # with the pool's memory free); what `serve` does
    seed: int = 0
    attention_backend: str = "auto"          # auto | pallas | reference | interpret (Pallas kernels in
                                             # Mosaic GPU interpret mode: slow, for checking them on a CPU)
    quantization: str | None = None          # None | int8 | fp8 | int4 (quantize linear projections at load)
    quantize_lm_head: bool = False           # with `quantization`: quantize the untied LM head too (tied
                                             # embeddings and the embedding table never are)
    quantization_group_size: int | None = None   # int4 / int8: weights per scale along K (32, 64, 128, ...);
                                             # None: int4 128, int8 and fp8 one scale per output channel
    quantization_symmetric: bool | None = None   # int4: True drops the zero points (absmax / 7); None: asymmetric
    activation_quantization: str | None = None   # None | fp8 | int8: per-channel weights of that format
                                             # (--quantization fp8 / int8, or such a checkpoint) multiply
                                             # prefill-sized products (256+ rows) by activations rounded per
                                             # token to it (W8A8, on the 8-bit tensor cores)
    keep_gguf_quantized: bool | None = None  # GGUF block-type projections stay quantized (gguf_blocks.py); None: on GPU only
                                             # (the CPU reference path dequantizes per step, which is slower)
    tensor_parallel_size: int = 1
    chat_template: str | None = None         # instead of the model's: a file's path or the template itself
                                             # (read and checked by the engine before the model loads)
    generation_config: str = "auto"          # the model's generation_config.json (atlasjax/generation_config.py):
                                             # auto (beside the checkpoint) | vllm (ignored) | a directory or file
    override_generation_config: object = None   # vLLM's: {"temperature": 0.6, "max_new_tokens": 512, ...} over the
                                             # generation_config.json defaults (a dict or its JSON)
    runner: str = "auto"                     # auto | generate | pooling (vLLM's --runner): pooling serves
                                             # embeddings, scores and classification only: a KV pool of one
                                             # sequence, no generation steps compiled; compile_at_start compiles
                                             # the embedding batch sizes. auto: pooling for a checkpoint that
                                             # cannot generate (a classifier, a base model without an LM head)
    speculative_config: object = None        # speculative decoding (vLLM's speculative_config): a dict
                                             # such as {"method": "ngram", "num_speculative_tokens": 4,
                                             # "prompt_lookup_max": 4} or {"model": "path/to/draft",
                                             # "num_speculative_tokens": 4} (a draft model), its JSON, or a
                                             # SpeculativeConfig (atlasjax/speculative.py); a step without
                                             # drafts decodes as usual (num_scheduler_steps iterations per launch);
                                             # drafts proposed on the device (a draft model's or head's, n-gram
                                             # lookups with num_scheduler_steps > 1) run num_scheduler_steps verify
                                             # rounds per launch, launches pipelined; otherwise the step after a
                                             # verify step waits for it to be read back
    hf_overrides: object = None              # vLLM's (atlasjax/hf_overrides.py): config.json keys over the
                                             # model's: RoPE and positions ({"rope_scaling": {"rope_type": "yarn",
                                             # "factor": 4.0, "original_max_position_embeddings": 32768}}), or
                                             # {"architectures": ["Qwen3ForSequenceClassification"],
                                             # "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker":
                                             # true}: a causal LM as a classifier / reranker (cross_encoder.py)
    enable_lora: bool = False                # serve LoRA adapters per request (vLLM's: `lora_request=LoRARequest(...)`,
                                             # or a server's --lora-modules; atlasjax/lora.py)
    max_loras: int = 1                       # adapters resident on the device at once (one batch mixes them)
    max_lora_rank: int = 16                  # the largest adapter rank accepted (each slot is sized for it)
    max_cpu_loras: int | None = None         # adapters kept read in host memory (None: max_loras)
    profiler_dir: str | None = None          # where `start_profile` writes jax.profiler traces (None:
                                             # $ATLASJAX_PROFILER_DIR, else a directory must be named; profiling.py)
    pooling_type: str | None = None          # embeddings (`LLM.embed`, /v1/embeddings): last | mean | cls | max;
                                             # None: the model's sentence-transformers config, else last
                                             # (atlasjax/pooling.py)

    def __post_init__(self):
        def bad(msg):
            raise EngineConfigError(msg)
        for name in ("max_num_seqs", "page_size", "max_num_batched_tokens", "tensor_parallel_size",
                     "num_scheduler_steps"):
            value = getattr(self, name)
            if value is None and name == "num_scheduler_steps":   # unset: resolved by platform
                continue
            if not isinstance(value, int) or value < 1:
                bad(f"{name} must be a positive integer, got {value!r}")
        if self.decode_batch_sizes is not None and (
                not isinstance(self.decode_batch_sizes, tuple) or not self.decode_batch_sizes
                or any(not isinstance(b, int) or b < 1 for b in self.decode_batch_sizes)):
            bad(f"decode_batch_sizes must be a non-empty tuple of positive integers, got {self.decode_batch_sizes!r}")
        if self.page_size & (self.page_size - 1):
            bad(f"page_size must be a power of two, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 1:
            bad(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_offloading_size is not None:
            if isinstance(self.kv_offloading_size, bool) or not isinstance(self.kv_offloading_size, (int, float)) \
                    or not self.kv_offloading_size > 0:
                bad(f"kv_offloading_size must be a positive number of GiB, got {self.kv_offloading_size!r}")
            if not self.enable_prefix_caching:
                bad("kv_offloading_size keeps evicted prefix-cache pages in host memory: it needs prefix caching "
                    "(enable_prefix_caching=False turns that off)")
        if self.kv_offloading_disk is not None or self.kv_offloading_disk_size is not None:
            if self.kv_offloading_size is None:
                bad("kv_offloading_disk is a tier under host memory: it needs kv_offloading_size too")
            if not isinstance(self.kv_offloading_disk, str) or not self.kv_offloading_disk:
                bad(f"kv_offloading_disk must name a directory, got {self.kv_offloading_disk!r}")
            size = self.kv_offloading_disk_size
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
                bad(f"kv_offloading_disk_size must be a positive number of GiB, got {size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            bad(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            bad(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not isinstance(self.compile_at_start, bool):
            bad(f"compile_at_start must be True or False, got {self.compile_at_start!r}")
        if self.long_context_decode is not None and not isinstance(self.long_context_decode, bool):
            bad(f"long_context_decode must be True, False or None (auto), got {self.long_context_decode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            bad(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if not isinstance(self.async_scheduling, bool):
            bad(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if self.quantization not in (None, "int8", "fp8", "int4"):
            bad(f"quantization must be None, int8, fp8 or int4, got {self.quantization!r}")
        if not isinstance(self.quantize_lm_head, bool):
            bad(f"quantize_lm_head must be True or False, got {self.quantize_lm_head!r}")
        check_setting(self.generation_config)
        object.__setattr__(self, "override_generation_config", parse_overrides(self.override_generation_config))
        if self.runner not in RUNNERS:
            bad(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pooling_type not in (None, *POOLING_TYPES):
            bad(f"pooling_type must be None or one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            bad(f"tokenizer must be a directory's path, got {self.tokenizer!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            bad(f"chat_template must be a file's path or a template, got {self.chat_template!r}")
        check_quantization_layout(self.quantization, self.quantization_group_size, self.quantization_symmetric)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        if not isinstance(self.calculate_kv_scales, bool):
            bad(f"calculate_kv_scales must be True or False, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            bad("calculate_kv_scales=True measures scales for an fp8 KV cache; set kv_cache_dtype='fp8' "
                f"(it is {self.kv_cache_dtype!r})")
        acts = self.activation_quantization
        if acts not in (None, "fp8", "int8"):
            bad(f"activation_quantization must be None, fp8 or int8, got {acts!r}")
        if acts and self.quantization not in (None, acts):
            bad(f"activation_quantization={acts} multiplies {acts} weights; {self.quantization} weights keep "
                f"bf16 activations (use quantization='{acts}')")
        if acts and self.quantization_group_size is not None:
            bad(f"activation_quantization={acts} multiplies weights with one scale per output channel; "
                f"quantization_group_size={self.quantization_group_size} makes groups")
        check_lora_config(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        spec = self.speculative_config
        # a draft model is split over the target's devices; an EAGLE-3 head runs whole on each (1 or the same)
        allowed = (None, self.tensor_parallel_size) + ((1,) if spec is not None and spec.method == "eagle3" else ())
        if spec is not None and spec.draft_tensor_parallel_size not in allowed:
            bad(f"speculative_config: draft_tensor_parallel_size={spec.draft_tensor_parallel_size} must equal "
                f"tensor_parallel_size={self.tensor_parallel_size}: the draft is split over the target's devices")
        if self.quantize_lm_head and self.quantization is None:
            bad("quantize_lm_head=True needs quantization (int8, fp8 or int4): it selects the LM head's "
                "format; without quantization nothing is quantized")

    def decode_buckets(self, num_slots: int, min_rows: int = 1) -> tuple[int, ...]:
        """Row counts the decode step is compiled for, ascending, the largest `num_slots` (the engine's
        slots: max_num_seqs, at least 8 on GPU), none below `min_rows`. A decode of n requests runs the
        smallest bucket >= n, so a lightly loaded engine does not pay for every slot's rows in its
        matmuls and sampling."""
        if self.decode_batch_sizes is None:
            sizes, b = [], 8
            while b < num_slots:
                sizes.append(b)
                b *= 2
        else:
            sizes = self.decode_batch_sizes
        return tuple(sorted({max(b, min_rows) for b in sizes if b < num_slots} | {num_slots}))

    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded token counts the prefill step is compiled for: powers of two up to the budget."""
        buckets, b = [], 16
        while b < self.max_num_batched_tokens:
            buckets.append(b)
            b *= 2
        return tuple(buckets) + (self.max_num_batched_tokens,)

    @property
    def prompt_logprobs_tokens(self) -> int:
        """Padded token count of every prefill step that records prompt logprobs (one of the prefill
        buckets), and the most prefill tokens such a step takes."""
        return min(PROMPT_LOGPROBS_TOKENS, self.max_num_batched_tokens)
