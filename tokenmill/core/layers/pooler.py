"""Sentence-embedding pooling as the checkpoint's sentence-transformers config says.

Reads ``modules.json`` (is there a Normalize module?), ``1_Pooling/config.json``
(mean / cls / max tokens) and ``sentence_bert_config.json`` (max_seq_length).
Without them: mean pooling, normalized, which is what most embedding models use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.nn import functional as F

from tokenmill.interfaces.errors import ConfigError


@dataclass(frozen=True)
class Pooler:
    mode: str  # "mean" | "cls" | "max"
    normalize: bool
    max_seq_length: Optional[int] = None

    @classmethod
    def from_model_dir(cls, path: Path) -> "Pooler":
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls("mean", True)
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
        mode = "mean"
        for module in modules:
            if module.get("type", "").endswith("Pooling"):
                pooling = json.loads((path / module["path"] / "config.json").read_text())
                modes = [m for m in ("cls", "mean", "max") if pooling.get(f"pooling_mode_{m}_token" + ("s" if m != "cls" else ""))]
                if len(modes) != 1:
                    raise ConfigError("1_Pooling/config.json", f"exactly one of mean/cls/max pooling is supported, got {modes}")
                mode = modes[0]
        max_len = None
        sbert = path / "sentence_bert_config.json"
        if sbert.is_file():
            max_len = json.loads(sbert.read_text()).get("max_seq_length")
        return cls(mode, normalize, max_len)

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] -> [batch, hidden] float32."""
        hidden = hidden.float()
        mask = attention_mask.unsqueeze(-1).float()
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "max":
            pooled = hidden.masked_fill(mask == 0, float("-inf")).amax(dim=1)
        else:
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled
