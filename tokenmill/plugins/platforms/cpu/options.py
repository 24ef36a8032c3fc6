"""The ``platform.cpu`` config section (its flat vLLM-style aliases are ``num_threads``,
``small_batch_gemv``, ``huge_pages`` and ``keep_freed_memory``)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class CpuOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: torch intra-op threads; None = torch's default (OMP_NUM_THREADS, else all cores), the
    #: cores split evenly among the ranks of an ``mp`` engine (they share this machine, as
    #: vLLM's CPU workers bind theirs)
    num_threads: Optional[int] = Field(None, ge=1)
    #: keep plain weights beside the prepacked ones for a streaming GEMV kernel at
    #: batch 1-2 (about 1.5x faster batch-1 decode, twice the weight memory)
    small_batch_gemv: bool = True
    #: keep weights on 2 MB transparent huge pages where the OS offers them (Linux
    #: THP): batch-1 decode, which streams every weight per token, ~1.15x faster
    huge_pages: bool = True
    #: keep freed activation buffers in the process for the next step instead of
    #: returning them to the OS (glibc malloc thresholds, freed_memory.py): a
    #: prompt chunk's activations are faulted in again every step otherwise
    keep_freed_memory: bool = True
