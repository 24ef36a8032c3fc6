"""Tiny random LoRA adapters in PEFT's on-disk format, and merging them by hand.

``make_lora_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors``
exactly as PEFT saves them; ``merge_lora`` writes the base model with
``W + scaling * B @ A`` folded in (PEFT's ``merge_and_unload``), the reference
an adapter-serving engine must match.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file


def make_lora_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int, targets: Sequence[str],
                      alpha: Optional[float] = None, use_rslora: bool = False, seed: int = 0) -> Path:
    """Random A and B (both non-zero, so the adapter changes outputs) for ``targets``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = load_file(Path(model_dir) / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_features, in_features = weight.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
        "target_modules": list(targets), "use_rslora": use_rslora, "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False, "modules_to_save": None,
    }, indent=2))
    return out


def merge_lora(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base model with the adapter folded into its weights."""
    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = load_file(Path(model_dir) / "model.safetensors")
    adapter = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    for key, a in adapter.items():
        if ".lora_A." in key:
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            name = f"{module}.weight"
            weights[name] = (weights[name].float() + scaling * (b.float() @ a.float())).to(weights[name].dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
