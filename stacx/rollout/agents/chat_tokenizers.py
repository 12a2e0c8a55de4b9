"""Tiny character tokenizers with tool-calling chat templates in the two common formats, built offline.

    tok = build_tool_chat_tokenizer("qwen")     # <|im_start|>role ... <|im_end|>, <tool_call>{json}</tool_call>
    tok = build_tool_chat_tokenizer("llama3")   # <|start_header_id|>role<|end_header_id|> ... <|eot_id|>,
                                                # calls as {"name": ..., "parameters": ...}, results as role ipython
    tok = build_tool_chat_tokenizer("qwen_compact")   # "qwen" with the tools listed in one line: add(a,b)

Tests and toy runs need a tokenizer whose chat template renders `tools=` and tool messages the way
real checkpoints do, without downloading one. The templates below are written for Stacx in the
shape of Qwen2.5's and Llama 3.1's (same markers, same places for tools, calls and results), not
copies of them. Every printable ASCII character and newline is one token; the markers are single
special tokens, the end-of-turn marker is eos.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

QWEN_TOOLS_HEADER = (
    "# Tools\n\nYou may call the functions below. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n\nTo call one, reply with <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>"
)
COMPACT_TOOLS_HEADER = (
    "tools:{% for tool in tools %} {{ tool.function.name }}({{ tool.function.parameters.properties | join(',') }})"
    "{% endfor %}"
)
"""The tools as one line, `tools: add(a,b)`, instead of ~400 characters of JSON schemas. The agent
demo's 2-layer model has to copy the question's numbers into its call, which it learns only when
the question sits close to the reply (docs/performance.md, "The agent demo")."""


def _qwen_style_template(tools_header: str) -> str:
    """The Qwen-style template with `tools_header` (Jinja) as the system text that lists the tools."""
    return (
        "{%- if tools %}<|im_start|>system\n"
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
        + tools_header + "<|im_end|>\n"
        "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
        "\n<tool_response>\n{{ message.content }}\n</tool_response>"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
        "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
        "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
        "{%- endfor %}<|im_end|>\n"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


QWEN_STYLE_TEMPLATE = _qwen_style_template(QWEN_TOOLS_HEADER)
QWEN_COMPACT_TEMPLATE = _qwen_style_template(COMPACT_TOOLS_HEADER)

LLAMA3_STYLE_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- if tools or messages[0].role == 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n"
    "To call a function, reply with only {\"name\": function name, \"parameters\": dictionary of arguments}.\n"
    "Functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- else %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>\n\n"
    "{%- if message.tool_calls %}<|python_tag|>"
    "{%- for call in message.tool_calls %}{% if not loop.first %}; {% endif %}"
    "{\"name\": \"{{ call.function.name }}\", \"parameters\": {{ call.function.arguments | tojson }}}"
    "{%- endfor %}"
    "{%- else %}{{ message.content }}{% endif %}<|eot_id|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

QWEN_MARKERS = ("<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
STYLES = {
    "qwen": (QWEN_STYLE_TEMPLATE, "<|im_end|>", QWEN_MARKERS),
    "qwen_compact": (QWEN_COMPACT_TEMPLATE, "<|im_end|>", QWEN_MARKERS),
    "llama3": (LLAMA3_STYLE_TEMPLATE, "<|eot_id|>",
               ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>")),
}
ALPHABET = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "").replace("\t", "")


def build_tool_chat_tokenizer(style: str):
    """A `PreTrainedTokenizerFast`: <pad> 0, <unk> 1, eos (the end-of-turn marker) 2, the style's markers,
    then one token per character of ALPHABET."""
    # Imported here: transformers is slow to import (start-up time).
    from transformers import PreTrainedTokenizerFast

    if style not in STYLES:
        raise ValueError(f"build_tool_chat_tokenizer: style {style!r} is unknown; known: {sorted(STYLES)}")
    template, eos, markers = STYLES[style]
    specials = ("<pad>", "<unk>", eos, *markers)
    vocab = {token: index for index, token in enumerate(specials)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token=eos, unk_token="<unk>",
                                        additional_special_tokens=list(markers))
    tokenizer.chat_template = template
    return tokenizer
