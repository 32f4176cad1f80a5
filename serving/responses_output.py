"""A Responses API answer's output items, built from its text deltas the same way whole or streamed.

With `--reasoning-parser` the answer's <think> part becomes a `reasoning` item (its text as
`reasoning_text` content) before the `message` item that holds the rest as `output_text`; without
one, everything is the message. `add` and `finish` return the stream events each change makes, in
OpenAI's order: output_item.added, content_part.added, the text deltas, then output_text.done (or
reasoning_text.done), content_part.done and output_item.done; a non-streaming response ignores them.
"""
from __future__ import annotations

import uuid

from atlasjax.outputs import StreamDelta
from serving.openai_shapes import chat_logprobs
from serving.reasoning import ReasoningStream


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    def __init__(self, reasoning_parser: str | None, top_logprobs: int | None, as_ids: bool = False,
                 reasoning_end_ids: tuple[int, ...] = ()):
        """top_logprobs: None returns no logprobs; k returns each output token's and its k likeliest.
        reasoning_end_ids: the end tag's token ids, to count the reasoning tokens of the delta that closes it."""
        self.splitter = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.top_logprobs, self.as_ids, self.end_ids = top_logprobs, as_ids, tuple(reasoning_end_ids)
        self.items: list[dict] = []        # in output order; the last may still be open
        self.texts: list[str] = []         # each item's text so far
        self.closed: set[int] = set()      # items whose done events went out
        self.logprobs: list[dict] = []     # the message's output_text logprobs
        self.num_tokens = 0
        self.reasoning_tokens = 0
        self._undecided = 0                # tokens before the parser knew whether a reasoning opened
        self.finish_reason: str | None = None
        self.num_cached_tokens: int | None = None   # prompt tokens the prefix cache served (first delta's)

    # ---- building
    def add(self, delta: StreamDelta) -> list[dict]:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = delta.num_cached_tokens
        self.num_tokens += len(delta.new_token_ids)
        if self.splitter is None:
            reasoning, content = "", delta.new_text
        else:
            before = self.splitter.state
            reasoning, content = self.splitter.add(delta.new_text)
            if delta.finished:
                more_reasoning, more_content = self.splitter.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            self._count_reasoning(delta.new_token_ids, before, reasoning, content)
        lps = []
        if self.top_logprobs is not None and delta.new_token_ids and (content or self.splitter is None):
            lps = chat_logprobs(delta.new_token_ids, delta.new_logprobs or [], self.top_logprobs,
                                self.as_ids)["content"]
        events = []
        if reasoning:
            events += self._append("reasoning", reasoning)
        if content or lps:
            events += self._append("message", content, lps)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        return events

    def _count_reasoning(self, token_ids: list[int], before: str, reasoning: str, content: str) -> None:
        """Reasoning tokens: those before the first token of answer text. Of the delta that closes the
        reasoning, the tokens up to the end tag count when its ids are found there; otherwise none of it
        (exact when the end tag's tokens arrive apart from the answer's, as one token per delta has them)."""
        n, after = len(token_ids), self.splitter.state
        if after == "start":                  # not yet known whether a reasoning opens
            self._undecided += n
            return
        n, self._undecided = n + self._undecided, 0
        if after == "reasoning" or (before != "content" and not content):
            self.reasoning_tokens += n
        elif before != "content" and (reasoning or before == "reasoning"):
            k = len(self.end_ids)
            ends = [i + k for i in range(len(token_ids) - k + 1) if k and tuple(token_ids[i:i + k]) == self.end_ids]
            self.reasoning_tokens += n - len(token_ids) + ends[0] if ends else 0

    def finish(self) -> list[dict]:
        """Close the open item (an answer with no item gets an empty message); return the events."""
        if not self.items:
            return self._open("message") + self._close()
        return self._close()

    # ---- the items
    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    @property
    def conversation_text(self) -> str:
        """What a later turn sees of this answer: its message text (reasoning is not carried over)."""
        return "".join(t for item, t in zip(self.items, self.texts) if item["type"] == "message")

    def output(self) -> list[dict]:
        return [self._item(i, done=True) for i in range(len(self.items))]

    def _item(self, i: int, done: bool) -> dict:
        item, text = self.items[i], self.texts[i] if done else ""
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            return {**item, "summary": [], "content": [part] if done else [],
                    "status": "completed" if done else "in_progress"}
        part = {"type": "output_text", "text": text, "annotations": [],
                **({"logprobs": self.logprobs if done else []} if self.top_logprobs is not None else {})}
        return {**item, "role": "assistant", "content": [part] if done else [],
                "status": self.status if done else "in_progress"}

    def _append(self, kind: str, text: str, lps=()) -> list[dict]:
        events = []
        if not self.items or self.items[-1]["type"] != kind:
            events += self._close() + self._open(kind)
        self.texts[-1] += text
        self.logprobs += lps
        i = len(self.items) - 1
        if kind == "reasoning":
            return events + [{"type": "response.reasoning_text.delta", **self._where(i), "delta": text}]
        return events + [{"type": "response.output_text.delta", **self._where(i), "delta": text,
                          "logprobs": list(lps)}]

    def _open(self, kind: str) -> list[dict]:
        self.items.append({"id": item_id("rs" if kind == "reasoning" else "msg"), "type": kind})
        self.texts.append("")
        i = len(self.items) - 1
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
            {"type": "output_text", "text": "", "annotations": []}
        return [{"type": "response.output_item.added", "output_index": i, "item": self._item(i, done=False)},
                {"type": "response.content_part.added", **self._where(i), "part": part}]

    def _close(self) -> list[dict]:
        i = len(self.items) - 1
        if i < 0 or i in self.closed:
            return []
        self.closed.add(i)
        item = self._item(i, done=True)
        part = item["content"][0]
        done = {"type": "response.reasoning_text.done", **self._where(i), "text": self.texts[i]} \
            if item["type"] == "reasoning" else \
            {"type": "response.output_text.done", **self._where(i), "text": self.texts[i],
             "logprobs": part.get("logprobs", [])}
        return [done, {"type": "response.content_part.done", **self._where(i), "part": part},
                {"type": "response.output_item.done", "output_index": i, "item": item}]

    def _where(self, i: int) -> dict:
        return {"item_id": self.items[i]["id"], "output_index": i, "content_index": 0}
