"""What the installed plugins registered: one registry per kind of component, filled by
calling every registration hook once per plugin."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.core.plugin_host.registry import Registry


@dataclass(frozen=True)
class Components:
    """Everything the installed plugins registered, by kind."""

    scheduling_policies: Registry
    attention_backends: Registry
    quantization_methods: Registry
    model_architectures: Registry
    adapter_types: Registry
    platforms: Registry
    logits_processors: Registry
    structured_output_backends: Registry
    tool_parsers: Registry
    reasoning_parsers: Registry
    executors: Registry
    speculative_proposers: Registry
    worker_extensions: Registry
    weight_transfer_backends: Registry

    def by_kind(self) -> dict[str, Registry]:
        return {
            "platforms": self.platforms,
            "scheduling_policies": self.scheduling_policies,
            "attention_backends": self.attention_backends,
            "quantization_methods": self.quantization_methods,
            "model_architectures": self.model_architectures,
            "adapter_types": self.adapter_types,
            "logits_processors": self.logits_processors,
            "structured_output_backends": self.structured_output_backends,
            "tool_parsers": self.tool_parsers,
            "reasoning_parsers": self.reasoning_parsers,
            "executors": self.executors,
            "speculative_proposers": self.speculative_proposers,
            "worker_extensions": self.worker_extensions,
            "weight_transfer_backends": self.weight_transfer_backends,
        }

    def fingerprint(self) -> dict[str, list[str]]:
        """Every registration as "name=module:qualname", by kind: what another process that
        built its plugin manager from the same entry points must have registered too."""
        return {kind: [f"{entry.name}={entry.target}" for entry in registry.entries()]
                for kind, registry in self.by_kind().items()}


_REGISTRATION_HOOKS = {
    "scheduling_policies": ("register_scheduling_policies", "scheduling policy"),
    "attention_backends": ("register_attention_backends", "attention backend"),
    "quantization_methods": ("register_quantization_methods", "quantization method"),
    "model_architectures": ("register_model_architectures", "model architecture"),
    "adapter_types": ("register_adapter_types", "adapter type"),
    "platforms": ("register_platforms", "platform"),
    "logits_processors": ("register_logits_processors", "logits processor"),
    "structured_output_backends": ("register_structured_output_backends", "structured output backend"),
    "tool_parsers": ("register_tool_parsers", "tool parser"),
    "reasoning_parsers": ("register_reasoning_parsers", "reasoning parser"),
    "executors": ("register_executors", "executor"),
    "speculative_proposers": ("register_speculative_proposers", "speculative proposer"),
    "worker_extensions": ("register_worker_extensions", "worker extension"),
    "weight_transfer_backends": ("register_weight_transfer_backends", "weight transfer backend"),
}


def collect_components(pm: PluginManager) -> Components:
    """Call every registration hook once per plugin, recording which plugin registered what.

    Each plugin's implementation is called on its own (through
    ``subset_hook_caller``, so pluggy's tracing still sees it) to attribute names
    to plugins for duplicate errors and ``tokenmill plugins``.
    """
    registries = {}
    plugins = pm.get_plugins()
    for field, (hook_name, kind) in _REGISTRATION_HOOKS.items():
        registry: Registry = Registry(kind)
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            others = [p for p in plugins if p is not impl.plugin]
            caller = pm.subset_hook_caller(hook_name, remove_plugins=others)

            def register(name, factory, _plugin=impl.plugin_name, _registry=registry):
                _registry.register(name, factory, plugin=_plugin)

            caller(register=register)
        registries[field] = registry
    return Components(**registries)
