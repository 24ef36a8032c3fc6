"""The built-in logits processors: the request parameters that edit logits, each on the
LogitsProcessor contract (``tokenmill.interfaces.logits_processor``)."""

from __future__ import annotations

from tokenmill.core.sample.logits_processors.allowed_token_ids import AllowedTokenIds
from tokenmill.core.sample.logits_processors.bad_words import BadWords
from tokenmill.core.sample.logits_processors.logit_bias import LogitBias
from tokenmill.core.sample.logits_processors.min_tokens import MinTokens

#: always part of an engine, in the order they apply
BUILTIN_LOGITS_PROCESSORS = (AllowedTokenIds, BadWords, MinTokens, LogitBias)

__all__ = ["AllowedTokenIds", "BadWords", "BUILTIN_LOGITS_PROCESSORS", "LogitBias", "MinTokens"]
