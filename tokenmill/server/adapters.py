"""Runtime LoRA management: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless ``adapters.allow_runtime_lora_updating`` is set. A path must resolve
(following symlinks and ``..``) to a place inside one of
``adapters.allowed_lora_dirs``; anything else is refused before a file is read.
Loads and unloads are engine calls (``engine_calls``), run between steps, so running
requests are not disturbed. A name that is a served model's or an already loaded adapter's is refused (replacing one is
an unload, then a load), and every failure to read or apply an adapter is a 400 that leaves
nothing registered.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import LoadAdapterRequest, UnloadAdapterRequest
from tokenmill.server.responses import AdapterResponse


def confine(path: str, allowed_dirs: list[str]) -> Path:
    """The real path of ``path`` if it lies inside an allowed directory; else a 400."""
    if not allowed_dirs:
        raise APIError(400, "no allowed_lora_dirs are configured: runtime loads are refused", "lora_path")
    roots = [Path(d).resolve() for d in allowed_dirs]
    candidates = [Path(path)] if Path(path).is_absolute() else [root / path for root in roots]
    for candidate in candidates:
        try:
            resolved = candidate.resolve()  # follows symlinks and '..'
            inside = any(resolved.is_relative_to(root) for root in roots)
            if inside and not resolved.is_dir():
                raise APIError(400, f"adapter directory {path!r} does not exist", "lora_path")
        except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a symlink loop
            raise APIError(400, f"adapter path {path[:64]!r} cannot be used: {exc.__class__.__name__}",
                           "lora_path") from None
        if inside:
            return resolved
    raise APIError(400, f"adapter path {path!r} is outside the allowed directories", "lora_path")


def add_adapter_routes(app: FastAPI, llm: AsyncLLM, allowed_dirs: list[str], served_names: list[str]) -> None:
    @app.post("/v1/load_lora_adapter", response_model=AdapterResponse)
    async def load_adapter(body: LoadAdapterRequest):
        """vLLM: load a LoRA adapter from inside allowed_lora_dirs; clients then name it in `model`."""
        if body.lora_name in served_names:
            raise APIError(400, f"{body.lora_name!r} is a served model's name; an adapter needs its own",
                           "lora_name")
        path = confine(body.lora_path, allowed_dirs)
        await llm.call("load_lora_adapter", lora_name=body.lora_name, lora_path=str(path))
        return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/v1/unload_lora_adapter", response_model=AdapterResponse)
    async def unload_adapter(body: UnloadAdapterRequest):
        """vLLM: unload an adapter no running request uses."""
        await llm.call("unload_lora_adapter", lora_name=body.lora_name)
        return {"status": "ok", "lora_name": body.lora_name}
