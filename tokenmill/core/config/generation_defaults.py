"""A model's sampling defaults (vLLM's ``--generation-config`` and ``--override-generation-config``).

Checkpoints ship the sampling their authors recommend in ``generation_config.json``
(Llama-3-Instruct: temperature 0.6, top_p 0.9). vLLM takes it by default (``auto``): a
request field that is not set takes the model's value, and only then OpenAI's default.
``vllm`` ignores the file (OpenAI's defaults only); a directory reads that directory's
file instead. The override's values win over the file's. Only the fields vLLM takes are
read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (a request's ``max_tokens`` when it sets none); HF's ``do_sample`` is
not (vLLM's rule).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.sampling_params import SamplingParams

#: generation_config.json's name -> SamplingParams' name
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model: Path, generation_config: str, override: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams fields -> the default a request that leaves them unset takes."""
    if generation_config == "vllm":
        found: dict[str, Any] = {}
    else:
        directory = model if generation_config == "auto" else Path(generation_config)
        found = _read(directory / "generation_config.json", required=generation_config != "auto")
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ConfigError("override_generation_config", f"unknown fields {unknown}; known: {sorted(FIELDS)}")
    values = {FIELDS[name]: value for name, value in {**found, **override}.items()
              if name in FIELDS and value is not None}
    if values.get("top_k") == 0:  # HF's "no top-k"
        values["top_k"] = -1
    try:
        SamplingParams(**values)
    except ValueError as exc:
        raise ConfigError("generation_config", f"the model's sampling defaults are invalid: {exc}") from None
    return values


def _read(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError("generation_config", f"{path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("generation_config", f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}
