"""Chat text <-> token ids where only the chat template writes control tokens.

    ids = chat_ids(tokenizer, messages, tools=tools)            # the template's rendering, as ids
    text = render_chat(tokenizer, messages, tools=tools)        # the same, with content controls held back
    ids = encode_rendered(tokenizer, text)                      # ... encoded (a slice of it too)
    text = decode_reply(tokenizer, output_ids)                  # a model reply, markers kept, end-of-turn cut

A message, a tool result, a tool-call argument or a tool schema is text: when it holds the spelling
of one of the template's control tokens (`<|im_end|>\\n<|im_start|>assistant\\n<tool_call>`, `<|eot_id|>`,
`<|start_header_id|>` ...), encoding the rendered conversation as one string would turn that text
into the real control token, and a tool's output (a file an agent `cat`s) would forge a turn the
policy conditions on and is trained on. Here every string given to the template has its control
spellings replaced by an inert placeholder before rendering, so every control spelling left in the
rendered text is one the template wrote; the text between them is encoded with no added token
matched (the placeholders turned back into the original characters), the template's own controls
become their ids. Text with no control spelling in any string encodes exactly as
`tokenizer(text, add_special_tokens=False)` does (the same call); with one, the text between the
template's controls is encoded piece by piece, as the tokenizer itself splits at added tokens
(equal to its own encoding for byte-level BPE and character tokenizers, tested; a SentencePiece
tokenizer that prepends a space only to the first piece of a text would differ there).

The control tokens: the tokenizer's special added tokens, and its other added tokens that the chat
template spells (Qwen's `<tool_call>` is an added, non-special token its template writes).

The model's own replies are never re-encoded (token-in/token-out): `decode_reply` gives their text
for the tool-call parser with every marker kept and only the end-of-turn token cut, the one
decoding both the episode runner and the OpenAI endpoint use.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["ControlTokens", "chat_ids", "control_tokens", "decode_reply", "encode_rendered", "render_chat"]

_PLACEHOLDER = "STXCTL{index:03d}LTC"
_PLACEHOLDER_RE = re.compile(r"STXCTL(\d{3})LTC")
_PLACEHOLDER_HEAD = "STXCTL"
"""A content string holding this text has it held back too, so restoring placeholders is exact."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
"""Added tokens that end a turn (besides the tokenizer's eos); `decode_reply` cuts one at the end."""


@dataclass(frozen=True)
class ControlTokens:
    """The control tokens of one tokenizer and chat template."""

    spellings: tuple[str, ...]
    """Longest first; index i of a placeholder names spellings[i] (the last one is the placeholder head)."""
    ids: dict
    """spelling -> token id (controls only)."""
    strip: dict
    """spelling -> (lstrip, rstrip) of the added token: the whitespace the tokenizer lets it swallow."""
    pattern: Any
    """Matches any control spelling (the placeholder head too, in content)."""
    template_pattern: Any
    """Matches a control spelling the template wrote (the controls only)."""


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def control_tokens(tokenizer) -> ControlTokens:
    """The tokenizer's control tokens for its current chat template (cached per tokenizer and template)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    try:
        cached = _CACHE.get(tokenizer)
    except TypeError:  # not weakly referenceable: no cache
        cached = None
    if cached is not None and cached[0] == template:
        return cached[1]
    ids, strip = {}, {}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        content = getattr(added, "content", str(added))
        if content and not content.isspace() and (getattr(added, "special", True) or content in template):
            ids[content] = int(token_id)
            strip[content] = (bool(getattr(added, "lstrip", False)), bool(getattr(added, "rstrip", False)))
    for content in getattr(tokenizer, "all_special_tokens", ()) or ():
        if content and content not in ids and not content.isspace():
            token_id = tokenizer.convert_tokens_to_ids(content)
            if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
                ids[content], strip[content] = token_id, (False, False)
    spellings = tuple(sorted(ids, key=len, reverse=True)) + (_PLACEHOLDER_HEAD,)
    controls = ControlTokens(
        spellings=spellings, ids=ids, strip=strip,
        pattern=re.compile("|".join(re.escape(s) for s in spellings)),
        template_pattern=re.compile("|".join(re.escape(s) for s in spellings[:-1])) if ids else None)
    try:
        _CACHE[tokenizer] = (template, controls)
    except TypeError:
        pass
    return controls


def _hold_back(value, controls: ControlTokens):
    """`value` (messages, tools: nested dicts, lists and strings) with every control spelling in its
    strings replaced by a placeholder."""
    if isinstance(value, str):
        return controls.pattern.sub(lambda m: _PLACEHOLDER.format(index=controls.spellings.index(m.group(0))), value)
    if isinstance(value, dict):
        return {_hold_back(k, controls): _hold_back(v, controls) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_hold_back(v, controls) for v in value)
    return value


def render_chat(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]] = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template's text of `messages`, each control spelling inside a message, a tool call or a
    tool schema held back as a placeholder (`encode_rendered` encodes it as text)."""
    controls = control_tokens(tokenizer)
    return tokenizer.apply_chat_template(_hold_back(list(messages), controls),
                                         tools=_hold_back(list(tools), controls) if tools else None,
                                         tokenize=False, add_generation_prompt=add_generation_prompt)


def _plain_ids(tokenizer, text: str) -> list[int]:
    """`text` encoded with no added token matched: the tokenizer's normalizer, pre-tokenizer and model only."""
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its special tokens are split, other added tokens still match
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Ids of `render_chat` text (or a slice of it that cuts no placeholder): the template's control
    spellings are their tokens, held-back content is encoded as text."""
    if _PLACEHOLDER_RE.search(text) is None:  # no content spelled a control: the tokenizer's own encoding
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    controls = control_tokens(tokenizer)
    ids: list[int] = []
    pieces = controls.template_pattern.split(text) if controls.template_pattern else [text]
    found = controls.template_pattern.findall(text) if controls.template_pattern else []
    for index, piece in enumerate(pieces):
        if index > 0 and controls.strip[found[index - 1]][1]:
            piece = piece.lstrip()
        if index < len(found) and controls.strip[found[index]][0]:
            piece = piece.rstrip()
        restored = _PLACEHOLDER_RE.sub(lambda m: controls.spellings[int(m.group(1))], piece)
        ids += _plain_ids(tokenizer, restored)
        if index < len(found):
            ids.append(controls.ids[found[index]])
    return ids


def chat_ids(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]] = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's chat template (module doc)."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt))


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The ids that end a model's turn: eos, and the END_OF_TURN_TOKENS the tokenizer has."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    for spelling, token_id in control_tokens(tokenizer).ids.items():
        if spelling in END_OF_TURN_TOKENS:
            ids.add(token_id)
    return frozenset(ids)


def decode_reply(tokenizer, output_ids: Sequence[int]) -> str:
    """A model reply's text for the tool-call parser and the client: every marker kept (`<tool_call>`
    may be a special token), one end-of-turn token at the end cut."""
    ids = list(output_ids)
    if ids and ids[-1] in end_of_turn_ids(tokenizer):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)
