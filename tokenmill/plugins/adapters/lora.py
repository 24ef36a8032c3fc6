"""LoRA adapters from PEFT directories, many per batch.

Each supported linear layer gets slot-stacked LoRA weights: ``A [slots,
parts * max_rank, in]`` and ``B [slots, out, parts * max_rank]`` (block
diagonal over the parts of a fused layer, such as q/k/v; the scaling
``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, is folded into B at load).
Each step, tokens are grouped by adapter slot and each active adapter adds
``(x @ A^T) @ B^T`` to its own tokens with two matmuls: a loop over the
(at most ``max_loras``) adapters in the batch, never over requests.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from tokenmill.core.layers.linear import Linear
from tokenmill.core.model_loader.weights import name_list
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.hookspecs import hookimpl


class _StepGroups:
    """This step's adapter layout, shared by every LoRA layer: (slot, token indices)
    pairs for the CPU path, and each token's slot (-1 = none) for the GPU kernel."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.token_slots = torch.empty(0, dtype=torch.int32)
        self._on_device: Optional[torch.Tensor] = None

    def set(self, groups: list[tuple[int, torch.Tensor]], token_slots: torch.Tensor) -> None:
        self.groups, self.token_slots, self._on_device = groups, token_slots, None

    def token_slots_on(self, device: torch.device) -> torch.Tensor:
        """The token slots on ``device``: copied once a step, without waiting for the device (a
        blocking copy in every LoRA layer would wait for all the kernels queued before it)."""
        if self._on_device is None or self._on_device.device != device:
            self._on_device = self.token_slots.to(device, non_blocking=True)
        return self._on_device


