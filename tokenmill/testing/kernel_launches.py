"""Triton kernel launches seen from outside the kernel, for the CPU stand-ins of GPU behaviour.

In Triton's interpreter (``TRITON_INTERPRET=1``) every launch, ``kernel[grid](*args)``, goes
through ``InterpretedFunction.run``. ``intercept_launches(hook)`` routes each launch through
``hook(kernel, grid, args, kwargs, launch)`` while it is active; ``launch(args, kwargs)`` runs
the next hook or the interpreter. Hooks nest, innermost first, so the device stand-in
(``fake_cuda``: device tensors in, host tensors refused) and the graph recorder
(``device_graphs``: the launch recorded for replay) compose. ``in_launch()`` tells code
that watches torch operations that the interpreter's own host copies are running.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

#: launches the next hook (or the interpreter) with these arguments
Launch = Callable[[tuple, dict], Any]
#: ``hook(kernel, grid, args, kwargs, launch)``
Hook = Callable[[Any, Any, tuple, dict, Launch], Any]

_hooks: list[Hook] = []
_state = threading.local()
_original_run: Any = None


def in_launch() -> bool:
    """True while a kernel runs in the interpreter (its argument copies are not the program's)."""
    return getattr(_state, "depth", 0) > 0


def launch(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
    """Launch ``kernel`` over ``grid`` through the active hooks, as ``kernel[grid](*args, **kwargs)`` does."""
    return kernel.run(*args, grid=grid, warmup=False, **kwargs)


def _run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    if warmup:
        return _original_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    def call(level: int, args: tuple, kwargs: dict) -> Any:
        if level < 0:
            _state.depth = getattr(_state, "depth", 0) + 1
            try:
                return _original_run(kernel, *args, grid=grid, warmup=False, **kwargs)
            finally:
                _state.depth -= 1
        return _hooks[level](kernel, grid, args, kwargs, lambda a, k: call(level - 1, a, k))

    return call(len(_hooks) - 1, args, kwargs)


@contextmanager
def intercept_launches(hook: Hook) -> Iterator[None]:
    """Route every interpreted Triton launch through ``hook`` inside the block."""
    global _original_run
    from triton.runtime.interpreter import InterpretedFunction

    if not _hooks:
        _original_run = InterpretedFunction.run
        InterpretedFunction.run = _run
    _hooks.append(hook)
    try:
        yield
    finally:
        _hooks.remove(hook)
        if not _hooks:
            InterpretedFunction.run = _original_run
