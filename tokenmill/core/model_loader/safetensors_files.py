"""Checkpoint tensors from safetensors files, single or sharded. Never unpickles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tokenmill.interfaces.errors import ConfigError


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError("model", f"shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise ConfigError(
            "model",
            f"no model.safetensors or model.safetensors.index.json in {path} (pickled .bin "
            "checkpoints are never loaded, for safety: convert them to safetensors)",
        )
    return [single]


def iterate_weights(path: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, shard by shard."""
    files = safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def checkpoint_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each checkpoint tensor's (shape, dtype name), read from the files' headers only."""
    shapes = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shapes[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return shapes
