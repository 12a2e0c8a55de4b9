"""A character-level tokenizer built offline, with a chat template, for tiny models and tests.

    tok = build_char_tokenizer(alphabet="0123456789+= ")   # PreTrainedTokenizerFast
    tok.save_pretrained(checkpoint_dir)                      # next to config.json
    ids = apply_chat_template(tok, [{"role": "user", "content": "1+1"}])

Every character of the alphabet is one token; special tokens are <pad> (0), <eos> (1) and the
role markers <|system|>, <|user|>, <|assistant|>. The chat template renders
`<|role|>content<eos>` per message and `<|assistant|>` as the generation prompt.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from stacx.wire.chat_encoding import chat_ids

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=().,:?!\\{}"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A `PreTrainedTokenizerFast` with one token per character of `alphabet` (in order, after the specials)."""
    # Imported here: transformers is slow to import (start-up time).
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    if len(chars) != len(alphabet):
        raise ValueError("build_char_tokenizer: alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def apply_chat_template(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                        tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (`tools`: the JSON schemas
    of the functions the model may call, as the template renders them). Control-token spellings inside
    the messages are encoded as text (stacx.wire.chat_encoding)."""
    return chat_ids(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
