"""Speculative decoding with an EAGLE-3 head (vLLM's and SGLang's `speculative_config={"method": "eagle3",
"model": ...}`): a one-layer draft that proposes from the target's own hidden states (models/eagle3.py).

Loading: a checkpoint directory as EAGLE-3's trainers publish it (config.json with `LlamaForCausalLMEagle3` or
`Eagle3LlamaForCausalLM`, `draft_vocab_size`, or the speculators library's `Eagle3Speculator` format; weights `fc`,
`midlayer.*` (or `layers.0.*`), `norm`, `lm_head`, `d2t`, optionally `embed_tokens`, in safetensors, or a
`pytorch_model.bin` where torch is installed). Checked against the target: its hidden size (fc takes three of the
target's layers), its vocabulary, one decoder layer.

How it runs (atlasjax/steps.py): the target returns its residual stream entering three layers (`aux_layers`: the
checkpoint's, else 2, L // 2 and L - 3 of L layers, as vLLM's and SGLang's). After the target,
every step runs the head over the step's rows with each row's next token (the next prompt token, or the token just
sampled; `drafting.eagle_follow`): its KV pool (one layer, on the target's pages) then covers every position the
target's does, and each slot keeps the head's output at its request's last position (`DeviceState.draft_hidden`). A
verify step proposes from there before the target runs: draft 1 from the kept output, then k - 1 draft iterations.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os

import numpy as np

from atlasjax import hub
from atlasjax.config import ModelConfig, from_hf_config
from atlasjax.errors import AtlasJaxError, EngineConfigError

log = logging.getLogger("atlasjax.engine")
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
    """What the steps need besides the params: the head's layer config, the target layers it reads, and its
    own vocabulary's size."""
    cfg: ModelConfig            # the head's decoder layer (num_layers 1)
    aux_layers: tuple[int, ...]
    target_hidden: int
    draft_vocab: int
    norm_before_residual: bool = False


def load_eagle3(spec, target_cfg: ModelConfig, dtype, max_model_len: int) -> tuple[Eagle3Spec, dict]:
    """(Eagle3Spec, params) of `spec.model` (SpeculativeConfig, method "eagle3") for `target_cfg`, in `dtype`.
    Refused (EngineConfigError, naming the reason): a missing, corrupt or other checkpoint, one whose sizes do not
    fit the target."""
    import jax.numpy as jnp  # noqa: PLC0415
    path = hub.resolve(spec.model, "EAGLE-3 head") if not spec.model.startswith("preset:") else spec.model

    def bad(msg):
        raise EngineConfigError(f"speculative_config: the EAGLE-3 head {spec.model!r} {msg}")
    try:
        if path.startswith("preset:"):
            hf, tensors = random_head(path[len("preset:"):], target_cfg)
        else:
            hf = flat_config(_read_config(path))
            tensors = _read_tensors(path)
    except (AtlasJaxError, OSError, ValueError) as e:
        bad(f"cannot be loaded: {e}")
    archs = hf.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        bad(f"is not an EAGLE-3 checkpoint (architectures {archs}; expected one of {list(ARCHITECTURES)})")
    if int(hf.get("num_hidden_layers", 1)) != 1:
        bad(f"has {hf['num_hidden_layers']} decoder layers; only one (EAGLE-3's published heads) is supported")
    eagle = hf.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        bad("drafts from the target's last hidden state only (use_aux_hidden_state false), which is not supported")
    try:
        cfg = dataclasses.replace(from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]}), num_layers=1)
    except (AtlasJaxError, KeyError, ValueError, TypeError) as e:
        bad(f"has a config this engine cannot read: {e}")
    if cfg.vocab_size != target_cfg.vocab_size:
        bad(f"is for a vocabulary of {cfg.vocab_size} tokens, the model's has {target_cfg.vocab_size}")
    aux = aux_layers(hf, target_cfg.num_layers)
    if len(aux) != 3 or not all(0 <= i < target_cfg.num_layers for i in aux):
        bad(f"reads the model's residual stream entering layers {list(aux)}: three distinct layers of its "
            f"{target_cfg.num_layers} are needed")
    target_hidden = int(hf.get("target_hidden_size") or target_cfg.hidden_size)
    if target_hidden != target_cfg.hidden_size:
        bad(f"is for a model of hidden size {target_hidden}, this model's is {target_cfg.hidden_size}")
    draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
    params = _params(tensors, cfg, target_hidden, draft_vocab, bad, lambda a: jnp.asarray(a, dtype))
    if cfg.max_position_embeddings < max_model_len:
        log.info("speculative decoding: the EAGLE-3 head's max_position_embeddings (%d) is below max_model_len (%d): "
                 "past it its drafts are accepted less often; the output stays exact", cfg.max_position_embeddings,
                 max_model_len)
    log.info("speculative decoding: EAGLE-3 head %s (hidden %d, draft vocabulary %d, reads layers %s)", spec.model,
             cfg.hidden_size, draft_vocab, list(aux))
    return Eagle3Spec(cfg, aux, target_hidden, draft_vocab, bool(hf.get("norm_before_residual", False))), params


