"""pluggy hook specifications: the only way the core learns about plugins.

Registration hooks receive a ``register(name, factory)`` callback and return
nothing, so one plugin can register many components while the host owns
duplicate detection, provenance and lazy imports. ``factory`` is either a
callable or a lazy ``"package.module:attr"`` string that is imported only when
a config selects it, so listing plugins never imports heavy code (Triton, CUDA).

Hooks are called once, when an engine is built, in the process that builds it;
never per step. Implementations must not give their arguments defaults
(pluggy does not pass them). Specs only ever gain arguments; ``HOOKSPEC_VERSION``
is bumped when they do, so a plugin can check what its host supports.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import pluggy

PROJECT_NAME = "tokenmill"
HOOKSPEC_VERSION = 8  # 2: register_platforms; 3: register_logits_processors; 4: structured outputs, tool parsers;
#                      5: register_executors; 6: register_speculative_proposers; 7: register_reasoning_parsers;
#                      8: register_worker_extensions, register_weight_transfer_backends
ENTRY_POINT_GROUP = "tokenmill.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The callback passed to registration hooks."""

    def __call__(self, name: str, factory: Callable[..., Any] | str) -> None: ...


@hookspec
def register_scheduling_policies(register: Register) -> None:
    """Register SchedulingPolicy factories: ``factory(config) -> SchedulingPolicy``.

    ``config`` is the engine's ``SchedulerConfig``; names are what
    ``scheduler.policy`` / ``--scheduling-policy`` select (``"fifo"``, ...).
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register AttentionBackend factories: ``factory() -> AttentionBackend``.

    Names are what ``attention.backend`` / ``--attention-backend`` select.
    """


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register QuantizationMethod factories: ``factory(quant_config, options) -> QuantizationMethod``.

    Names match a checkpoint's ``quantization_config.quant_method``;
    ``quant_config`` is that dict (empty for online quantization) and
    ``options`` the engine's ``QuantizationConfig`` section.
    """


@hookspec
def register_model_architectures(register: Register) -> None:
    """Register model classes by Hugging Face ``architectures`` name.

    ``factory`` is the class itself (or a lazy string to it); it is constructed
    as ``cls(model_config, build)``, see ``tokenmill.interfaces.models``.
    """


@hookspec
def register_platforms(register: Register) -> None:
    """Register Platform classes (``tokenmill.interfaces.platform``) by name.

    ``factory`` is the class (or a lazy string to it): its ``detect()`` is
    called on the class, and the selected one is constructed as ``cls(config, options)``
    with the EngineConfig and its ``platform.<name>`` section validated by its
    ``options_model``. Names are what ``platform.name`` / ``--device`` select.
    """


@hookspec
def register_adapter_types(register: Register) -> None:
    """Register AdapterType factories by adapter kind (``"lora"``)."""


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register LogitsProcessor classes (``tokenmill.interfaces.logits_processor``) by name.

    Registering makes a processor selectable; an engine uses it only when its
    ``logits_processors`` list names it. It is constructed as ``cls(context)``.
    """


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register StructuredOutputBackend classes (``tokenmill.interfaces.structured_output``) by
    name; ``structured_outputs: {backend: name}`` selects one. Built as ``cls(context)``."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register ToolParser classes (``tokenmill.interfaces.tool_parser``) by name;
    ``--tool-call-parser name`` selects one for ``tool_choice: "auto"``. Built as ``cls(tokenizer)``."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register ReasoningParser classes (``tokenmill.interfaces.reasoning_parser``) by name;
    ``--reasoning-parser name`` selects one. Built as ``cls(tokenizer)``."""


@hookspec
def register_executors(register: Register) -> None:
    """Register Executor classes (``tokenmill.interfaces.executor``) by name;
    ``distributed_executor_backend: name`` selects one. Built as ``cls(options)``. Every rank
    of a multi-process model builds its own plugin manager from entry points, so a plugin
    that a rank needs must be installed as a package, not registered in one process."""


@hookspec
def register_speculative_proposers(register: Register) -> None:
    """Register SpeculativeProposer classes (``tokenmill.interfaces.speculative``) by name;
    ``speculative: {method: name}`` (vLLM's ``speculative_config``) selects one. Built as
    ``cls(context)``."""


@hookspec
def register_worker_extensions(register: Register) -> None:
    """Register WorkerExtension classes (``tokenmill.interfaces.worker_extension``) by name:
    their public methods are what ``collective_rpc`` calls on every rank. Built once per rank
    as ``cls(context)``; install the plugin as a package, as every rank needs it."""


@hookspec
def register_weight_transfer_backends(register: Register) -> None:
    """Register WeightTransferBackend classes (``tokenmill.interfaces.weight_transfer``) by
    name; ``weight_transfer_config: {backend: name}`` selects one. Built on every rank as
    ``cls(context)``."""


@hookspec(firstresult=True)
def select_attention_backend(device: str, model_config: Any) -> str | None:
    """Return the attention backend name that ``attention.backend: auto`` means.

    The first non-None answer wins; the built-in default runs ``trylast``.
    """


@hookspec
def engine_started(engine: Any) -> None:
    """Observe an engine that has finished building (logging, metrics plugins)."""


@hookspec
def request_finished(output: Any, metrics: Any) -> None:
    """Observe a finished request: its final RequestOutput and its RequestMetrics."""


@hookspec
def extend_server(app: Any) -> None:
    """Add routes or middleware to the server's FastAPI app."""
