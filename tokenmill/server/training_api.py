"""The training-loop endpoints, with vLLM 0.32's names: pause and resume generation, the
weight-transfer cycle, sleep and wake, the prefix cache, worker RPCs.

Off unless ``--enable-training-endpoints`` (vLLM gates its dev ones behind its dev mode):
they change what every client is served. Like every route beyond the probes they need the
API key. Each is a named engine call (``engine_calls``), run between steps where the engine
steps: its thread, or its own process with ``--engine-process``. A weight update from a
trainer process (``gloo``/``nccl``) holds the engine while the tensors arrive, which is why
a trainer pauses generation around it. The in_process backend needs tensors in the server's
memory, so over HTTP an update names a torch.distributed backend's tensors.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.core.engine.rollout import EngineAsleep
from tokenmill.interfaces.errors import RankCallFailed
from tokenmill.server.errors import APIError


class InitWeightTransferBody(BaseModel):
    init_info: dict[str, Any] = Field(default_factory=dict, description="The backend's init info (vLLM's).")


class UpdateWeightsBody(BaseModel):
    update_info: dict[str, Any] = Field(description="names, dtype_names and shapes of the tensors the trainer "
                                                    "broadcasts, in its order.")


class FinishWeightUpdateBody(BaseModel):
    weight_version: Optional[str] = Field(None, max_length=256, description="What get_weight_version reports.")


class CollectiveRpcBody(BaseModel):
    method: str = Field(max_length=256, description="A worker extension's method ('name' or 'extension.name').")
    timeout: Optional[float] = Field(None, gt=0)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class Done(BaseModel):
    status: Literal["ok"] = "ok"


class PausedState(BaseModel):
    is_paused: bool


class SleepingState(BaseModel):
    is_sleeping: bool


class WeightInfo(BaseModel):
    weight_version: Optional[str] = Field(description="What the last finish_weight_update set (null: none).")


class WorldSize(BaseModel):
    world_size: int


class PrefixCacheReset(BaseModel):
    reset: bool = Field(description="false while requests hold blocks: nothing was forgotten.")


class RpcResults(BaseModel):
    results: list[Any] = Field(description="Each rank's result, in rank order.")


def add_training_routes(app: FastAPI, llm: AsyncLLM) -> None:
    async def on_engine(name: str, **kwargs: Any) -> Any:
        try:
            return await llm.call(name, **kwargs)
        except TimeoutError as exc:  # a rank did not answer: the engine stops
            raise APIError(504, str(exc)) from None
        except EngineAsleep:
            raise
        except (ValueError, RuntimeError, TypeError, RankCallFailed) as exc:  # the call's refusal, or a rank's
            raise APIError(400, str(exc)) from None

    @app.post("/pause", response_model=Done)
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True):
        """vLLM: stop generating; requests that arrive wait until /resume."""
        await llm.pause_generation(mode, clear_cache)
        return Done()

    @app.post("/resume", response_model=Done)
    async def resume():
        await llm.resume_generation()
        return Done()

    @app.get("/is_paused", response_model=PausedState)
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": llm.is_paused()}

    @app.post("/init_weight_transfer_engine", response_model=Done)
    async def init_weight_transfer_engine(body: InitWeightTransferBody):
        await on_engine("init_weight_transfer_engine", init_info=body.init_info)
        return Done()

    @app.post("/start_weight_update", response_model=Done)
    async def start_weight_update():
        await on_engine("start_weight_update")
        return Done()

    @app.post("/update_weights", response_model=Done)
    async def update_weights(body: UpdateWeightsBody):
        if "weights" in body.update_info:
            raise APIError(400, "tensors cannot come over HTTP: use a torch.distributed backend (gloo, nccl), "
                                "whose trainer broadcasts what update_info names", "update_info")
        await on_engine("update_weights", update_info=body.update_info)
        return Done()

    @app.post("/finish_weight_update", response_model=Done)
    async def finish_weight_update(body: FinishWeightUpdateBody):
        await on_engine("finish_weight_update", weight_version=body.weight_version)
        return Done()

    @app.get("/weight_info", response_model=WeightInfo)
    async def weight_info() -> dict[str, Optional[str]]:
        return {"weight_version": await on_engine("get_weight_version")}

    @app.get("/get_world_size", response_model=WorldSize)
    async def get_world_size() -> dict[str, int]:
        return {"world_size": llm.engine.config.parallel.world_size}

    @app.post("/sleep", response_model=Done)
    async def sleep(level: int = Query(1, ge=1, le=2)):
        """vLLM (dev): free the KV cache (1) and the weights (2); requests get 503 until /wake_up."""
        await on_engine("sleep", level=level)
        return Done()

    @app.post("/wake_up", response_model=Done)
    async def wake_up(tags: Optional[list[Literal["weights", "kv_cache"]]] = Query(None)):
        await on_engine("wake_up", tags=tags)
        return Done()

    @app.get("/is_sleeping", response_model=SleepingState)
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await on_engine("is_sleeping")}

    @app.post("/reset_prefix_cache", response_model=PrefixCacheReset)
    async def reset_prefix_cache() -> dict[str, bool]:
        """vLLM (dev): forget the prefix cache; false while requests hold blocks."""
        return {"reset": await on_engine("reset_prefix_cache")}

    @app.post("/collective_rpc", response_model=RpcResults)
    async def collective_rpc(body: CollectiveRpcBody) -> dict[str, list[Any]]:
        """vLLM (dev): a worker extension's method on every rank; the results in rank order."""
        results = await on_engine("collective_rpc", method=body.method, timeout=body.timeout, args=body.args,
                                  kwargs=body.kwargs)
        return {"results": results}
