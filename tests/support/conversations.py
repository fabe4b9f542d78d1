"""Conversation trace records as generate_shard writes them (/work/notes/conv_contract.md), token-exact with
the toy target's real tokenizer: each turn's prompt is ``chat_prompt_ids`` of the conversation so far, the
target's earlier answers in it, and its completion is what the server generates after the template's
generation prompt (``<|assistant|><think>\\n``): the reasoning, ``</think>\\n``, the content, then eos."""
from eaglenest.states.target import chat_prompt_ids

# The toy template with two things the toy's own lacks, as real templates (Qwen3's) have them: tool turns
# (rendered after the toy's system marker: the toy has no tool token) and past answers with their reasoning,
# kept only for the answers after the last user turn (a tool-call loop); earlier answers lose it, so the
# prompt after a new user turn renders them otherwise than the target wrote them. ``keep_all``: every
# answer keeps its reasoning, rendered exactly as generated.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' or m['role'] == 'tool' -%}{{- '<|system|>' + m['content'] -}}"
    "{%- elif m['role'] == 'user' -%}{{- '<|user|>' + m['content'] -}}"
    "{%- else -%}{{- '<|assistant|>' -}}"
    "{%- if (keep_all or loop.index0 > ns.last_user) and m['reasoning_content'] -%}"
    "{{- '<think>\\n' + m['reasoning_content'] + '</think>\\n' -}}{%- endif -%}"
    "{{- m['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|><think>\\n' -}}{%- endif -%}"
)

MARKERS = {"system": "<|system|>", "user": "<|user|>", "tool": "<|system|>"}


def conversation_record(tokenizer, messages, answers, template_kwargs=None, rid="c0", truncated_last=False):
    """The trace record of a conversation: ``messages`` the data's system, user and tool turns with an
    ``{"role": "assistant"}`` slot for each answer; ``answers`` the target's ``(reasoning, content)`` of each
    slot, in order; ``template_kwargs`` go to the chat template (``chat_template``: another template)."""
    answers, so_far, turns = iter(answers), [], []
    for m in messages:
        if m["role"] != "assistant":
            so_far.append(m)
            continue
        reasoning, content = next(answers)
        prompt = chat_prompt_ids(tokenizer, so_far, template_kwargs)
        completion = tokenizer.encode(f"{reasoning}</think>\n{content}", add_special_tokens=False) + [tokenizer.eos_token_id]
        turns.append({"prompt_token_ids": prompt, "completion_token_ids": completion, "reasoning": reasoning,
                      "content": content, "tool_calls": None, "finish_reason": "stop", "truncated": False,
                      "usage": {"completion_tokens": len(completion)}})
        so_far.append({"role": "assistant", "content": content, "reasoning_content": reasoning})
    if truncated_last:
        turns[-1].update(finish_reason="length", truncated=True)
    last = turns[-1]
    return {"id": rid, "source": "test", "messages": so_far,
            **{k: last[k] for k in ("prompt_token_ids", "completion_token_ids", "reasoning", "content",
                                    "finish_reason", "truncated", "usage")},
            "turns": turns, "ended": "truncated" if truncated_last else "done", "turns_dropped": 0}


def data_turn_tokens(tokenizer, message):
    """The tokens a system, user or tool turn renders as (its marker, then its text)."""
    return tokenizer.encode(MARKERS[message["role"]] + message["content"], add_special_tokens=False)
