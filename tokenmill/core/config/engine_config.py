"""The engine's configuration tree: defaults < YAML file < TOKENMILL_* env < arguments.

Every section forbids unknown keys, so a typo fails with its dotted path
instead of being silently ignored. vLLM's flat keyword names
(``max_num_seqs``, ``enable_prefix_caching``, ...) map onto the tree through
``flat_names.VLLM_NAMES`` and are used by both ``LLM(...)`` and the CLI flags.
"""

from __future__ import annotations

import contextvars
import json
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from tokenmill.core.config.compilation_config import CompilationConfig
from tokenmill.core.config.flat_names import SERVER_NAMES, VLLM_NAMES
from tokenmill.core.config.server_config import ServerConfig
from tokenmill.core.config.speculative_config import SpeculativeConfig
from tokenmill.core.config.strict import STRICT
from tokenmill.core.config.structured_outputs_config import StructuredOutputsConfig
from tokenmill.core.config.training_config import ProfilerConfig, WeightTransferConfig
from tokenmill.interfaces.errors import ConfigError


class SchedulerConfig(BaseModel):
    model_config = STRICT

    policy: str = "fifo"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=1)
    chunked_prefill: bool = True
    #: with chunked prefill, the most prompt tokens one request computes in a step (0: up to
    #: the step's budget), so that a long prompt shares each step with others' prefills
    #: instead of filling it (vLLM: long_prefill_token_threshold)
    long_prefill_token_threshold: int = Field(0, ge=0)
    #: recompute: a victim's KV is dropped and recomputed later; swap: it is copied to
    #: the host swap space (cache.swap_space) and back, falling back to recompute when full
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    #: options of the chosen policy, validated by the policy itself
    policy_config: dict[str, Any] = {}
    #: schedule and launch step N+1 before step N's result is read, its decode rows taking
    #: N's sampled tokens on the device (vLLM: async_scheduling), so that a GPU runs N+1 while
    #: the host reads, detokenizes and schedules (the rules: core/sched/scheduler.py). None
    #: (auto, vLLM's default): on where the model runs on a device other than the host, in one
    #: process, without speculative decoding; off on the CPU, where the forward pass runs on the
    #: host and there is nothing to overlap. True where it cannot serve is refused at startup
    async_scheduling: Optional[bool] = None


class CacheConfig(BaseModel):
    model_config = STRICT

    block_size: int = Field(16, ge=1, le=1024)
    #: number of KV blocks; overrides kv_cache_memory (vLLM: num_gpu_blocks_override)
    num_blocks: Optional[int] = Field(None, ge=1)
    #: KV-cache budget in bytes ("4GiB" works). Unset: the platform's default (host memory:
    #: 2 GiB, and the pool never exceeds what max_num_seqs sequences of max_model_len tokens
    #: could use; a GPU: what gpu_memory_utilization leaves). Set, it overrides
    #: gpu_memory_utilization (vLLM's kv_cache_memory_bytes)
    kv_cache_memory: Optional[ByteSize] = None
    prefix_caching: bool = True
    #: what K/V are stored in: "auto" is the compute dtype; "bfloat16" halves an fp32
    #: model's cache (memory, and the bytes decode attention reads every step) at bf16's
    #: 8-bit mantissa, with scores and softmax still fp32 (vLLM's --kv-cache-dtype)
    kv_cache_dtype: Literal["auto", "bfloat16"] = "auto"
    #: host memory for swapped-out KV blocks (used with scheduler.preemption_mode: swap)
    swap_space: ByteSize = ByteSize(1024**3)


class AttentionConfig(BaseModel):
    model_config = STRICT

    #: a registered backend name, or "auto" (the select_attention_backend hook decides)
    backend: str = "auto"


