"""Bit packing of integer weights into int32 words, as GPTQ and AWQ store them.

GPTQ packs ``32 // bits`` values along a dimension, lowest bits first. AWQ
(GEMM format) packs 8 nibbles along the output dimension in the interleaved
order 0, 2, 4, 6, 1, 3, 5, 7. These helpers pack and unpack both, for the
loaders and for the tests' and benchmarks' own quantizers.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE[c]


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 values, ``32 // bits`` per word along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    return values.flatten(-2).movedim(-1, dim)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int values in [0, 2**bits) -> int32 words along ``dim`` (inverse of ``unpack``)."""
    per_word = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (grouped << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [rows, cols / 8] -> int32 [rows, cols] in natural column order."""
    nibbles = unpack(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[..., list(AWQ_REVERSE)].flatten(1)


def awq_to_gptq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 ``[K, N / 8]`` -> GPTQ-packed int32 ``[K / 8, N]``, the Triton GEMM's layout.

    It runs on the device at load, so it moves nibbles word by word rather than through
    ``unpack``/``pack``, whose int32 and int64 temporaries take ~20 bytes a parameter (over
    10 GB for a 70B model's largest layer): here the output and one ``[K / 8, N / 8]`` slice
    of temporaries are all it adds to the checkpoint's words.
    """
    k, words = packed.shape
    rows = packed.view(k // 8, 8, words)  # input channel 8 * kb + j at [kb, j]
    out = torch.zeros(k // 8, words, 8, dtype=torch.int32, device=packed.device)  # column 8 * w + c at [w, c]
    for column, nibble in enumerate(AWQ_REVERSE):
        for j in range(8):  # torch's int32 << wraps into the sign bit, as GPTQ's words hold it
            out[:, :, column] |= ((rows[:, j] >> (4 * nibble)) & 15) << (4 * j)
    return out.view(k // 8, words * 8)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] -> AWQ GEMM int32 [rows, cols / 8] (inverse of ``unpack_awq``)."""
    grouped = values.view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack(grouped.flatten(1), 4, dim=1)
