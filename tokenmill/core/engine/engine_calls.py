"""Named calls on a served engine between its steps: what the control routes ask of it
(runtime LoRA, the training-loop API, pooling with a generation model).

A route names a call and its arguments rather than handing the engine a function, because
the engine may run in a process of its own (``tokenmill serve --engine-process``): only a
name and plain, msgspec-encodable arguments cross that socket, never code, and the engine
process runs nothing but the calls listed here. With the engine in the server's process
the same functions run on its engine thread (``AsyncLLM.call``). Each returns plain data,
or one tensor (pooling's vectors, from core/engine/pooling.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tokenmill.core.engine import pooling
from tokenmill.interfaces.errors import InvalidRequest


def load_lora_adapter(engine: Any, lora_name: str, lora_path: str) -> dict[str, str]:
    """Load an adapter from ``lora_path`` (the server confined it to an allowed directory);
    the adapters loaded after it. A name already loaded, and any file the loader cannot
    use, is an InvalidRequest that leaves nothing registered."""
    if lora_name in engine.adapters.loaded():
        raise InvalidRequest("lora_name", f"adapter {lora_name!r} is already loaded; unload it first to replace it")
    try:
        engine.adapters.load(lora_name, lora_path)
    except InvalidRequest:
        raise
    except Exception as exc:  # anything else a foreign file makes the loader raise
        raise InvalidRequest("lora_path", f"adapter {lora_name!r} cannot be loaded: {type(exc).__name__}: "
                                          f"{exc}") from None
    return dict(engine.adapters.loaded())


def unload_lora_adapter(engine: Any, lora_name: str) -> dict[str, str]:
    """Unload an adapter no running request uses; the adapters loaded after it."""
    if engine.adapters.in_use(lora_name):
        raise InvalidRequest("lora_name", f"adapter {lora_name!r} is in use by running requests")
    engine.adapters.unload(lora_name)
    return dict(engine.adapters.loaded())


def init_weight_transfer_engine(engine: Any, init_info: dict[str, Any]) -> None:
    engine.control.init_weight_transfer_engine({"init_info": init_info})


def start_weight_update(engine: Any) -> None:
    engine.control.start_weight_update()


def update_weights(engine: Any, update_info: dict[str, Any]) -> None:
    engine.control.update_weights({"update_info": update_info})


def finish_weight_update(engine: Any, weight_version: Optional[str]) -> None:
    engine.control.finish_weight_update(weight_version)


def get_weight_version(engine: Any) -> Optional[str]:
    return engine.control.get_weight_version()


def sleep(engine: Any, level: int) -> None:
    engine.control.sleep(level)


def wake_up(engine: Any, tags: Optional[list[str]]) -> None:
    engine.control.wake_up(tags)


def is_sleeping(engine: Any) -> bool:
    return engine.control.is_sleeping()


def reset_prefix_cache(engine: Any) -> bool:
    return engine.control.reset_prefix_cache()


def collective_rpc(engine: Any, method: str, timeout: Optional[float], args: list[Any],
                   kwargs: dict[str, Any]) -> list[Any]:
    return engine.control.collective_rpc(method, timeout, tuple(args), kwargs)


#: every call an engine runs for the server, by name
CALLS: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in (
    load_lora_adapter, unload_lora_adapter, init_weight_transfer_engine, start_weight_update, update_weights,
    finish_weight_update, get_weight_version, sleep, wake_up, is_sleeping, reset_prefix_cache, collective_rpc,
    pooling.pooled, pooling.class_logits, pooling.scores)}


def run_call(engine: Any, name: str, kwargs: dict[str, Any]) -> Any:
    """The named call on ``engine`` (on the thread that steps it, between two steps)."""
    call = CALLS.get(name)
    if call is None:
        raise InvalidRequest(None, f"the engine has no call named {name!r}")
    return call(engine, **kwargs)
