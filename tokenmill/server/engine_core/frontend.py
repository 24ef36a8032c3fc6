"""EngineFrontend: what the API server reads of an engine that runs in another process.

The server's routes read an engine's config, its model's facts (context window, vocabulary,
sampling defaults), its tokenizer and its plugins, and check each request before it is
admitted. With the engine in a process of its own, this object holds the same, made here
from the same config and model directory without the weights, so that a bad request is
refused with its 400 before it travels, and prompts are tokenized on the server's side.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AutoTokenizer

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import load_model_config
from tokenmill.core.engine.builder import logits_processor_classes, structured_outputs_manager
from tokenmill.core.engine.llm_engine import check_params
from tokenmill.core.engine.prompt_input import PromptType, tokenize_prompt
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.logits_processor import LogitsProcessorContext
from tokenmill.interfaces.sampling_params import SamplingParams


class LoadedAdapters:
    """The LoRA adapters the engine has loaded, as its last answer said (Ready, then each
    runtime load or unload): what /v1/models lists and the ``model`` field may name."""

    def __init__(self, loaded: dict[str, str]) -> None:
        self._loaded = dict(loaded)

    def loaded(self) -> dict[str, str]:
        return self._loaded


class EngineFrontend:
    #: the training-loop API lives with the engine, reached through named engine calls
    control = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.plugin_manager = make_plugin_manager()
        components = collect_components(self.plugin_manager)
        self.model_config = load_model_config(config.model, config.dtype, config.max_model_len, None,
                                              config.generation_config, config.override_generation_config,
                                              config.hf_overrides)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model,
                                                       trust_remote_code=config.trust_remote_code)
        context = LogitsProcessorContext(
            vocab_size=self.model_config.vocab_size, eos_token_ids=self.model_config.eos_token_ids,
            max_num_seqs=config.scheduler.max_num_seqs, device=torch.device("cpu"), tokenizer=self.tokenizer)
        #: compiles constraints here too: an invalid one is a 400 before the request travels
        self.structured_outputs = structured_outputs_manager(config, components, context)
        self._processors = logits_processor_classes(config, components, self.structured_outputs is not None)
        #: set from the engine's Ready message
        self.adapters: Optional[LoadedAdapters] = None

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        return tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size, add_special_tokens)

    def check_params(self, params: SamplingParams) -> None:
        check_params(params, self.model_config, self.structured_outputs, self._processors)