class QuantizationConfig(BaseModel):
    model_config = STRICT

    #: None detects it from the checkpoint's quantization_config; "fp8" on an
    #: unquantized checkpoint quantizes its weights at load
    method: Optional[str] = None
    #: apply the checkpoint's activation quantization (FP8 W8A8 schemes); off = weight-only
    quantize_activations: bool = True
    #: how FP8 linears multiply: "scaled_mm" keeps the e4m3 weights (1 byte per parameter) of
    #: per-tensor and per-channel W8A8 schemes and multiplies FP8 by FP8 with torch._scaled_mm;
    #: "triton" keeps a 128x128-block checkpoint's e4m3 weights and block scales and multiplies
    #: with a Triton GEMM that widens weight tiles in registers (block schemes only; on a CPU it
    #: needs TRITON_INTERPRET=1); "dequantize" widens the weights once, at load; "auto" is
    #: scaled_mm or triton (by scheme) where the weights live on a GPU, dequantize elsewhere (a
    #: CPU has no FP8 arithmetic). Other weight-only schemes always dequantize, and scaled_mm
    #: leaves block schemes to dequantize
    fp8_kernel: Literal["auto", "scaled_mm", "triton", "dequantize"] = "auto"


class AdaptersConfig(BaseModel):
    model_config = STRICT

    enable_lora: bool = False
    #: distinct adapters in one batch
    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    #: adapters kept loaded (LRU); None = max_loras
    max_cpu_loras: Optional[int] = Field(None, ge=1)
    #: adapters loaded at startup: name -> PEFT directory
    lora_modules: dict[str, str] = {}
    #: directories runtime loads may read from (paths outside are refused)
    allowed_lora_dirs: list[str] = []
    #: enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    allow_runtime_lora_updating: bool = False


class ParallelConfig(BaseModel):
    """How a model spans ranks (vLLM's names): tensor parallelism splits every layer over
    ``tensor_parallel_size`` ranks, pipeline parallelism splits the layer stack into
    ``pipeline_parallel_size`` stages; the executor decides where the ranks run."""

    model_config = STRICT

    tensor_parallel_size: int = Field(1, ge=1, le=512)
    pipeline_parallel_size: int = Field(1, ge=1, le=512)
    #: "uni" (one process), "mp" (worker processes on this machine), "ray" (Ray actors,
    #: placed by a placement group, possibly on several machines) or a plugin's executor.
    #: None: uni for one rank, mp for more (vLLM's default on one machine)
    distributed_executor_backend: Optional[str] = None
    #: seconds a collective may wait for another rank before the engine declares it failed
    #: (a rank that dies is noticed at once: its connections close)
    distributed_timeout_seconds: float = Field(60.0, gt=0, le=86400)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


class PlatformConfig(BaseModel):
    """``name``, and one section per platform (``cpu: {num_threads: 4}``): each section is
    validated by its platform's ``options_model`` when the engine is built, and a section
    for a platform that is not registered is an error there."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    #: a registered platform ("cpu", a plugin's), or "auto": the usable one with the highest priority
    name: str = "auto"

    def sections(self) -> dict[str, Any]:
        """Platform name -> its section as given."""
        return dict(self.model_extra or {})


#: the fields vLLM's flags give as JSON text (``--compilation-config '{"custom_ops": ["none"]}'``)
JSON_FIELDS = ("override_generation_config", "hf_overrides", "structured_outputs", "weight_transfer_config",
               "profiler_config", "compilation_config")


def json_object(text: str) -> Any:
    """``text`` parsed as JSON, or a ValueError naming what is wrong with it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object: {exc}") from None


