"""The batch's token bitmask (xgrammar's layout) applied to the logits in one operation."""

from __future__ import annotations

import torch

from tokenmill.interfaces.logits_processor import on_device


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask for ``rows`` rows, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], t]`` to -inf wherever bit ``t`` of the host ``bitmask[i]`` is clear.
    The packed words cross to the logits' device (a 32nd of the unpacked mask, without a wait)
    and are unpacked there."""
    # a byte per token while unpacking (an int32 per token is 1 GB at 1024 rows of 256k):
    # little-endian words, so token t is bit t % 8 of byte t // 8
    packed = on_device(logits.device, bitmask).view(torch.uint8)
    bits = torch.arange(8, dtype=torch.uint8, device=logits.device)
    blocked = ((packed.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[1]] == 0
    logits[rows] = logits[rows].masked_fill(blocked, float("-inf"))
    return logits


def allow_only(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    """Make ``token_ids`` the only tokens ``row`` allows."""
    bitmask[row] = 0
    for token in token_ids:
        word, bit = divmod(token, 32)
        # int32 holds bit 31 as the sign bit
        value = int(bitmask[row, word]) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
