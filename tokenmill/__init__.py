"""tokenmill: a vLLM-style inference engine where every policy and kernel is a plugin.

``LLM`` is imported on first use (PEP 562), so that ``tokenmill`` commands that never build
an engine, and the first lines of one that does, do not wait for torch to import.
"""

from typing import Any

from tokenmill.core.config.engine_config import EngineConfig, load_config
from tokenmill.core.config.training_config import WeightTransferConfig
from tokenmill.core.engine.beam_search import BeamSearchParams
from tokenmill.interfaces.adapters import LoRARequest
from tokenmill.interfaces.hookspecs import HOOKSPEC_VERSION, hookimpl
from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.interfaces.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "FinishReason",
    "EngineConfig",
    "WeightTransferConfig",
    "load_config",
    "hookimpl",
    "HOOKSPEC_VERSION",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.core.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
