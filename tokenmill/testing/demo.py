"""The built-in demo model: made deterministically on first use and cached, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.testing.tiny_models import make_tiny_model

DEMO_ARCH = "llama"


def demo_model_dir() -> Path:
    """``$TOKENMILL_CACHE_DIR/demo-llama`` (default ``~/.cache/tokenmill``), created if missing."""
    root = Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")
    path = root / f"demo-{DEMO_ARCH}"
    if not (path / "model.safetensors").is_file():
        partial = path.with_name(path.name + ".partial")
        make_tiny_model(DEMO_ARCH, partial, max_position_embeddings=2048)
        partial.replace(path)
    return path
