"""A conversation rendered by a chat template into prompt token ids, with vLLM's options.

One home for the offline ``LLM.chat`` and the server's chat endpoint, so both refuse the
same things the same way (``InvalidRequest`` naming the field).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

from tokenmill.interfaces.errors import InvalidRequest

def _reserved(tokenizer: Any) -> frozenset[str]:
    """apply_chat_template's own arguments (read from the installed transformers), and the
    conversation's name in templates: chat_template_kwargs may not set these."""
    names = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    return frozenset(names | {"messages", "conversation"})


def render_chat(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    chat_template: Optional[str] = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    add_special_tokens: bool = False,
    tools: Optional[list[dict[str, Any]]] = None,
) -> list[int]:
    """The prompt token ids of ``conversation``.

    ``continue_final_message`` leaves the last (assistant) message open for the model to
    continue; ``chat_template_kwargs`` are variables for the template (never the template
    call's own arguments); ``add_special_tokens`` also adds the tokenizer's special tokens to
    the rendered text, which usually has them already (vLLM's default: false); ``tools`` are
    the function definitions offered to the model, for templates that describe them.
    """
    if not conversation:
        raise InvalidRequest("messages", "the conversation is empty")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", "this model has no chat template; use completions or pass chat_template")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message", "needs add_generation_prompt=false")
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise InvalidRequest("continue_final_message", "needs the last message to be the assistant's")
    reserved = _reserved(tokenizer) if chat_template_kwargs else frozenset()
    for key in chat_template_kwargs or {}:
        if key in reserved:
            raise InvalidRequest(f"chat_template_kwargs.{key}", f"{key} is an argument of the template call, "
                                                                "not a template variable; use the field of that name")
    try:
        text = tokenizer.apply_chat_template(
            [dict(message) for message in conversation], chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **dict(chat_template_kwargs or {}))
    except Exception as exc:  # template errors (e.g. raise_exception on bad roles) are the caller's
        raise InvalidRequest("messages", f"the chat template rejected the messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
