"""Reasoning text apart from the answer (`serve --reasoning-parser`, as vLLM's): a chat answer's
`<think>...</think>` part goes to the message's `reasoning_content`, the rest to `content`.

Two parsers, for the two ways models open their reasoning:
  - "qwen3": the model writes `<think>` itself (Qwen3 in thinking mode). An answer that does not
    start with it (thinking switched off, `enable_thinking: false`) is all content.
  - "deepseek_r1": the chat template opens `<think>` in the prompt (DeepSeek-R1 and its distills,
    QwQ, Qwen3 "Thinking" releases), so the answer starts inside the reasoning; a `<think>` it writes
    anyway is dropped. An answer cut off before `</think>` is all reasoning.
The split works on text, so it holds whatever the tags' token ids are. A stream is split as it
arrives (`ReasoningStream`), holding back only text that may still turn out to be a tag.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None where there is none."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.add(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


class ReasoningStream:
    """Splits one answer's text deltas into (reasoning, content) deltas, in order."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        self.parser = parser
        self.state = "start"     # start (the opening tag may come) | reasoning | content
        self.held = ""           # text that may still be (the start of) a tag

    def add(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        self.held += text
        while self.held:
            if self.state == "start":
                if START.startswith(self.held) and self.held != START:
                    break                                   # could still become "<think>"
                if self.held.startswith(START):
                    self.held = self.held[len(START):]
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self.state == "reasoning":
                if END in self.held:
                    before, _, self.held = self.held.partition(END)
                    reasoning += before
                    self.state = "content"
                    continue
                keep = _partial_tag(self.held, END)          # a tail that may begin "</think>"
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            else:
                content += self.held
                self.held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the answer ends."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
