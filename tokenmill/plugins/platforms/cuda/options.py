"""The ``platform.cuda`` config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CudaOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: the share of the GPU's memory the engine may use, weights and KV cache together; the KV
    #: cache gets what the weights and activations leave of it (vLLM's gpu_memory_utilization)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    #: GiB of weights kept in host memory and streamed in per step (vLLM's cpu_offload_gb); only
    #: 0 is supported: the weights must fit the GPUs
    cpu_offload_gb: float = Field(0, ge=0)