def aux_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input (residual stream) the head reads, ascending. Two conventions name them:
    vLLM's top-level `eagle_aux_hidden_state_layer_ids` are Hugging Face hidden_states indices (j: the input of layer
    j); SGLang's and SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids` name layer outputs (j: the input of
    layer j + 1). Neither: 2, L // 2 and L - 3 (both engines' default)."""
    if ids := hf.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(sorted({int(i) for i in ids}))
    if ids := (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        return tuple(sorted({int(i) + 1 for i in ids}))
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


SPECULATORS_KEYS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
                    "eagle_aux_hidden_state_layer_ids")


def flat_config(hf: dict) -> dict:
    """The config as EAGLE-3's trainers write it. The speculators library's format (vLLM's `Eagle3Speculator`, Red
    Hat's published heads) nests the layer's config in `transformer_layer_config`: flattened here, its head-level keys
    kept (the weights are named as the trainers' are)."""
    if hf.get("speculators_model_type") != "eagle3" and "Eagle3Speculator" not in (hf.get("architectures") or []):
        return hf
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("a speculators eagle3 config without a transformer_layer_config object")
    return {**layer, **{k: hf[k] for k in SPECULATORS_KEYS if k in hf}, "architectures": [ARCHITECTURES[0]],
            "model_type": layer.get("model_type", "llama")}


def _read_config(path: str) -> dict:
    name = os.path.join(path, "config.json")
    if not os.path.isfile(name):
        raise ValueError(f"no config.json in {path}")
    with open(name) as f:
        return json.load(f)


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    if glob.glob(os.path.join(path, "*.safetensors")):
        from atlasjax.loader import iter_safetensors  # noqa: PLC0415
        return {name: np.asarray(reader()) for name, reader in iter_safetensors(path)}
    bins = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not bins:
        raise ValueError(f"no *.safetensors or *.bin weights in {path}")
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise ValueError(f"{path} has PyTorch weights ({os.path.basename(bins[0])}) and torch is not installed: "
                         "install it, or save the tensors as safetensors") from None
    out = {}
    for b in bins:
        try:
            state = torch.load(b, map_location="cpu", weights_only=True)
        except Exception as e:   # noqa: BLE001 (torch's unpickler raises many kinds)
            raise ValueError(f"cannot read {b}: {e}") from e
        out.update({k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()})
    return out


