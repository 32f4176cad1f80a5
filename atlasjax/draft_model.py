"""Speculative decoding with a draft model (vLLM's `speculative_config={"method": "draft_model", "model": ...}`):
a smaller model of the same tokenizer proposes each request's next k tokens greedily, and the target verifies
them in one step, as n-gram drafts are (atlasjax/speculative.py: the accept rule keeps the output exact).

How it runs (atlasjax/steps.py): the draft has a KV pool of its own on the target's pages (its page tables are the
target's), and every step that runs the target over tokens (prefill chunks, decodes, verifies) runs the draft over
the same tokens, so its cache always covers what the target's covers. A verify step first runs k + 1 draft decode
iterations over its requests (`drafting.propose`: the last token, then each draft, the last iteration only writing
its K/V), fills the drafts into the rows the host reserved, then runs the target over them: one launch per step,
with the drafts read back beside the sampled tokens. Here: loading the draft and checking that it fits.
"""
from __future__ import annotations

import logging

from atlasjax import hub
from atlasjax.errors import AtlasJaxError, EngineConfigError

log = logging.getLogger("atlasjax.engine")
PRESET = "preset:"   # `model` "preset:llama-3.2-1b": a bench preset's random weights (atlasjax/bench/presets.py)


def load_speculative_draft(spec, target_cfg, target_tokenizer, dtype, max_model_len: int, plan=None):
    """What `ModelRunner(draft=...)` runs beside the target for `spec` (a SpeculativeConfig or None): (a draft
    model's ModelConfig or an EAGLE-3 head's Eagle3Spec, its params, its TensorParallel plan or None, drafts per
    step); None without drafts proposed on the device (no speculation, or n-gram drafts). plan: the target's."""
    if spec is None or not spec.uses_draft_model:
        return None
    from atlasjax import distributed  # noqa: PLC0415
    if distributed.is_multiprocess():
        raise EngineConfigError(f"a {spec.draft_name} (speculative_config) across several hosts is not supported")
    if spec.method == "eagle3":
        from atlasjax.eagle3 import load_eagle3  # noqa: PLC0415
        draft = (*load_eagle3(spec, target_cfg, dtype, max_model_len), None)
    else:
        draft = load_draft(spec, target_tokenizer, dtype, max_model_len, None if plan is None else plan.mesh)
    return (*draft, spec.num_speculative_tokens)


def load_draft(spec, target_tokenizer, dtype, max_model_len: int, mesh=None):
    """The draft model of `spec` (SpeculativeConfig, method "draft_model") -> (its ModelConfig, its params, its
    TensorParallel plan or None), loaded unquantized in `dtype` (or random weights of a bench preset,
    "preset:NAME", to measure steps); under tensor parallelism (`mesh`: the target's) split over the same devices
    as the target, its KV heads included. Refused (EngineConfigError, naming the reason): a checkpoint that cannot
    be read, one without an LM head, a tokenizer other than the target's."""
    from atlasjax.loader import load_model  # noqa: PLC0415
    try:
        if spec.model.startswith(PRESET):   # random weights of a bench preset: what a draft's steps cost
            from atlasjax.bench.presets import PRESETS, load_preset  # noqa: PLC0415
            name = spec.model[len(PRESET):]
            if name not in PRESETS:
                raise ValueError(f"no bench preset {name!r} (presets: {', '.join(PRESETS)})")
            loaded = load_preset(name, dtype, seed=1, tensor_parallel_size=1 if mesh is None else mesh.size)
        else:
            loaded = load_model(hub.resolve(spec.model, "draft model"), dtype, keep_gguf_quantized=False, mesh=mesh)
    except (AtlasJaxError, OSError, ValueError) as e:   # a missing, corrupt or unsupported checkpoint
        raise EngineConfigError(f"speculative_config: the draft model {spec.model!r} cannot be loaded: {e}") from e
    if loaded.pooling_model or loaded.classifier is not None:
        raise EngineConfigError(f"speculative_config: the draft model {spec.model!r} has no LM head (an embedding or "
                                "classification checkpoint cannot propose tokens)")
    check_same_tokenizer(target_tokenizer, loaded.tokenizer, spec.model)
    cfg = loaded.config
    if cfg.max_position_embeddings < max_model_len:
        log.warning("speculative decoding: the draft model's max_position_embeddings (%d) is below max_model_len "
                    "(%d): it proposes past its trained length (drafts there are accepted less often; the output "
                    "stays exact)", cfg.max_position_embeddings, max_model_len)
    log.info("speculative decoding: draft model %s (%d layers, hidden %d, vocab %d)", spec.model, cfg.num_layers,
             cfg.hidden_size, cfg.vocab_size)
    return cfg, loaded.params, loaded.plan


def check_same_tokenizer(target, draft, name: str) -> None:
    """A draft's token ids must mean the target's: equal vocabularies where both checkpoints carry a tokenizer
    (without one, nothing to compare; the steps cut the draft's logits to the target's vocabulary either way)."""
    if target is None or draft is None:
        return
    if target.tok.get_vocab(with_added_tokens=True) != draft.tok.get_vocab(with_added_tokens=True):
        raise EngineConfigError(
            f"speculative_config: the draft model {name!r} has another tokenizer than the model (vocabularies of "
            f"{draft.vocab_size} and {target.vocab_size} tokens that differ): its token ids would mean other "
            "tokens; use a draft of the same family")
