"""A request's prompt as the engine takes it: text, token ids, or vLLM's dict forms, checked
against the model before anything is scheduled, each error naming the field at fault."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tokenmill.interfaces.errors import InvalidRequest

#: a prompt: text, token ids, or vLLM's dict forms
PromptType = Union[str, Sequence[int], dict]
#: a cache_salt is hashed into every block of its request; bounded like every request field
MAX_CACHE_SALT_CHARS = 1024


def tokenize_prompt(tokenizer: Any, prompt: PromptType, vocab_size: int,
                    add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
    """(text or None, token ids) for any accepted prompt form, validated. ``add_special_tokens``
    (vLLM's name) lets a text prompt go without the BOS its tokenizer would add."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequest("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("prompt", "the prompt is not valid Unicode (it has a lone surrogate)") from None
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        return prompt, list(ids)
    return None, check_token_ids(prompt, vocab_size)


def check_token_ids(ids: Any, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequest("prompt_token_ids", "must be a list of integers")
    ids = list(ids)
    if not ids:
        raise InvalidRequest("prompt_token_ids", "the prompt is empty")
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise InvalidRequest("prompt_token_ids",
                                 f"token ids must be integers in [0, {vocab_size}), got {token!r}")
    return ids


def cache_salt(prompt: PromptType) -> Optional[str]:
    """A prompt dict's ``cache_salt`` (vLLM's name): its requests share prefix-cache blocks only
    with requests of the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise InvalidRequest("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt
