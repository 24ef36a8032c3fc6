"""The xgrammar backend: JSON schemas, JSON objects, regexes, choices and EBNF grammars."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from tokenmill.interfaces.structured_output import (
    CompiledConstraint,
    ConstraintMatcher,
    InvalidConstraint,
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputsParams,
)


class XGrammarMatcher(ConstraintMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarConstraint(CompiledConstraint):
    def __init__(self, grammar: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self._grammar = grammar
        self._stop = stop_token_ids

    def new_matcher(self) -> ConstraintMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self._grammar, override_stop_tokens=self._stop))


class XGrammarBackend(StructuredOutputBackend):
    """JSON is compiled with fixed separators and no free whitespace, as vLLM does with
    ``disable_any_whitespace``: otherwise a weak model can fill its budget with spaces and
    never close the object."""

    def __init__(self, context: StructuredOutputContext) -> None:
        super().__init__(context)
        info = xgr.TokenizerInfo.from_huggingface(context.tokenizer, vocab_size=context.vocab_size,
                                                  stop_token_ids=list(context.eos_token_ids))
        # the engine caches compiled constraints itself (bounded); xgrammar's cache has no bound
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def supports(self, kind: str) -> bool:
        return True

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        kind, spec = params.kind, params.spec
        try:
            if kind in ("json", "json_object"):
                grammar = self._compiler.compile_grammar(_json_grammar(spec if kind == "json" else '{"type": "object"}'))
            elif kind == "regex":
                grammar = self._compiler.compile_regex(spec)
            elif kind == "choice":
                grammar = self._compiler.compile_grammar(_choice_grammar(json.loads(spec)))
            else:
                grammar = self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as these
            raise InvalidConstraint(_first_line(exc)) from None
        return XGrammarConstraint(grammar, list(self.context.eos_token_ids))


#: the character class xgrammar gives strings with a length bound: it lets control characters
#: through, which JSON allows only escaped (xgrammar's unbounded strings exclude them)
_LENIENT_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str) -> str:
    """The schema's grammar (compact JSON), with JSON's own string characters everywhere."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return grammar.replace(_LENIENT_STRING_CHAR, _JSON_STRING_CHAR)


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's)."""
    # ensure_ascii=False: xgrammar reads a surrogate-pair escape as two broken characters
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


#: xgrammar prefixes its messages with a time and a C++ source location
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]