class EngineConfig(BaseSettings):
    """The whole engine, as one validated tree."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENMILL_", env_nested_delimiter="__", extra="forbid",
        validate_assignment=True,
    )

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    max_model_len: Optional[int] = Field(None, ge=1)
    trust_remote_code: bool = False
    #: no CUDA graphs: every decode step launches its kernels one by one (vLLM's enforce_eager;
    #: the platform's kernels are compilation_config.custom_ops')
    enforce_eager: bool = False
    #: which of the platform's kernels run (vLLM's compilation_config; custom_ops only):
    #: {"custom_ops": ["none"]} is plain PyTorch everywhere, the reference the kernels are tested against
    compilation_config: CompilationConfig = CompilationConfig()
    #: logits processors to add to the built-ins: registered names or 'module:Class' paths (vLLM: logits_processors)
    logits_processors: list[str] = []
    #: where requests' sampling defaults come from (vLLM's): "auto", the model's
    #: generation_config.json; "vllm", none (OpenAI's defaults); or a directory holding one
    generation_config: str = "auto"
    #: sampling defaults over those (generation_config.json's names: temperature, max_new_tokens, ...)
    override_generation_config: dict[str, Any] = {}
    #: what sampled tokens' logprobs are (vLLM's logprobs_mode): the raw distribution's
    #: logprobs or logits, or those of the distribution the token was drawn from, after the
    #: processors, penalties, temperature and truncation ("processed_logprobs": RL's ratios)
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = "raw_logprobs"
    #: accept a trainer's weights (vLLM's weight_transfer_config): init_weight_transfer_engine,
    #: then update_weights; the model keeps its plain weights beside the platform's packed copies
    weight_transfer_config: Optional[WeightTransferConfig] = None
    #: allow sleep() / wake_up() (vLLM's enable_sleep_mode); the model keeps its plain weights
    enable_sleep_mode: bool = False
    #: where start_profile() / stop_profile() write torch profiler traces (vLLM's profiler_config)
    profiler_config: Optional[ProfilerConfig] = None
    #: keys of the model's config.json replaced before anything reads it (vLLM: hf_overrides);
    #: an object value merges into the file's object of that name (rope_scaling's keys)
    hf_overrides: dict[str, Any] = {}
    platform: PlatformConfig = PlatformConfig()
    parallel: ParallelConfig = ParallelConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    attention: AttentionConfig = AttentionConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    server: ServerConfig = ServerConfig()

    @field_validator(*JSON_FIELDS, mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """The CLI's text, as vLLM's flag takes it: a JSON object."""
        return json_object(value) if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)


_yaml_data: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "tokenmill_yaml_config", default={}
)


class _YamlSource(PydanticBaseSettingsSource):
    """The YAML file's values, below env vars and arguments."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _yaml_data.get().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get())


def load_config(
    path: str | Path | None = None, /, **overrides: Any
) -> EngineConfig:
    """Resolve the config from a YAML file, TOKENMILL_* env vars and explicit values.

    ``overrides`` take vLLM's flat names (``max_num_seqs=4``) or tree sections
    (``scheduler={"policy": "fifo"}``); ``None`` values are ignored so CLI
    flags that were not given do not override anything.
    """
    try:
        return validated_config(path, **overrides)
    except ValidationError as exc:
        raise config_error(exc) from None
    except SettingsError as exc:
        raise environment_error(exc) from None


def validated_config(path: str | Path | None = None, /, **overrides: Any) -> EngineConfig:
    """``load_config`` raising pydantic's ValidationError, which holds every problem at once."""
    data = read_yaml(path) if path is not None else {}
    tree = nest_overrides({k: v for k, v in overrides.items() if v is not None})
    token = _yaml_data.set(data)
    try:
        return EngineConfig(**tree)
    finally:
        _yaml_data.reset(token)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read config file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "the top level must be a mapping of config keys")
    if isinstance(data.get("model"), str) and not Path(data["model"]).is_absolute():
        # a relative model path means "next to the YAML file", not the caller's cwd
        candidate = path.parent / data["model"]
        if candidate.exists():
            data["model"] = str(candidate.resolve())
    return data


def nest_overrides(flat: dict[str, Any]) -> dict[str, Any]:
    """Turn vLLM's flat names (and section dicts, or their JSON text) into the nested tree; a
    section and flat names inside it merge, in either order (``--compilation-config`` beside
    ``--cudagraph-capture-sizes``)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        dotted = VLLM_NAMES.get(key) or SERVER_NAMES.get(key) or key
        if dotted == key and key not in EngineConfig.model_fields:
            raise ConfigError(
                key, f"unknown engine argument; valid: {', '.join(sorted(VLLM_NAMES))}"
            )
        if isinstance(value, str) and dotted in JSON_FIELDS:
            try:
                value = json_object(value)
            except ValueError as exc:
                raise ConfigError(dotted, str(exc)) from None
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return tree


def config_error(exc: ValidationError, section: str = "") -> ConfigError:
    """The first validation problem as a ConfigError with its dotted key path (below ``section``)."""
    first = exc.errors()[0]
    key = ".".join(([section] if section else []) + [str(part) for part in first["loc"]]) or "config"
    extra = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ConfigError(key, f"{error_message(first)}{extra}")


def error_message(error: Any) -> str:
    """A validation error's message, less pydantic's prefix for a validator's ValueError."""
    return error["msg"].removeprefix("Value error, ")


def environment_error(exc: SettingsError) -> ConfigError:
    """A TOKENMILL_* variable pydantic-settings cannot parse (bad JSON), as a ConfigError."""
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    return ConfigError("environment", f"{exc}{cause}")
