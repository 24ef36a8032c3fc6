"""How a request is sampled: ``SamplingParams`` (vLLM's fields, names and defaults), checked
once at construction, and the small checks the server's request models share with it."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.structured_output import StructuredOutputsParams
#: vLLM's sentinel for "sample from the whole vocabulary".
ALL_TOKENS = -1

#: temperatures below this are greedy, as in vLLM (dividing by them overflows)
SAMPLING_EPS = 1e-5

#: seeds are 64-bit signed integers, as torch's generators and vLLM take them
SEED_RANGE = (-(2**63), 2**63 - 1)

#: OpenAI's bound on a logit_bias value
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each of a request's RequestOutputs holds (vLLM's enum, names and values)."""

    #: everything so far, after every step that advanced the request
    CUMULATIVE = 0
    #: only what is new since the request's previous output: each sequence's new text,
    #: tokens and logprobs (``cumulative_logprob`` stays the running total); the prompt's
    #: logprobs in the first output only
    DELTA = 1
    #: one output, once the request finished: what ``LLM.generate`` returns, and no
    #: output built at the steps before
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; validated once, at construction.

    ``temperature`` below ``SAMPLING_EPS`` means greedy (it is stored as 0). ``logprobs=0`` returns the sampled
    token's logprob only; ``logprobs=k`` adds the top-k. Logprobs are those of
    the model's raw distribution (before penalties and temperature), as vLLM does.
    A ``seed`` makes a request's samples reproducible whatever else is batched with it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = ALL_TOKENS
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: token id -> bias added to its logit before penalties and sampling (OpenAI's logit_bias)
    logit_bias: Optional[Mapping[int, float]] = None
    #: only these token ids may be generated (vLLM)
    allowed_token_ids: Optional[tuple[int, ...]] = None
    #: words that must not be generated: their last token is masked wherever the output
    #: already ends with the tokens before it (vLLM's bad_words)
    bad_words: tuple[str, ...] = ()
    #: keep only this many prompt tokens (-1: as many as the context holds), cut on ``truncation_side``
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Literal["left", "right"] = "left"
    #: arguments for the engine's logits processors (vLLM's extra_args; ``vllm_xargs`` on the wire)
    extra_args: Optional[Mapping[str, Any]] = None
    #: a JSON schema, regex, choice or grammar the output must follow (vLLM's structured_outputs)
    structured_outputs: Optional[StructuredOutputsParams] = None
    #: what each RequestOutput of the request holds (``LLM.generate`` asks for FINAL_ONLY)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: a running request's outputs go out at its first token, then once it has this many new
    #: tokens, and at its end (vLLM's stream_interval): fewer, larger chunks cost a stream less
    stream_interval: int = 1

    #: the largest ``logprobs``/``prompt_logprobs`` accepted (vLLM's default cap)
    MAX_LOGPROBS = 20
    #: every stop string is searched for in each step's new text, and every stop token id
    #: matched against each sampled token: bounded, so that one request cannot slow every
    #: step of the engine (OpenAI allows 4 stop strings; vLLM sets no bound)
    MAX_STOP_STRINGS = 64
    MAX_STOP_STRING_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 1024
    #: bad words are matched against the output at every step, like stop strings
    MAX_BAD_WORDS = 64
    MAX_BAD_WORD_CHARS = 256

    def __post_init__(self) -> None:
        # Accept vLLM's spellings (a single stop string, lists) but store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if isinstance(self.allowed_token_ids, (list, range)):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if is_int(self.output_kind) and self.output_kind in tuple(RequestOutputKind):
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        if isinstance(self.structured_outputs, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._validate()
        # integers are accepted where floats are meant, and stored as floats: torch would make an
        # int64 tensor of them, which 2**63 overflows
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {t: float(b) for t, b in self.logit_bias.items()} or None)

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequest(param, message)

        for name in ("n", "top_k", "min_tokens", "stream_interval"):
            check(is_int(getattr(self, name)), name, "must be an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            # the sampler computes in float32: a value past its range would turn logits into inf / NaN
            check(is_finite(value) and abs(value) <= _FLOAT32_MAX, name,
                  f"must be a finite number within float32's range, got {value!r}")
        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(self.stream_interval >= 1, "stream_interval", f"must be at least 1, got {self.stream_interval}")
        check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == ALL_TOKENS or self.top_k >= 1, "top_k",
              f"must be -1 (disabled) or at least 1, got {self.top_k}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        check(self.repetition_penalty >= _MIN_REPETITION_PENALTY, "repetition_penalty",
              f"must be at least {_MIN_REPETITION_PENALTY:g} (dividing a logit by less overflows float32), "
              f"got {self.repetition_penalty}")
        check(self.seed is None or (is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]), "seed",
              f"must be a 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if self.max_tokens is not None:
            check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                  f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check(is_int(value) and 0 <= value <= self.MAX_LOGPROBS, name,
                      f"must be in [0, {self.MAX_LOGPROBS}], got {value}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be non-empty strings")
        check(len(self.stop) <= self.MAX_STOP_STRINGS and all(len(s) <= self.MAX_STOP_STRING_CHARS for s in self.stop),
              "stop", f"at most {self.MAX_STOP_STRINGS} strings of at most {self.MAX_STOP_STRING_CHARS} characters")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"at most {self.MAX_STOP_TOKEN_IDS} token ids")
        check(self.spaces_between_special_tokens is True, "spaces_between_special_tokens",
              "only true is supported: the fast tokenizers decode special tokens without added spaces")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, Mapping), "logit_bias", "must map token ids to biases")
            for token, bias in self.logit_bias.items():
                check(is_int(token) and token >= 0, "logit_bias", f"keys must be token ids, got {token!r}")
                check(is_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                      f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")

        if self.allowed_token_ids is not None:
            check(isinstance(self.allowed_token_ids, tuple) and len(self.allowed_token_ids) > 0, "allowed_token_ids",
                  "must be a non-empty list of token ids")
            check(all(is_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                  "must be non-negative integers")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
              "must be non-empty strings")
        check(all(is_unicode(w) for w in self.bad_words), "bad_words",
              "must be valid Unicode (a lone surrogate cannot be tokenized)")
        check(len(self.bad_words) <= self.MAX_BAD_WORDS
              and all(len(w) <= self.MAX_BAD_WORD_CHARS for w in self.bad_words), "bad_words",
              f"at most {self.MAX_BAD_WORDS} words of at most {self.MAX_BAD_WORD_CHARS} characters")
        if self.truncate_prompt_tokens is not None:
            check(is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1),
                  "truncate_prompt_tokens", f"must be -1 or at least 1, got {self.truncate_prompt_tokens!r}")
        check(self.truncation_side in ("left", "right"), "truncation_side",
              f"must be 'left' or 'right', got {self.truncation_side!r}")
        if self.structured_outputs is not None:
            check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                  "must be a StructuredOutputsParams")
            # a complete constraint allows only EOS: these would leave it no token, or none that ends it
            check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured outputs")
            check(not self.ignore_eos, "ignore_eos", "cannot be combined with structured outputs")
            # masks of their own: with the constraint's they can leave a row no token at all
            check(self.allowed_token_ids is None, "allowed_token_ids", "cannot be combined with structured outputs")
            check(not self.bad_words, "bad_words", "cannot be combined with structured outputs")
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
              f"must be one of {', '.join(f'{k.value} ({k.name})' for k in RequestOutputKind)}, got {self.output_kind!r}")
        if self.extra_args is not None:
            check(isinstance(self.extra_args, Mapping) and all(isinstance(k, str) for k in self.extra_args),
                  "extra_args", "must map names to values")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def truncated_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt tokens this request keeps (``truncate_prompt``)."""
        return truncate_prompt(token_ids, self.truncate_prompt_tokens, self.truncation_side, max_model_len,
                               self.max_tokens)

    def token_ids(self) -> tuple[tuple[str, int], ...]:
        """(parameter, token id) for every token id the request names, to check against a vocabulary."""
        return tuple([("stop_token_ids", t) for t in self.stop_token_ids]
                     + [("logit_bias", t) for t in self.logit_bias or ()]
                     + [("allowed_token_ids", t) for t in self.allowed_token_ids or ()])


def truncate_prompt(token_ids: list[int], limit: Optional[int], side: str, max_model_len: int,
                    max_tokens: Optional[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep ``limit`` tokens, cut from ``side`` ("left" keeps the
    end); -1 keeps as many as fit beside ``max_tokens``. Applied before the context check, so a
    long prompt can be made to fit."""
    if limit is None:
        return token_ids
    if not is_int(limit) or not (limit >= 1 or limit == -1):
        raise InvalidRequest("truncate_prompt_tokens", f"must be -1 or at least 1, got {limit!r}")
    if limit == -1:
        limit = max(1, max_model_len - (max_tokens or 1))
    if len(token_ids) <= limit:
        return token_ids
    return token_ids[-limit:] if side == "left" else token_ids[:limit]


_FLOAT32_MAX = 3.4028234663852886e38
#: logits are at most a few hundred: dividing by this stays far inside float32
_MIN_REPETITION_PENALTY = 1e-6

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode: JSON's escapes can carry lone surrogates, which
    tokenizers refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """A real number a float holds: not NaN or infinite, and no integer past float's range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
