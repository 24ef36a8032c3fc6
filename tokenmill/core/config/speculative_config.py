"""The ``speculative`` section: vLLM's ``speculative_config``, with vLLM's keys.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` or
``{"model": "./draft", "num_speculative_tokens": 3}`` (a model without a method means
``draft_model``). The CLI flag takes the same object as JSON text.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


#: measured with prompt lookup on the demo pair (benchmarks/README.md, "Speculative decoding"): its
#: output throughput is 1.07-1.35x no speculation up to 8 requests, 0.99x at 16, 0.96-0.97x at 32
#: (time per output token better at every size)
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


class SpeculativeConfig(BaseModel):
    """Which proposer drafts tokens for the target model to verify, and how many."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: a registered proposer ("ngram", "draft_model", or a plugin's); None with no model: off
    method: Optional[str] = None
    #: the draft model's directory (method draft_model); it must share the target's tokenizer
    model: Optional[str] = None
    #: tokens proposed per request and step (vLLM: num_speculative_tokens)
    num_speculative_tokens: Optional[int] = Field(None, ge=1, le=64)
    #: n-gram lengths the prompt-lookup proposer matches, longest first (vLLM's defaults: 5 and 5,
    #: or the other one's value when only one is given)
    prompt_lookup_max: Optional[int] = Field(None, ge=1, le=1024)
    prompt_lookup_min: Optional[int] = Field(None, ge=1, le=1024)
    #: no drafts in a step when more requests than this are running or waiting: a large batch
    #: is compute-bound, where verifying drafts costs more than it saves (vLLM's name). Left
    #: out: DEFAULT_DISABLE_BY_BATCH_SIZE; null: never
    disable_by_batch_size: Optional[int] = Field(None, ge=1)
    #: a plugin proposer's own options
    proposer_config: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, value: Any) -> Any:
        """Text from the CLI parsed as JSON; vLLM's defaults filled in before validation (an
        after-validator's assignments would validate again, forever)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            return value  # pydantic's own error names the type
        value = dict(value)
        if value.get("method") is None and value.get("model") is not None:
            value["method"] = "draft_model"
        if value.get("method") is None:
            return value
        if value.get("num_speculative_tokens") is None:
            raise ValueError("num_speculative_tokens is required with a speculative method")
        value.setdefault("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if value["method"] == "draft_model" and value.get("model") is None:
            raise ValueError("method draft_model needs 'model': the draft model's directory")
        if value["method"] == "ngram":
            low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            value["prompt_lookup_min"] = low or high or 5
            value["prompt_lookup_max"] = high or low or 5
        return value

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if (self.prompt_lookup_min or 0) > (self.prompt_lookup_max or 2**31):
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self

    @property
    def enabled(self) -> bool:
        return self.method is not None
