"""An answer's text as Anthropic content blocks: with `--reasoning-parser`, its `<think>` part becomes
a `thinking` block before the `text` block, as Anthropic's extended thinking returns it.

Whole answers go through `content_blocks`; streams through `BlockStream`, which opens each block when
its first text arrives and sends Anthropic's block events (content_block_start, thinking_delta or
text_delta deltas, a signature_delta closing a thinking block, content_block_stop). The signature
is empty: it vouches for nothing here, and reasoning sent back in later turns is dropped anyway.
"""
from __future__ import annotations

from serving.reasoning import ReasoningStream, split_reasoning
from serving.state import sse

SIGNATURE = ""


def content_blocks(text: str, parser: str | None) -> list[dict]:
    """A whole answer's blocks: [thinking], text. A text block is always there unless the answer is
    all reasoning (cut off before it ended)."""
    if parser is None:
        return [{"type": "text", "text": text}]
    reasoning, answer = split_reasoning(text, parser)
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": SIGNATURE}] if reasoning else []
    if answer or not blocks:
        blocks.append({"type": "text", "text": answer or ""})
    return blocks


class BlockStream:
    """One streamed answer's block events, as server-sent-event strings, in order."""

    def __init__(self, parser: str | None):
        self.splitter = ReasoningStream(parser) if parser else None
        self.index = -1
        self.open: str | None = None      # the type of the block being streamed

    def start(self) -> list[str]:
        """Without a parser every answer is one text block, opened before any text (as always)."""
        return [] if self.splitter else self._switch("text")

    def add(self, text: str) -> list[str]:
        if self.splitter is None:
            return self._text("text", text)
        reasoning, answer = self.splitter.add(text)
        return self._text("thinking", reasoning) + self._text("text", answer)

    def finish(self) -> list[str]:
        events = []
        if self.splitter is not None:
            reasoning, answer = self.splitter.finish()
            events = self._text("thinking", reasoning) + self._text("text", answer)
        if self.open is None and self.index < 0:
            events += self._switch("text")        # an empty answer still has its (empty) text block
        return events + self._close()

    def _text(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = self._switch(kind) if self.open != kind else []
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        return events + [sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                             "content_block_delta")]

    def _switch(self, kind: str) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = kind
        block = {"type": "thinking", "thinking": "", "signature": SIGNATURE} if kind == "thinking" else {"type": "text",
                                                                                                 "text": ""}
        return events + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start")]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(sse({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "signature_delta", "signature": SIGNATURE}}, "content_block_delta"))
        self.open = None
        return events + [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]
