"""The chat template's ids after an assistant turn: what follows the ids a model generated.

    ids = ids_after_assistant_turn(tokenizer, history, new_messages, tools=tools, generated_ids=output_ids)
    next_prompt = prompt_ids + output_ids + ids

The one rule both the episode runner (`stacx.rollout.agents.episode`, the observation after each action) and
the OpenAI endpoint's sessions (`stacx.serving.openai_sessions`, the next request's prompt)
use. With A an assistant message whose content is a marker:

    before = render(history + [A])
    after  = render(history + [A] + new_messages, generation prompt)
    close  = before's text after the marker                  (e.g. "<|im_end|>\\n", or "<|eot_id|>")
    ids    = encode(close without what the engine generated of it + after[len(before):])

`close` is the template's end of an assistant message: the engine generated its start itself when it
stopped on the end-of-turn token (then only "\\n" is left of Qwen's "<|im_end|>\\n"), and none of it
when max_tokens cut the reply. The generated ids are never re-tokenized. Content is encoded with
control spellings held back (`stacx.wire.chat_encoding`): a tool result cannot forge a turn.

None when the template cannot continue: it writes no assistant content, renders `history` and
the assistant turn differently once more messages follow (the conversation is not a prefix of the
longer one), or does not end a turn with the end-of-turn token the engine stopped on.

Free of engine, server and driver imports (a wire-format module).
"""

from __future__ import annotations

from typing import Optional, Sequence

from stacx.wire.chat_encoding import encode_rendered, end_of_turn_ids, render_chat

__all__ = ["ASSISTANT_MARK", "ids_after_assistant_turn"]

ASSISTANT_MARK = "\x00stacx-assistant-content\x00"
"""The assistant message's content in the renderings (never encoded: only the text after it is)."""


def ids_after_assistant_turn(tokenizer, history: Sequence[dict], new_messages: Sequence[dict], *,
                             tools: Optional[Sequence[dict]] = None,
                             generated_ids: Sequence[int] = ()) -> Optional[list[int]]:
    """The ids that follow `generated_ids` (the assistant turn answering `history`): the rest of the
    template's close of that turn, `new_messages` and the generation prompt (module doc)."""
    turn = list(history) + [{"role": "assistant", "content": ASSISTANT_MARK}]
    before = render_chat(tokenizer, turn, tools=tools, add_generation_prompt=False)
    after = render_chat(tokenizer, turn + list(new_messages), tools=tools, add_generation_prompt=True)
    at = before.rfind(ASSISTANT_MARK)
    if at < 0 or not after.startswith(before):
        return None
    close = before[at + len(ASSISTANT_MARK):]
    if generated_ids:  # the engine may have generated the start of the close itself (its stop token)
        last = tokenizer.decode(list(generated_ids[-1:]), skip_special_tokens=False)
        if last and close.startswith(last):
            close = close[len(last):]
        elif generated_ids[-1] in end_of_turn_ids(tokenizer):
            return None  # the engine stopped on an end-of-turn token the template does not end a turn with
    return encode_rendered(tokenizer, close + after[len(before):])
