"""Tokenizer wrapper: incremental detokenization and sandboxed chat templates."""
import os

import pytest

from atlasjax.errors import InvalidRequestError
from atlasjax.tokenizer import IncrementalDetokenizer, Tokenizer

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets")
needs_assets = pytest.mark.skipif(not os.path.isdir(ASSETS), reason="../shared/assets (test tokenizers) not present")


@pytest.fixture(scope="module")
def qwen3():
    return Tokenizer.from_dir(os.path.join(ASSETS, "tokenizers", "qwen3"))


@needs_assets
def test_incremental_detokenization_never_splits_characters(qwen3):
    text = "naïve café — 東京タワー 🙂🚀 ok"
    ids = qwen3.encode(text)
    detok = IncrementalDetokenizer(qwen3, [])
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@needs_assets
def test_chat_template_renders_and_is_sandboxed(qwen3):
    text = qwen3.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    evil = Tokenizer(qwen3.tok, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_clear_error():
    import tokenizers
    tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@needs_assets
def test_continue_final_message(qwen3):
    with open(os.path.join(ASSETS, "chat_templates", "meta-llama-Llama-3.1-8B-Instruct.jinja")) as f:
        llama = qwen3.with_chat_template(f.read())    # trims each message's content
    chat = [{"role": "user", "content": "hi"}]
    for tok in (qwen3, llama):
        closed = tok.apply_chat_template(chat + [{"role": "assistant", "content": "Hello the"}], False)
        open_ = tok.apply_chat_template(chat + [{"role": "assistant", "content": "Hello the "}], False,
                                        continue_final_message=True)
        assert closed.startswith(open_.rstrip()) and open_.rstrip().endswith("Hello the") and len(open_) < len(closed)
        # an empty one: the assistant's turn starts, as with a generation prompt
        assert tok.apply_chat_template(chat + [{"role": "assistant", "content": ""}], False,
                                       continue_final_message=True) == tok.apply_chat_template(chat)
    with pytest.raises(InvalidRequestError, match="assistant"):
        qwen3.apply_chat_template(chat, False, continue_final_message=True)
    drops = qwen3.with_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="cannot be continued"):
        drops.apply_chat_template(chat + [{"role": "assistant", "content": "x"}], False, continue_final_message=True)


@needs_assets
def test_template_variables_a_template_cannot_take_are_request_errors(qwen3):
    # e.g. chat_template_kwargs {"documents": 5} for a template that loops over documents: a 400, not a 500
    tok = qwen3.with_chat_template("{% for d in documents %}{{ d }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="TypeError"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], documents=5)


@needs_assets
def test_an_eos_the_post_processor_appends_is_kept(qwen3):
    """Qwen3-Embedding's tokenizer.json appends <|endoftext|> to every text (the token it pools): encode
    with special tokens must append it as Hugging Face's tokenizer does; without them, and for the plain
    Qwen3 tokenizer, nothing is appended."""
    import tokenizers
    inner = tokenizers.Tokenizer.from_str(qwen3.tok.to_str())
    eos = inner.token_to_id("<|endoftext|>")
    inner.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    embedding = Tokenizer(inner)
    plain = qwen3.encode("hello world")
    assert qwen3.suffix_ids == () and plain[-1] != eos
    assert embedding.encode("hello world") == plain + [eos]
    assert embedding.encode("hello world", add_special_tokens=False) == plain
    assert embedding.encode("hello world<|endoftext|>") == plain + [eos]      # not twice
