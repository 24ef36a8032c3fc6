"""The AdapterType contract (LoRA today): per-request weight deltas in a mixed batch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AdapterType(Protocol):
    """Loads adapters from disk and applies their deltas to the tokens that use them."""

    name: str

    def load(self, adapter_name: str, path: str) -> None:
        """Load an adapter; unsupported features fail here, never mid-request."""

    def unload(self, adapter_name: str) -> None: ...

    def apply(
        self,
        prefix: str,
        x: torch.Tensor,  # [num_tokens, in_features]
        output: torch.Tensor,  # [num_tokens, out_features], updated in place
        slot_indices: torch.Tensor,  # [num_tokens] int64, -1 = no adapter
    ) -> None:
        """Add each token's adapter delta for the linear layer at ``prefix``."""
