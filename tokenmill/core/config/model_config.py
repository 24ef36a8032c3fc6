"""A model directory's config.json, normalised across transformers 4 and 5 spellings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog
import torch

from tokenmill.core.config.generation_defaults import sampling_defaults
from tokenmill.interfaces.errors import ConfigError

log = structlog.get_logger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint before building it."""

    path: Path
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    #: SamplingParams fields -> the model's default for requests that leave them unset
    #: (generation_defaults: vLLM's --generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_heads)

    @property
    def sliding_window(self) -> Optional[int]:
        return self.hf_config.get("sliding_window")

    @property
    def quantization_config(self) -> Optional[dict[str, Any]]:
        return self.hf_config.get("quantization_config")


def normalize_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers-4 spellings -> transformers-5 ones (``rope_parameters``, ``dtype``)."""
    cfg = dict(raw)
    # GPT-2 style names
    for gpt2_name, name in (("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
                            ("n_head", "num_attention_heads"), ("n_positions", "max_position_embeddings")):
        if gpt2_name in cfg:
            cfg.setdefault(name, cfg[gpt2_name])
    if "rope_parameters" not in cfg or cfg["rope_parameters"] is None:
        rope = dict(cfg.get("rope_scaling") or {})
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
        if rope.get("rope_type") == "su":  # Phi-3's original name for longrope
            rope["rope_type"] = "longrope"
        if "original_max_position_embeddings" in cfg:
            rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in cfg:
            rope.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
        cfg["rope_parameters"] = rope
    if cfg.get("dtype") is None and cfg.get("torch_dtype") is not None:
        cfg["dtype"] = cfg["torch_dtype"]
    cfg.pop("rope_scaling", None)
    cfg.pop("torch_dtype", None)
    return cfg


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides``' keys: an object over an object merges, key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


#: model types whose activations pass float16's range (vLLM's list): never float16
FLOAT16_UNSTABLE = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})


def load_model_config(
    path: str | Path, dtype: str = "auto", max_model_len: Optional[int] = None,
    resolve_dtype: Optional[Callable[[torch.dtype], torch.dtype]] = None,
    generation_config: str = "auto", override_generation_config: Optional[dict[str, Any]] = None,
    hf_overrides: Optional[dict[str, Any]] = None,
) -> ModelConfig:
    """``resolve_dtype`` is the platform's say on what ``dtype: auto`` computes a checkpoint's
    stored dtype in (Platform.resolve_dtype); without one, the stored dtype itself."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("model", f"{path} is not a model directory (no config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("model", f"{config_file} is not valid JSON: {exc}") from None
    if hf_overrides:
        raw = merged(raw, hf_overrides)
        log.info("config.json overridden", model=str(path), hf_overrides=hf_overrides)
    hf = normalize_hf_config(raw)
    legacy_quant = path / "quantize_config.json"  # AutoGPTQ's separate file
    if not hf.get("quantization_config") and legacy_quant.is_file():
        hf["quantization_config"] = {"quant_method": "gptq", **json.loads(legacy_quant.read_text())}
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ConfigError("model", f"{config_file} names no 'architectures'")

    model_type = str(hf.get("model_type") or "")
    if dtype == "auto":
        torch_dtype = _DTYPES.get(str(hf.get("dtype") or "float32").removeprefix("torch."))
        if torch_dtype is None:
            raise ConfigError("dtype", f"checkpoint dtype {hf.get('dtype')!r} is not supported")
        resolve = resolve_dtype or (lambda stored: stored)
        resolved = resolve(torch_dtype)
        if resolved == torch.float16 and model_type in FLOAT16_UNSTABLE:  # the platform's bf16, else fp32
            resolved = resolve(torch.bfloat16)
            resolved = torch.float32 if resolved == torch.float16 else resolved
        if resolved != torch_dtype:
            log.info("dtype auto: the platform computes this checkpoint in another dtype", model=str(path),
                     stored=str(torch_dtype).removeprefix("torch."), compute=str(resolved).removeprefix("torch."))
        torch_dtype = resolved
    else:
        torch_dtype = _DTYPES[dtype]
    if torch_dtype == torch.float16 and model_type in FLOAT16_UNSTABLE:
        raise ConfigError("dtype", f"{model_type} models do not run in float16: their activations pass its range "
                                   "(numerical instability, as vLLM refuses it too); use bfloat16 or float32")

    derived = int(hf.get("max_position_embeddings") or 2048)
    if max_model_len is not None and max_model_len > derived:
        raise ConfigError(
            "max_model_len",
            f"{max_model_len} exceeds the model's max_position_embeddings ({derived})",
        )
    return ModelConfig(
        path=path,
        hf_config=hf,
        architecture=architectures[0],
        dtype=torch_dtype,
        max_model_len=max_model_len or derived,
        eos_token_ids=_eos_token_ids(path, hf),
        sampling_defaults=sampling_defaults(path, generation_config, override_generation_config or {}),
    )


def _eos_token_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (Llama-3 lists several)."""
    ids: list[int] = []
    sources = [hf]
    generation = path / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)
