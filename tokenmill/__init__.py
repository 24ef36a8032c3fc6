"""tokenmill: a vLLM-style inference engine where every policy and kernel is a plugin."""

from tokenmill.core.config.engine_config import EngineConfig, load_config
from tokenmill.core.engine.llm import LLM
from tokenmill.interfaces.adapters import LoRARequest
from tokenmill.interfaces.hookspecs import HOOKSPEC_VERSION, hookimpl
from tokenmill.interfaces.types import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "FinishReason",
    "EngineConfig",
    "load_config",
    "hookimpl",
    "HOOKSPEC_VERSION",
]
__version__ = "0.1.0"
