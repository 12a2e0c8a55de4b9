"""A tiny served policy for the OpenAI-endpoint tests: a character tokenizer over printable ASCII
whose chat template renders tools and tool calls in the Hermes style, a random tiny llama over
it, and `stacx serve`'s server around the CPU engine."""

from __future__ import annotations

import string

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<eos>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|assistant|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}<eos>"
    "{%- elif message.role == 'tool' %}<|user|>tool: {{ message.content }}<eos>"
    "{%- else %}<|{{ 'system' if message.role == 'developer' else message.role }}|>{{ message.content }}<eos>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""`<|role|>content<eos>` per message (tools listed in a system line, calls as `<tool_call>{json}</tool_call>`)."""

CONTEXT_LENGTH = 2048


def tool_tokenizer():
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("".join(dict.fromkeys(string.printable)))
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def save_policy(path, tokenizer, seed: int = 0) -> str:
    from stacx.models.testing import save_tiny_hf_checkpoint

    save_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            max_position_embeddings=CONTEXT_LENGTH)
    tokenizer.save_pretrained(path)
    return str(path)


BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                              "parameters": {"type": "object",
                                                             "properties": {"command": {"type": "string"}}}}}
