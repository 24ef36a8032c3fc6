r"""The llguidance backend (vLLM's ``guidance``): JSON schemas, JSON objects, regexes, choices
and Lark grammars.

Differences from the xgrammar backend a caller can see:

* ``grammar`` is llguidance's **Lark** dialect (``start: "a" b`` with ``/regex/`` terminals,
  https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md), not xgrammar's
  EBNF/GBNF. As in vLLM, a grammar that is not Lark is read as llama.cpp GBNF
  (``root ::= ...``) and converted; xgrammar-only EBNF extensions may not convert. The
  ``grammar`` kind is backend-specific.
* ``regex`` is the Rust ``regex`` crate's syntax (no lookaround or backreferences; ``\d``
  and ``\w`` are Unicode's, as in Python's ``re``, where xgrammar's are ASCII).
* JSON is compact: ``,`` and ``:`` with no space (xgrammar's separators are ``, `` and
  ``: ``). Strings hold no raw control characters; they take the escapes ``\" \\ \b \f
  \n \r \t`` and ``\u00XX`` for control characters only (llguidance's defaults), in
  strings of any length (xgrammar's length-bounded strings take no escapes).
* A number's bounds bound its value, not its digits (xgrammar stops a bounded number at 6
  fraction digits).
* JSON schemas are llguidance's JSON Schema subset (no lookaround in ``pattern``, no
  ``not``...); an ``x-guidance`` key in a schema may set llguidance's JSON options, as in
  vLLM. The boolean schema ``true`` is taken as ``{}``.
"""

from __future__ import annotations

import json
import threading

import llguidance
import llguidance.hf
import llguidance.torch
import structlog
import torch

from tokenmill.interfaces.structured_output import (
    CompiledConstraint,
    ConstraintMatcher,
    InvalidConstraint,
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputsParams,
)

log = structlog.get_logger("tokenmill.structured_output.guidance")

#: compact JSON, as the xgrammar backend (and vLLM's ``disable_any_whitespace``): no free
#: whitespace between tokens, so a weak model cannot fill its budget with spaces
_JSON_OPTIONS = {"whitespace_flexible": False}


