"""Result types returned to callers (vLLM-compatible field names)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely; None when not among the top-k computed
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: object = None      # the LoRARequest it ran with (None: the base model)


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one sequence (the async API streams these)."""
    request_id: str
    index: int                       # which of the n completions
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, Logprob]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # on a sequence's first delta, when asked
    # on a sequence's first delta: from arrival to its first admission (a timing, left out of ==)
    queue_seconds: float | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]               # softmax over the labels (a sigmoid for a single-label head), as vLLM's
    logits: list[float]              # the head's raw outputs (a reward model's score)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class PoolingRequestOutput:
    """One input's result of a pooling task (vLLM's): `outputs` is an EmbeddingOutput (`LLM.embed`), a
    ScoringOutput (`LLM.score`: prompt_token_ids are the first text's, then the second's) or a
    ClassificationOutput (`LLM.classify`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput | ClassificationOutput
    finished: bool = True


EmbeddingRequestOutput = ScoringRequestOutput = ClassificationRequestOutput = PoolingRequestOutput   # vLLM's names
