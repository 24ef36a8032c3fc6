"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from tokenmill.core.config.engine_config import EngineConfig, load_config
from tokenmill.core.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_searches
from tokenmill.core.engine.builder import build_engine
from tokenmill.core.engine.chat_template import render_chat
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.metrics import EngineMetrics
from tokenmill.core.engine.metrics_reader import Metric, read_metrics
from tokenmill.core.engine import pooling
from tokenmill.core.engine.pooling import PoolingInput
from tokenmill.core.engine.prompt_input import PromptType
from tokenmill.core.engine.rollout import EngineControl
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.interfaces.adapters import LoRARequest
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.outputs import (ClassificationOutput, ClassificationRequestOutput, PoolingOutput,
                                          PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.interfaces.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

Message = dict[str, Any]


class LLM:
    """An engine for offline batches.

    ``LLM("path/to/model", max_num_seqs=64, enable_prefix_caching=True)`` takes
    vLLM's keyword names; any not given come from TOKENMILL_* env vars or the
    defaults. ``LLM.from_config("engine.yaml")`` composes from YAML.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        config: Optional[EngineConfig] = None,
        plugin_manager: Optional[PluginManager] = None,
        **engine_args: Any,
    ) -> None:
        if config is None:
            config = load_config(model=model, **engine_args)
        elif model is not None or engine_args:
            raise TypeError("pass either config= or model/engine arguments, not both")
        self.llm_engine = build_engine(config, plugin_manager)
        self._ids = itertools.count()
        #: the engine's Prometheus metrics (vLLM's names), sampled after every step (get_metrics)
        self._metrics = EngineMetrics(str(config.model)) if isinstance(self.llm_engine, LLMEngine) else None

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> "LLM":
        return cls(config=load_config(path, **overrides))

    def shutdown(self) -> None:
        """Stop the engine's worker processes (multi-process models); also done at exit."""
        if isinstance(self.llm_engine, LLMEngine):
            self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # --- the training-loop API (vLLM 0.32's names; core/engine/rollout.py) ---------
    @property
    def _control(self) -> EngineControl:
        if not isinstance(self.llm_engine, LLMEngine):
            raise InvalidRequest("model", "this is an embedding model: it has no training-loop API")
        return self.llm_engine.control

    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """A worker extension's method on every rank; the results in rank order."""
        return self._control.collective_rpc(method, timeout, args, kwargs)

    def init_weight_transfer_engine(self, request: Union[WeightTransferInitRequest, dict]) -> None:
        self._control.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self._control.start_weight_update()

    def update_weights(self, request: Union[WeightTransferUpdateRequest, dict]) -> None:
        self._control.update_weights(request)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._control.finish_weight_update(weight_version)

    def get_weight_version(self) -> Optional[str]:
        return self._control.get_weight_version()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1), and the weights (level 2); see ``wake_up``."""
        self._control.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Restore ``weights`` and/or ``kv_cache`` (default: both)."""
        self._control.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._control.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self._control.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (vLLM's: Counter, Gauge, Histogram, with the
        names ``/metrics`` serves), from the generate calls so far."""
        if self._metrics is None:
            raise InvalidRequest("model", "this is an embedding model: it keeps no generation metrics")
        return read_metrics(self._metrics.registry)

    def start_profile(self) -> None:
        self._control.start_profile()

    def stop_profile(self) -> list[str]:
        return self._control.stop_profile()

    def embed(self, inputs: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]) -> list[list[float]]:
        """Sentence embeddings of texts or token-id lists (embedding models only)."""
        engine = self.llm_engine
        if not isinstance(engine, EmbeddingEngine):
            raise InvalidRequest("model", "this model generates text; embed() needs an embedding model")
        items = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else list(inputs)
        return engine.embed(engine.tokenize(items)).tolist()

    def encode(self, prompts: Union[PoolingInput, Sequence[PoolingInput]], pooling_task: Optional[str] = None,
               *, use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output (vLLM's ``encode``): its embedding (an embedding
        model; task "embed") or its class logits (a classifier; task "classify")."""
        items = pooling.as_inputs(prompts)
        token_ids = pooling.tokenize(self.llm_engine, items)
        if pooling_task not in (None, "embed", "classify"):
            raise InvalidRequest("pooling_task", f"pooling task {pooling_task!r}: embed or classify")
        if pooling_task == "embed":
            data = pooling.embeddings(self.llm_engine, token_ids)
        elif pooling_task == "classify":
            data = pooling.class_logits(self.llm_engine, token_ids)
        else:
            data = pooling.pooled(self.llm_engine, token_ids)
        return [PoolingRequestOutput(ids, PoolingOutput(row)) for ids, row in zip(token_ids, data)]

    def classify(self, prompts: Union[PoolingInput, Sequence[PoolingInput]], *,
                 use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (the softmax of the classification head's logits)."""
        token_ids = pooling.tokenize(self.llm_engine, pooling.as_inputs(prompts))
        probs = pooling.class_logits(self.llm_engine, token_ids).softmax(-1)
        return [ClassificationRequestOutput(ids, ClassificationOutput(row.tolist())) for ids, row in zip(token_ids, probs)]

    def score(self, text_1: Union[PoolingInput, Sequence[PoolingInput]],
              text_2: Union[PoolingInput, Sequence[PoolingInput]], *, use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """How alike each pair is (vLLM's ``score``: one first text against each second, or N
        against N): the cosine of their embeddings."""
        firsts, seconds = pooling.pair_up(text_1, text_2)
        first_ids, second_ids = (pooling.tokenize(self.llm_engine, items) for items in (firsts, seconds))
        values = pooling.scores(self.llm_engine, first_ids, second_ids)
        return [ScoringRequestOutput(a + b, ScoringOutput(float(v))) for a, b, v in zip(first_ids, second_ids, values)]

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids``; ``prompts`` may be one prompt or a list of them. Without
        ``sampling_params``, ``get_default_sampling_params()``.
        """
        if not isinstance(self.llm_engine, LLMEngine):
            raise InvalidRequest("model", "this is an embedding model; use embed()")
        prompt_list = _as_prompt_list(prompts)
        params = (_per_prompt(sampling_params, len(prompt_list), "sampling_params")
                  or [self.get_default_sampling_params()] * len(prompt_list))
        priorities = _per_prompt(priority, len(prompt_list), "priority") or [0] * len(prompt_list)
        loras = _per_prompt(lora_request, len(prompt_list), "lora_request") or [None] * len(prompt_list)
        return self._run(prompt_list, params, priorities, loras, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no parameters: the model's defaults
        (``generation_config``: its generation_config.json, vLLM's rule), else tokenmill's."""
        return SamplingParams(**self.llm_engine.model_config.sampling_defaults)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: Optional[LoRARequest] = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API); outputs come back in the prompts' order,
        each with ``beam_width`` sequences, best first.

        The search runs as ordinary requests: each round, the live beams of all prompts go
        to the engine together as one-token greedy requests asking for the top-K logprobs,
        so they are batched and, with prefix caching, share their prefix's KV blocks. The
        beams chosen are those of Hugging Face's ``generate(num_beams=beam_width,
        do_sample=False, length_penalty=...)`` (see tokenmill.core.engine.beam_search).
        """
        engine = self.llm_engine
        if not isinstance(engine, LLMEngine):
            raise InvalidRequest("model", "this is an embedding model; use embed()")
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequest("params", f"must be a BeamSearchParams, got {type(params).__name__}")
        if not engine.config.cache.prefix_caching:
            raise InvalidRequest("use_beam_search", "beam search needs prefix caching (each round would "
                                                    "prefill every beam again)")
        searches = []
        #: each prompt's cache_salt, which its beams' requests keep
        salts: dict[BeamSearch, dict] = {}
        for prompt in _as_prompt_list(prompts):
            _, token_ids = engine.tokenize_prompt(prompt)
            if len(token_ids) + params.max_tokens > engine.max_model_len:
                raise InvalidRequest(
                    "max_tokens", f"the prompt has {len(token_ids)} tokens: with max_tokens={params.max_tokens} "
                    f"the beams would pass this model's context of {engine.max_model_len} tokens")
            searches.append(BeamSearch(token_ids, params, engine.model_config.eos_token_ids))
            if isinstance(prompt, dict) and "cache_salt" in prompt:
                salts[searches[-1]] = {"cache_salt": prompt["cache_salt"]}
        step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=searches[0].num_candidates,
                                     ignore_eos=True)
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while live := [search for search in searches if not search.done]:
                pending = [search.pending() for search in live]
                requests = [{"prompt_token_ids": tokens, **salts.get(search, {})}
                            for search, beams in zip(live, pending) for tokens in beams]
                outputs = self.generate(requests, step_params, use_tqdm=False, lora_request=lora_request)
                advance_searches(live, pending, outputs)
                bar.update(1)
        tokenizer = self.get_tokenizer()
        results = []
        for search in searches:
            sequences = search.result()
            for sequence in sequences:
                generated = sequence.tokens[len(search.prompt_token_ids):]
                sequence.text = tokenizer.decode(generated, skip_special_tokens=True)
                sequence.lora_request = lora_request
            results.append(BeamSearchOutput(sequences))
        return results

    def _ensure_adapter(self, lora: Optional[LoRARequest]) -> Optional[str]:
        if lora is None:
            return None
        adapters = self.llm_engine.adapters
        if adapters is None:
            raise InvalidRequest("lora_request", "this engine was built without enable_lora=True")
        if adapters.loaded().get(lora.lora_name) != str(lora.lora_path):
            adapters.load(lora.lora_name, str(lora.lora_path))
        return lora.lora_name

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted by the model's chat template (vLLM's
        options: ``continue_final_message`` continues the last assistant message;
        ``chat_template_kwargs`` are variables for the template)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(conv, chat_template, add_generation_prompt,
                                                          continue_final_message, chat_template_kwargs)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self, conversation: Sequence[Message], chat_template: Optional[str] = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[int]:
        return render_chat(self.get_tokenizer(), conversation, chat_template,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           chat_template_kwargs=chat_template_kwargs)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], priorities: list[int],
             loras: list[Optional[LoRARequest]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        # only final outputs are returned: none is built at the steps before (vLLM does the same)
        final: dict[int, SamplingParams] = {}
        params = [final.setdefault(id(sp), dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
                  if sp.output_kind is not RequestOutputKind.FINAL_ONLY else sp for sp in params]
        for index, (prompt, sp, prio, lora) in enumerate(zip(prompts, params, priorities, loras)):
            request_id = str(next(self._ids))
            # load each adapter just before its request, so the cache never evicts one in use
            engine.add_request(request_id, prompt, sp, priority=prio, adapter_name=self._ensure_adapter(lora))
            order[request_id] = index
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                self._metrics.observe_step(engine, outputs)
                for output in outputs:
                    if output.finished:
                        results[order[output.request_id]] = output
                        in_tokens += len(output.prompt_token_ids)
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"est. speed input: {in_tokens / elapsed:.1f} toks/s, "
                            f"output: {out_tokens / elapsed:.1f} toks/s", refresh=False)
                        bar.update(1)
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise InvalidRequest("prompts", "no prompts given")
    return prompts


def _per_prompt(value: Any, count: int, name: str) -> Optional[list]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise InvalidRequest(name, f"got {len(value)} values for {count} prompts")
    return list(value)