class GuidanceMatcher(ConstraintMatcher):
    """An ``LLMatcher`` behind the contract.

    ``LLMatcher.consume_token`` with a token the grammar refuses puts the matcher in an error
    state it never leaves, so a token is validated before it is consumed. Once the grammar is
    complete (stopped), end-of-sequence tokens are accepted without reaching llguidance and
    counted, so that ``rollback`` undoes them first."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: frozenset[int], words: int, vocab_size: int) -> None:
        self._matcher = matcher
        self._eos = eos
        #: the bitmask row width llguidance writes (its tokenizer's vocabulary, in int32 words)
        self._words = words
        self._vocab_size = vocab_size
        #: end-of-sequence tokens accepted after the grammar stopped (always the last ones)
        self._after_stop = 0
        self._logged_error = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # a stopped (or failed) matcher writes a mask of the end-of-sequence tokens alone
        target = bitmask[row]
        if bitmask.is_cpu and bitmask.dtype == torch.int32 and target.is_contiguous() \
                and target.numel() == self._words:
            llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        else:  # a row of another width (a tokenizer wider than the model's vocabulary)
            scratch = torch.empty((1, self._words), dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(self._matcher, scratch, 0)
            width = min(self._words, target.numel())
            target.zero_()
            target[:width] = scratch[0, :width].to(target.device)
        self._check_error()

    def accept_token(self, token: int) -> bool:
        if not 0 <= token < self._vocab_size:
            return False
        matcher = self._matcher
        if matcher.is_stopped():
            if token in self._eos and not matcher.is_error():
                self._after_stop += 1
                return True
            return False
        if matcher.validate_tokens([token]) != 1:
            return False
        ok = matcher.consume_token(token)
        self._check_error()
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        after_stop = min(num_tokens, self._after_stop)
        self._after_stop -= after_stop
        if num_tokens > after_stop and not self._matcher.rollback(num_tokens - after_stop):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error() or 'too many'}")

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def _check_error(self) -> None:
        if not self._logged_error and self._matcher.is_error():
            # a resource limit hit mid-generation: the matcher now allows only end-of-sequence
            self._logged_error = True
            log.warning("llguidance matcher failed; ending the sequence", error=_message(self._matcher.get_error()))


class GuidanceConstraint(CompiledConstraint):
    """A matcher at the start of the grammar, deep-copied for each sequence (copying is cheap;
    building one compiles the grammar's lexer again)."""

    def __init__(self, template: llguidance.LLMatcher, eos: frozenset[int], words: int, vocab_size: int) -> None:
        self._template = template
        self._eos = eos
        self._words = words
        self._vocab_size = vocab_size
        self._lock = threading.Lock()

    def new_matcher(self) -> ConstraintMatcher:
        with self._lock:
            matcher = self._template.deep_copy()
        return GuidanceMatcher(matcher, self._eos, self._words, self._vocab_size)


class GuidanceBackend(StructuredOutputBackend):
    """Constraints compiled by llguidance. ``grammar`` is llguidance's Lark dialect (GBNF is
    converted), unlike xgrammar's EBNF; see the module docstring. JSON is compact (no free
    whitespace between tokens) and its strings hold no raw control characters."""

    def __init__(self, context: StructuredOutputContext) -> None:
        super().__init__(context)
        tokenizer = context.tokenizer
        eos = list(context.eos_token_ids) or None
        # the bitmask is as wide as the model's vocabulary, which may exceed the tokenizer's
        # (ids past the tokenizer's are never allowed)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(context.vocab_size, len(tokenizer)),
                                                       eos_token=eos)
        self._eos = frozenset(self._tokenizer.eos_tokens)
        self._words = (self._tokenizer.vocab_size + 31) // 32

    def supports(self, kind: str) -> bool:
        return kind in ("json", "json_object", "regex", "choice", "grammar")

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        grammar = _grammar(params.kind, params.spec)
        # LLMatcher never raises for a bad grammar: it starts in an error state instead. It
        # drops the GIL while it builds, and the tokenizer is shared read-only, so compiles
        # on several threads at once are safe.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidConstraint(_message(matcher.get_error()))
        return GuidanceConstraint(matcher, self._eos, self._words, self.context.vocab_size)


def _grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text for a constraint (not yet checked)."""
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(_object_schema(spec), defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_grammar(json.loads(spec)))
        # Lark as is; anything else is taken for GBNF and converted (this raises ValueError)
        return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError) as exc:  # a schema that is not a JSON object; GBNF that does not convert
        raise InvalidConstraint(_message(str(exc))) from None


def _object_schema(spec: str) -> str:
    """The schema, with JSON Schema's boolean schemas (``true``: anything, ``false``: nothing)
    as the objects they stand for: llguidance takes only an object (its options go in it)."""
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise InvalidConstraint(f"the JSON schema is not JSON: {exc}") from None
    if isinstance(schema, bool):
        return json.dumps({} if schema else {"not": {}})
    return spec


def _choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose only sentences are the choices: each a string literal (Lark's
    literals take JSON's escapes; non-ASCII is kept as is, not as surrogate-pair escapes)."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _message(text: str, limit: int = 500) -> str:
    """llguidance's error on one line: its carets and source excerpts dropped."""
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = [line for line in lines if line and set(line) - set("^ ") and not _is_excerpt(line)]
    message = " ".join(kept) or "invalid constraint"
    return message[:limit]


def _is_excerpt(line: str) -> bool:
    """``  12 | start: /(/``: the source line llguidance quotes under an error."""
    number, bar, _ = line.partition("|")
    return bool(bar) and number.strip().isdigit()

