"""Build a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.*` metadata.

GGUF stores a tokenizer as arrays (tokens, token types, merges or scores) plus a model kind:
  - "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen2/3). Tokens are already in the byte-to-unicode
    alphabet; `tokenizer.ggml.pre` names the pre-tokenizer, which we map to the split rules the
    model's Hugging Face tokenizer.json uses.
  - "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1, TinyLlama). GGUF keeps
    per-token scores, not merges; a merge's rank is the score of the token it produces.
Control tokens (type 3) and the unknown token become special added tokens; user-defined ones
(type 4) become plain added tokens. Either way they are matched whole, never split.

`build_tokenizer(meta)` -> (tokenizer, chat_template, special_tokens). The tokenizer's post
processor prepends BOS only when `tokenizer.ggml.add_bos_token` says so (SmolLM2 does not).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from atlasjax.errors import UnsupportedModelError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split rules of the Hugging Face tokenizer.json of each family (byte-level BPE).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2", "codeshell": "digits+gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
}
# Tokens that end a turn in the chat templates of the supported families (as llama.cpp's EOG set).
_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>")


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, str | None, dict[str, Any]]:
    """Tokenizer, chat template and special-token facts from GGUF metadata.

    Returns:
      tokenizer: encodes text to ids (BOS included when the file asks for it) and decodes back.
      chat_template: the jinja2 source of `tokenizer.chat_template`, or None.
      special_tokens: {"bos_token", "eos_token", "unk_token", "pad_token": str | None,
        "bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id": int | None,
        "eos_token_ids": list[int] (eos first, then eot/eom and other end-of-turn control tokens),
        "add_bos_token", "add_eos_token": bool}.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedModelError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(len(tokens), NORMAL)), np.int64)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
        default_add_bos = _PRE_FAMILIES.get(meta.get("tokenizer.ggml.pre", "default")) == "llama3"
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types)
        default_add_bos = True
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN))])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i in np.flatnonzero(types == USER_DEFINED)])
    special = _special_tokens(meta, tokens, types, default_add_bos)
    tokenizer.post_processor = _post_processor(kind, special)
    return tokenizer, meta.get("tokenizer.chat_template"), special


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported "
                                    f"(supported: {', '.join(sorted(_PRE_FAMILIES))})")
    vocab = _first_ids(tokens)
    merges = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        cut = merge.find(" ", 1)  # from 1: a merge's left part may itself be a space
        merges.append((merge[:cut], merge[cut + 1:]))
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=family == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family in ("gpt2", "digits+gpt2"))
    if family == "gpt2":
        tokenizer.pre_tokenizer = byte_level
    elif family == "digits+gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT), "isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        if family == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: np.ndarray) -> Tokenizer:
    # SentencePiece BPE merges the adjacent pair whose merged piece scores highest; as ranked BPE
    # merges: every split of a normal piece into two known pieces, ordered by the piece's score.
    scores = np.asarray(meta.get("tokenizer.ggml.scores", -np.arange(len(tokens), dtype=np.float32)))
    vocab = _first_ids(tokens)
    ranked = []
    for piece_id in np.flatnonzero(types == NORMAL):
        piece = tokens[piece_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], (left, right)))
    merges = [pair for *_, pair in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    rules = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        rules.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(rules)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else [])])
    return tokenizer


def _first_ids(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a few vocabularies repeat a string; the first id wins
    return vocab


def _special_tokens(meta: dict[str, Any], tokens: list[str], types: np.ndarray,
                    default_add_bos: bool) -> dict[str, Any]:
    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    ids = {name: token_id(name) for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    eos_ids = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    eos_ids += [i for i in np.flatnonzero(types == CONTROL).tolist() if tokens[i] in _END_OF_GENERATION]
    special = {
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "unk_token_id": ids["unknown"],
        "pad_token_id": ids["padding"], "eos_token_ids": list(dict.fromkeys(eos_ids)),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and ids["bos"] is not None,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        special[f"{name}_token"] = tokens[ids[key]] if ids[key] is not None else None
    return special


def _post_processor(kind: str, special: dict[str, Any]) -> processors.PostProcessor:
    def sequence(piece: str, type_id: int) -> list[str]:
        bos = [f"{special['bos_token']}:{type_id}"] if special["add_bos_token"] else []
        eos = [f"{special['eos_token']}:{type_id}"] if special["add_eos_token"] else []
        return bos + [f"{piece}:{type_id}"] + eos

    used = [(special[f"{n}_token"], special[f"{n}_token_id"]) for n in ("bos", "eos") if special[f"add_{n}_token"]]
    template = processors.TemplateProcessing(single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1),
                                             special_tokens=list(dict.fromkeys(used)))
    if kind == "gpt2":  # keep byte-level offsets right, as the HF tokenizers do
        return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return template