_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def _params(tensors: dict, cfg: ModelConfig, target_hidden: int, draft_vocab: int, bad, put) -> dict:
    """The checkpoint's tensors as the head's param tree (linear weights transposed to [in, out]), shapes checked."""
    named = {}
    for name, value in tensors.items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        named[name] = value
    d, hd = cfg.hidden_size, cfg.head_dim
    want = {"fc.weight": (d, 3 * target_hidden), "norm.weight": (d,), "lm_head.weight": (draft_vocab, d),
            "layers.0.self_attn.q_proj.weight": (cfg.num_heads * hd, 2 * d),
            "layers.0.self_attn.k_proj.weight": (cfg.num_kv_heads * hd, 2 * d),
            "layers.0.self_attn.v_proj.weight": (cfg.num_kv_heads * hd, 2 * d),
            "layers.0.self_attn.o_proj.weight": (d, cfg.num_heads * hd),
            "layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, d),
            "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, d),
            "layers.0.mlp.down_proj.weight": (d, cfg.intermediate_size),
            **{f"layers.0.{n}.weight": (d,) for n in _NORMS}}
    if draft_vocab != cfg.vocab_size:
        want["d2t"] = (draft_vocab,)
    for name, shape in want.items():
        if name not in named:
            bad(f"has no tensor {name}")
        if tuple(named[name].shape) != shape:
            bad(f"tensor {name} has shape {list(named[name].shape)}, expected {list(shape)}")

    def kernel(name):
        return {"kernel": put(np.asarray(named[name], np.float32).T)}

    def scale(name):
        return {"scale": put(np.asarray(named[name], np.float32))}
    layer = {module: {p: kernel(f"layers.0.{module}.{p}.weight") for p in parts} for module, parts in _LINEARS.items()}
    layer.update({n: scale(f"layers.0.{n}.weight") for n in _NORMS})
    d2t = np.asarray(named.get("d2t", np.zeros(draft_vocab)), np.int64)
    targets = np.arange(draft_vocab) + d2t
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        bad("maps draft tokens past the model's vocabulary (d2t)")
    import jax.numpy as jnp  # noqa: PLC0415
    params = {"fc": kernel("fc.weight"), "layers_0": layer, "norm": scale("norm.weight"),
              "lm_head": kernel("lm_head.weight"), "d2t": jnp.asarray(d2t.astype(np.int32))}
    if "embed_tokens.weight" in named:
        if tuple(named["embed_tokens.weight"].shape) != (cfg.vocab_size, d):
            bad(f"tensor embed_tokens.weight has shape {list(named['embed_tokens.weight'].shape)}")
        params["embed_tokens"] = {"embedding": put(np.asarray(named["embed_tokens.weight"], np.float32))}
    return params


def random_head(name: str, target_cfg: ModelConfig, seed: int = 1) -> tuple[dict, dict]:
    """(config.json, tensors) of a random EAGLE-3 head for `target_cfg` ("preset:eagle3": the published heads'
    shapes for the target, a 32,000-token draft vocabulary): what a verify step with its drafts costs."""
    if name != "eagle3":
        raise ValueError(f"no preset {name!r} for an EAGLE-3 head (presets: eagle3)")
    c = target_cfg
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
          "vocab_size": c.vocab_size, "draft_vocab_size": min(32000, c.vocab_size), "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings}
    return hf, make_tensors(hf, c.hidden_size, np.random.default_rng(seed))


def make_tensors(hf: dict, target_hidden: int, rng, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random tensors of an EAGLE-3 checkpoint with config `hf` (checkpoint names, [out, in] weights)."""
    d, inter = hf["hidden_size"], hf["intermediate_size"]
    hd = hf.get("head_dim") or d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    vocab, draft_vocab = hf["vocab_size"], hf.get("draft_vocab_size") or hf["vocab_size"]
    shapes = {"fc.weight": (d, 3 * target_hidden), "lm_head.weight": (draft_vocab, d),
              "midlayer.self_attn.q_proj.weight": (q, 2 * d), "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * d), "midlayer.self_attn.o_proj.weight": (d, q),
              "midlayer.mlp.gate_proj.weight": (inter, d), "midlayer.mlp.up_proj.weight": (inter, d),
              "midlayer.mlp.down_proj.weight": (d, inter)}
    out = {k: (rng.standard_normal(s, np.float32) * std) for k, s in shapes.items()}
    for n in ("norm.weight", *(f"midlayer.{n}.weight" for n in _NORMS)):
        out[n] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    if draft_vocab != vocab:   # the draft vocabulary: draft_vocab of the target's ids, ascending
        ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
        out["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
        t2d = np.zeros(vocab, bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out
