"""`tool_choice: "required"` and a named function on the OpenAI-compatible endpoint: a forced call opening.

vLLM constrains decoding to a grammar of the call. Stacx does not: a mask on the logits changes the
distribution the engine samples from, and the trainer, which recomputes log-probs from the plain
model, would train on log-probs of another policy than the one that sampled (and the recorded
log-probs would have to be renormalized over a mask the trainer never sees). Instead the server
writes the opening of the call into the prompt, the way the chat template itself writes a call, and
the model continues it:

    required:        <generation prompt> + "<tool_call>"                                  (Hermes)
    named function:  <generation prompt> + "<tool_call>{\"name\": \"bash\", \"arguments\": " (Hermes)

The opening is read from the served chat template (it renders a probe assistant message holding one
call), so a Llama 3 JSON template gets `{"name": "bash", "parameters": ` the same way. Its ids are
prompt ids: recorded in the turn's prompt, masked 0, never trained on; every id the engine sampled
is still trained with the engine's own log-probs. The answer's calls are parsed from opening +
generated text and validated: a reply that still does not hold a well-formed call (cut by
`max_tokens`, or malformed JSON) comes back with no `tool_calls`, its text as content and the
parser's messages in `stacx.tool_call_errors`, never a made-up call.
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = ["forced_call_opening"]

_ARGUMENTS_PROBE = "stacx_probe_argument"


def forced_call_opening(tokenizer: Any, tools: list[dict], name: Optional[str]) -> str:
    """The text that opens a call in the served template, after the generation prompt: up to the call's
    JSON object (`name` None, tool_choice "required") or up to its arguments (a named function).
    ValueError naming `tool_choice` when the template does not render calls that way."""
    function = name or tools[0]["function"]["name"]
    user = {"role": "user", "content": "?"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": function, "arguments": {_ARGUMENTS_PROBE: 0}}}]}
    prompt = tokenizer.apply_chat_template([user], tools=tools, tokenize=False, add_generation_prompt=True)
    written = tokenizer.apply_chat_template([user, call], tools=tools, tokenize=False, add_generation_prompt=False)
    opened = re.search(r'\{\s*"name"\s*:\s*"' + re.escape(function) + '"', written[len(prompt):]) \
        if written.startswith(prompt) else None
    if opened is None:
        raise ValueError("'tool_choice': the served chat template does not write a tool call as a JSON object "
                         "with its \"name\" first after the generation prompt, so a call cannot be forced; "
                         "use tool_choice \"auto\"")
    reply = written[len(prompt):]
    if name is None:
        return reply[:opened.start()]
    arguments = re.compile(r'\{\s*"' + _ARGUMENTS_PROBE + '"').search(reply, opened.end())
    if arguments is None:
        raise ValueError("'tool_choice': the served chat template writes a call's arguments before its name, so "
                         "a named function cannot be forced; use tool_choice \"required\" or \"auto\"")
    return reply[:arguments.start()]
