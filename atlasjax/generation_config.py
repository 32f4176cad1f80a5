"""A model's `generation_config.json`: its end-of-sequence ids and its default sampling settings.

Model authors put there how their model should be sampled (Llama 3.1 Instruct: temperature 0.6,
top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20) and which tokens end a turn (often more
than config.json names: Llama 3 Instruct's <|eot_id|>). vLLM reads the file by default, and so
do we (`--generation-config`):
  - "auto": the file beside the checkpoint (a Hugging Face directory, or a directory written by
    `LLM.save`, which keeps it); a GGUF file has none.
  - "vllm": ignore it (the engine's own defaults: OpenAI's for the server).
  - a directory holding generation_config.json, or the file's path: that file, for any model.

What is taken from it, as vLLM takes it:
  - `eos_token_id` (one id or a list): these end a sequence too, like config.json's.
  - `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`: the default of a request that
    leaves the field out (a request's own value always wins).
  - `max_new_tokens`: the default `max_tokens` of a request that leaves it out, cut to the context
    left after its prompt.
Other keys (`do_sample`, beam settings, `bos_token_id`...) are ignored, as vLLM ignores them. A file
that is not JSON, or whose values are of the wrong type or out of range, is a CheckpointError.

`override_generation_config` (vLLM's `--override-generation-config '{"temperature": 0.6}'`) sets those
sampling keys and `max_new_tokens` over what the file gave (over nothing with "vllm").
"""
from __future__ import annotations

import dataclasses
import json
import os

from atlasjax.config_json import json_dict
from atlasjax.errors import CheckpointError, EngineConfigError, InvalidRequestError

FILENAME = "generation_config.json"
MODES = ("auto", "vllm")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What a generation_config.json sets (empty: nothing, the engine's own defaults apply)."""
    eos_token_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, float | int], ...] = ()   # (SamplingParams field, value) pairs
    max_tokens: int | None = None
    source: str | None = None        # the file they came from

    @property
    def sampling_defaults(self) -> dict:
        """SamplingParams keywords for the fields the file sets."""
        return dict(self.sampling)

    def __bool__(self) -> bool:
        return bool(self.eos_token_ids or self.sampling or self.max_tokens)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.sampling]
        if self.max_tokens:
            parts.append(f"max_tokens={self.max_tokens}")
        if self.eos_token_ids:
            parts.append(f"eos_token_ids={list(self.eos_token_ids)}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        """The file's form (what `LLM.save` writes beside a checkpoint)."""
        out: dict = dict(self.sampling)
        if self.max_tokens:
            out["max_new_tokens"] = self.max_tokens
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids)
        return out


def check_setting(setting) -> None:
    """EngineConfig's check: "auto", "vllm", or an existing directory or .json file."""
    if not isinstance(setting, str) or not setting:
        raise EngineConfigError(f"generation_config must be 'auto', 'vllm' or a path, got {setting!r}")
    if setting not in MODES and _file_of(setting) is None:
        raise EngineConfigError(f"generation_config {setting!r} is neither 'auto', 'vllm', a directory holding "
                                f"{FILENAME} nor such a file")


def resolve(setting: str, model_source: str) -> GenerationDefaults:
    """The defaults that `setting` ("auto", "vllm" or a path) selects for the model loaded from `model_source`."""
    if setting == "vllm":
        return GenerationDefaults()
    path = _file_of(model_source if setting == "auto" else setting)
    if path is None:
        if setting != "auto":
            check_setting(setting)    # raises, naming what is missing
        return GenerationDefaults()
    return read(path)


def _file_of(path: str) -> str | None:
    if os.path.isdir(path):
        path = os.path.join(path, FILENAME)
    return path if os.path.isfile(path) and path.endswith(".json") else None


def read(path: str) -> GenerationDefaults:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return parse(data, path)


def parse(data: dict, where: str) -> GenerationDefaults:
    def bad(msg):
        raise CheckpointError(f"{where}: {msg}")
    eos = data.get("eos_token_id")
    eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_ids):
        bad(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    sampling = []
    for key in SAMPLING_KEYS:
        value = data.get(key)
        if value is None:
            continue
        integral = key == "top_k"
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            bad(f"{key} must be {'an integer' if integral else 'a number'}, got {value!r}")
        sampling.append((key, int(value) if integral else float(value)))
    max_tokens = data.get("max_new_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        bad(f"max_new_tokens must be a positive integer, got {max_tokens!r}")
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    try:   # the ranges a request's own values must keep
        SamplingParams(**dict(sampling), max_tokens=max_tokens)
    except InvalidRequestError as e:
        bad(str(e))
    return GenerationDefaults(tuple(dict.fromkeys(eos_ids)), tuple(sampling), max_tokens, where)


OVERRIDE_KEYS = (*SAMPLING_KEYS, "max_new_tokens")


def parse_overrides(value) -> dict | None:
    """`override_generation_config`: None, or a dict (or its JSON) of OVERRIDE_KEYS with valid values; anything else
    is an EngineConfigError naming it."""
    if value is None:
        return None
    value = json_dict(value, "override_generation_config")
    unknown = sorted(set(value) - set(OVERRIDE_KEYS))
    if unknown:
        raise EngineConfigError(f"override_generation_config: {unknown} not supported (supported: "
                                f"{list(OVERRIDE_KEYS)})")
    try:
        parse(value, "override_generation_config")
    except CheckpointError as e:
        raise EngineConfigError(str(e)) from None
    return value


def with_overrides(defaults: GenerationDefaults, overrides: dict | None) -> GenerationDefaults:
    """The defaults with `overrides` (checked by parse_overrides) set over them."""
    if not overrides:
        return defaults
    where = f"{defaults.source} and override_generation_config" if defaults.source else "override_generation_config"
    return parse({**defaults.to_json(), **overrides}, where)


def default_sampling_params(defaults: GenerationDefaults | None):
    """SamplingParams with the model's defaults (`LLM.get_default_sampling_params`, as vLLM's)."""
    from atlasjax.sampling_params import SamplingParams  # noqa: PLC0415
    if not defaults:
        return SamplingParams()
    return SamplingParams(**defaults.sampling_defaults, max_tokens=defaults.max_tokens or SamplingParams.max_tokens)
