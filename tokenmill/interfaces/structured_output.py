"""The structured-output contract: constraints compiled once, matchers that mask each step.

Shaped after vLLM V1's ``StructuredOutputBackend`` / ``StructuredOutputGrammar``. A
backend (xgrammar, llguidance, a plugin's) compiles a request's constraint once, into a
``CompiledConstraint`` the engine caches by the constraint's key; each sequence gets its
own ``ConstraintMatcher`` from it, which fills that sequence's row of the batch's token
bitmask, advances with every accepted token and can roll back (speculative decoding
rejects tokens). The engine applies the bitmask of the whole batch to the logits in one
operation.

The bitmask is xgrammar's layout: int32 words, ``ceil(vocab_size / 32)`` per row; bit ``j``
of word ``i`` set means token ``32 * i + j`` is allowed.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from tokenmill.interfaces.errors import InvalidRequest

if TYPE_CHECKING:  # SamplingParams carries StructuredOutputsParams, and `import tokenmill` stays torch-free
    import torch

#: the kinds of constraint, by vLLM's field names
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one constraint.

    ``json``: a JSON schema (a dict or its text); ``json_object``: any JSON object;
    ``regex``; ``choice``: one of these strings; ``grammar``: an EBNF grammar (the backend's
    dialect; xgrammar's is GBNF-like). JSON is compact (no free whitespace: vLLM's
    ``disable_any_whitespace``) on every backend; ``disable_additional_properties`` closes
    every object of the schema that does not say whether it takes other properties.
    """

    #: a schema object, or its JSON text (parsed at construction)
    json: Union[str, dict, bool, None] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    #: every schema object without its own ``additionalProperties`` gets ``false`` (vLLM's
    #: field; False leaves it to the backend, which, xgrammar like vLLM's, closes them anyway)
    disable_additional_properties: bool = False
    #: where the constraint came from on the wire, for errors (``response_format``, ``tools``...)
    param: str = "structured_outputs"
    #: the tokens after which the constraint begins (a reasoning model's end of thinking, as the
    #: server's reasoning parser names it): the reply is free until it has written them, and the
    #: constraint holds from the next token on; None: it holds from the reply's first token
    starts_after: Optional[tuple[int, ...]] = None
    #: (the manager that compiled it, the compiled constraint): the request carries its compiled
    #: constraint, so no later step compiles it again, whatever the cache has dropped since
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    #: a constraint's text is compiled and kept in a cache: bounded like every request field
    MAX_SPEC_CHARS = 64 * 1024
    MAX_CHOICES = 256
    MAX_START_TOKENS = 64
    #: a JSON schema's nesting (the request body's own bound): grammar size grows fast with it
    MAX_SCHEMA_DEPTH = 64

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.starts_after is not None:
            object.__setattr__(self, "starts_after", tuple(self.starts_after))
            if not (0 < len(self.starts_after) <= self.MAX_START_TOKENS
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.starts_after)):
                raise InvalidRequest(self.param, f"starts_after must be 1 to {self.MAX_START_TOKENS} token ids")
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(self.param, f"give exactly one of {', '.join(CONSTRAINT_KINDS)}; got "
                                             f"{', '.join(given) or 'none'}")
        if self.choice is not None:
            if not (0 < len(self.choice) <= self.MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequest(self.param, f"choice must be 1 to {self.MAX_CHOICES} non-empty strings")
        for text in (self.regex, self.grammar):
            if text is not None and not isinstance(text, str):
                raise InvalidRequest(self.param, "regex and grammar must be strings")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequest(self.param, "json must be a JSON schema (an object, or its text)")
        if isinstance(self.json, str):
            if len(self.json) > self.MAX_SPEC_CHARS:
                raise InvalidRequest(self.param, f"the constraint is longer than {self.MAX_SPEC_CHARS} characters")
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError):
                raise InvalidRequest(self.param, "invalid json constraint: not a JSON document") from None
            object.__setattr__(self, "json", schema)
        if isinstance(self.json, (dict, list)) and _depth(self.json) > self.MAX_SCHEMA_DEPTH:
            raise InvalidRequest(self.param, f"the JSON schema nests deeper than {self.MAX_SCHEMA_DEPTH} levels")
        if self.disable_additional_properties and isinstance(self.json, dict):
            object.__setattr__(self, "json", _closed(self.json))
        if len(self.spec) > self.MAX_SPEC_CHARS:
            raise InvalidRequest(self.param, f"the constraint is longer than {self.MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a schema as compact JSON in its own key order (the order of
        ``properties`` is the order the reply writes them), choices as a JSON list."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, str]:
        """What the compile cache is keyed by."""
        return self.kind, self.spec


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that sets none."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _depth(value: Any) -> int:
    """How deep JSON containers nest (iteratively: the value may be deeper than Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class InvalidConstraint(ValueError):
    """A constraint the backend cannot compile (a bad schema, regex or grammar): the caller's 400."""


@dataclass(frozen=True)
class StructuredOutputContext:
    """What a backend is built with."""

    #: the model's tokenizer (Hugging Face)
    tokenizer: Any
    #: the model's vocabulary (may exceed the tokenizer's: padded embeddings); bitmask width
    vocab_size: int
    #: the ids that end a sequence: a completed constraint allows only these
    eos_token_ids: tuple[int, ...]


class ConstraintMatcher(ABC):
    """One sequence's place in a compiled constraint."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (all bits, allowed or not)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance with a generated token; False (state unchanged) when the token breaks the
        constraint."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete (only an end-of-sequence token may follow)."""


class CompiledConstraint(ABC):
    """A compiled constraint, shared by every request with the same key."""

    @abstractmethod
    def new_matcher(self) -> ConstraintMatcher:
        """A matcher at the start of the constraint."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer. Registered with
    ``register_structured_output_backends`` and built as ``cls(StructuredOutputContext)``."""

    def __init__(self, context: StructuredOutputContext) -> None:
        self.context = context

    @abstractmethod
    def supports(self, kind: str) -> bool:
        """Whether this backend compiles constraints of ``kind`` (one of CONSTRAINT_KINDS)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """Compile ``params``' constraint; raise InvalidConstraint for a bad one. Called off the
        step loop, maybe from several threads at once, so it must be thread-safe."""