class LoRALayer:
    def __init__(self, linear: Linear, slots: int, max_rank: int, step: _StepGroups) -> None:
        self.sizes = linear.output_sizes
        #: the base layer's tensor-parallel slice: adapters are cut to match it
        self.shard = linear.shard
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.max_rank = max_rank
        dtype = linear.dtype
        parts = len(self.sizes)
        # beside the base layer's weights (on the GPU, where the Triton kernel reads them; a
        # CPU layer may hold only its packed copy, a buffer)
        device = next(itertools.chain(linear.parameters(), linear.buffers())).device
        self.A = torch.zeros(slots, parts * max_rank, linear.input_size, dtype=dtype, device=device)
        self.B = torch.zeros(slots, sum(self.sizes), parts * max_rank, dtype=dtype, device=device)
        self.step = step

    def mismatch(self, part: int, a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
        """Why ``a``/``b`` cannot be part ``part`` of this layer (None when they fit): checked
        at load, since an adapter for another base model would otherwise fail mid-step."""
        if a.dim() != 2 or b.dim() != 2:
            return f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not matrices"
        rank = a.shape[0]
        want_a, want_b = (rank, self.A.shape[2]), (self.sizes[part], rank)
        if rank > self.max_rank or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            return (f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, where the layer takes "
                    f"{want_a} and {want_b} (rank at most {self.max_rank})")
        return None

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        """Put an adapter's parts in ``slot``. The slot is laid out in ``host_buffer``'s memory
        and crosses in two copies; on a GPU from pinned memory without a wait (a blocking copy per part and
        layer would wait, each, for every kernel queued: the forward pass in flight). The
        device runs the copies in queue order, after the steps that still read the slot's
        previous adapter."""
        a_host = host_buffer(self.A.shape[1:], self.A.dtype)
        b_host = host_buffer(self.B.shape[1:], self.B.dtype)
        for part, (a, b) in weights.items():
            rows = slice(part * self.max_rank, part * self.max_rank + a.shape[0])
            a_host[rows] = a
            b_host[self.offsets[part]:self.offsets[part] + self.sizes[part], rows] = b
        # the pinned buffers may be dropped at once: torch's host allocator reuses them only
        # after the copies that read them ran
        self.A[slot].copy_(a_host, non_blocking=True)
        self.B[slot].copy_(b_host, non_blocking=True)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if not self.step.groups:
            return
        if x.device.type == "cuda":  # one gather kernel over the mixed batch
            from tokenmill.plugins.adapters.triton_lora import lora_delta

            lora_delta(x, self.A, self.B, self.step.token_slots_on(x.device), y)
            return
        for slot, tokens in self.step.groups:
            xs = x.index_select(0, tokens)
            y.index_add_(0, tokens, (xs @ self.A[slot].T.to(xs.dtype)) @ self.B[slot].T.to(xs.dtype))


class LoRAAdapters:
    """The ``lora`` adapter type."""

    name = "lora"

    def __init__(self, config: Any) -> None:
        self.max_active = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_loaded = config.max_cpu_loras or config.max_loras
        self._step = _StepGroups()
        self._layers: dict[str, tuple[LoRALayer, int]] = {}  # checkpoint module name -> (layer, part)
        self._all_layers: list[LoRALayer] = []
        self._elsewhere: tuple[str, ...] = ()
        self._loaded: OrderedDict[str, tuple[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, LRU order
        #: set by the engine: whether a live request uses an adapter (those are never evicted)
        self.in_use: Callable[[str], bool] = lambda name: False
        #: set by the engine: the platform's staging memory (pinned on a GPU)
        self.host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor] = \
            lambda shape, dtype: torch.zeros(tuple(shape), dtype=dtype)

    def attach(self, model: nn.Module) -> None:
        stacked = getattr(model, "stacked_params", ())
        #: checkpoint names this rank's model does not hold (other pipeline stages' layers)
        self._elsewhere = tuple(getattr(model, "other_stages", lambda: [])())
        for prefix, module in model.named_modules():
            if not isinstance(module, Linear) or prefix.endswith("lm_head"):
                continue
            head, _, leaf = prefix.rpartition(".")
            parts = sorted((index, part) for fused, part, index in stacked if fused == leaf) or [(0, leaf)]
            layer = LoRALayer(module, self.max_active, self.max_rank, self._step)
            module.output_delta = layer
            self._all_layers.append(layer)
            for index, part in parts:
                self._layers[f"{head}.{part}"] = (layer, index)

    def loaded(self) -> dict[str, str]:
        return {name: path for name, (path, _) in self._loaded.items()}

    def load(self, name: str, path: str) -> None:
        directory = Path(path)
        config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise InvalidRequest("lora_path", f"{path} is not a PEFT adapter directory "
                                              "(adapter_config.json + adapter_model.safetensors)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest("lora_path", f"adapter {name!r}: adapter_config.json cannot be read: {exc}") from None
        if not isinstance(config, dict) or not _positive_int(config.get("r")) \
                or not isinstance(config.get("lora_alpha", 1), (int, float)):
            raise InvalidRequest("lora_path", f"adapter {name!r}: adapter_config.json needs an integer r >= 1 "
                                              "and a numeric lora_alpha")
        problems = []
        if config.get("peft_type", "LORA") != "LORA":
            problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
        if config.get("use_dora"):
            problems.append("use_dora (DoRA)")
        if config.get("modules_to_save"):
            problems.append(f"modules_to_save {config['modules_to_save']}")
        if config.get("bias", "none") != "none":
            problems.append(f"bias={config['bias']!r}")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            problems.append("rank_pattern/alpha_pattern")
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        if rank > self.max_rank:
            problems.append(f"r={rank} exceeds max_lora_rank={self.max_rank}")
        try:
            tensors = load_file(weights_file)
        except (SafetensorError, OSError) as exc:  # truncated, a corrupt header, unreadable
            raise InvalidRequest("lora_path", f"adapter {name!r}: adapter_model.safetensors cannot be read: "
                                              f"{exc}") from None
        if any("lora_embedding" in key for key in tensors):
            problems.append("embedding LoRA")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        paired = {key.replace(".lora_A.", ".lora_B.") for key in tensors if ".lora_A." in key}
        stray = sorted(key for key in tensors if ".lora_A." not in key and key not in paired
                       and "lora_embedding" not in key)
        if stray:
            problems.append(f"tensors that are no lora_A/lora_B pair: {name_list(stray)}")
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if module not in self._layers and any(f in f"{module}." for f in self._elsewhere):
                continue  # another pipeline stage holds this layer, and loads this part
            if module not in self._layers:
                problems.append(f"target module {module} (not a supported linear layer)")
                continue
            if b is None:
                problems.append(f"{module} has lora_A but no lora_B")
                continue
            layer, part = self._layers[module]
            if layer.shard is not None:
                a, b = layer.shard.lora(part, a, b)
            mismatch = layer.mismatch(part, a, b)
            if mismatch is not None:
                problems.append(f"{module}: {mismatch}")
                continue
            weights[module] = (a.float(), b.float() * scaling)
        if problems:
            raise InvalidRequest("lora_path", f"adapter {name!r} cannot be loaded: " + "; ".join(problems))
        if name in self._loaded and self._loaded[name][0] != str(path):
            raise InvalidRequest("lora_name", f"adapter {name!r} is already loaded from another path; unload it first")
        self._loaded[name] = (str(path), weights)
        self._loaded.move_to_end(name)
        self._slots.pop(name, None)  # reloaded weights go to a slot afresh
        # LRU beyond max_cpu_loras, never evicting an adapter a live request uses
        # (so the cache may exceed the limit while that many adapters are in flight)
        for evictable in [n for n in self._loaded if n != name and not self.in_use(n)]:
            if len(self._loaded) <= self.max_loaded:
                break
            del self._loaded[evictable]
            self._slots.pop(evictable, None)

    def unload(self, name: str) -> None:
        if name not in self._loaded:
            raise InvalidRequest("lora_name", f"adapter {name!r} is not loaded")
        del self._loaded[name]
        self._slots.pop(name, None)

    def prepare_step(self, adapters: Sequence[Optional[str]], query_lens: Sequence[int]) -> None:
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)
        tokens: dict[str, list[int]] = {}
        for i, name in enumerate(adapters):
            if name is not None:
                tokens.setdefault(name, []).extend(range(starts[i], starts[i + 1]))
        if len(tokens) > self.max_active:
            raise RuntimeError(f"{len(tokens)} adapters in one step, max_loras={self.max_active}")
        groups = [(self._slot_for(name), torch.tensor(idx)) for name, idx in tokens.items()]
        slots = torch.full((starts[-1],), -1, dtype=torch.int32)
        for slot, idx in groups:
            slots[idx] = slot
        self._step.set(groups, slots)

    def _slot_for(self, name: str) -> int:
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        if name not in self._loaded:
            raise RuntimeError(f"adapter {name!r} was unloaded while a request still used it")
        used = set(self._slots.values())
        free = [s for s in range(self.max_active) if s not in used]
        if free:
            slot = free[0]
        else:  # reuse the least recently used adapter's slot (not in this step, by max_loras)
            _, slot = self._slots.popitem(last=False)
        parts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in self._loaded[name][1].items():
            layer, part = self._layers[module]
            parts.setdefault(id(layer), {})[part] = weights
        for layer in self._all_layers:
            layer.set_slot(slot, parts.get(id(layer), {}), self.host_buffer)
        self._slots[name] = slot
        return slot


@hookimpl
def register_adapter_types(register):
    register("lora", LoRAAdapters)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
