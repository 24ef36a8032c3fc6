"""The training-loop sections: how a trainer's weights reach the engine, and where profiles go."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tokenmill.core.config.strict import STRICT


class WeightTransferConfig(BaseModel):
    """vLLM's ``WeightTransferConfig``: how a trainer's weights reach the engine."""

    model_config = STRICT

    #: a registered weight-transfer backend: "in_process" (the trainer holds the LLM),
    #: "gloo" (a trainer process over torch.distributed, CPU), "nccl" (the same on CUDA)
    backend: str = "in_process"


class ProfilerConfig(BaseModel):
    """vLLM's ``ProfilerConfig``: where ``start_profile`` / ``stop_profile`` write traces."""

    model_config = STRICT

    profiler: Literal["torch"] = "torch"
    #: the directory each rank's Chrome trace is written to
    torch_profiler_dir: str
