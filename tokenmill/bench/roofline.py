"""The roofline bound of an offline workload on this machine, printed beside measured throughput.

A figure such as "485 output tok/s" says little without what the hardware allows. The bound
here is what the workload would take if every step ran at this machine's limits, measured in
the same process at the benchmark's thread count (not read off a data sheet):

- memory bandwidth: a streaming read of a buffer far larger than the last-level cache;
- compute peak: a large square GEMM in the compute dtype, the faster of torch's (oneDNN's best
  kernel for this CPU: AMX tiles where the CPU has them, AVX512-BF16 or FMA otherwise; cuBLAS
  on a GPU) and the engine's own linear layer as its platform prepares it (on AVX2-only CPUs
  the cpu platform's packed-panel GEMM outruns oneDNN's, so torch's alone is no bound there).

Each prompt is prefilled once (compute-bound: 2 FLOPs per weight per token, plus causal
attention); then every request decodes together, one step per output token, each step
taking the longer of reading the weights once plus every request's KV cache at the memory
bandwidth, and its FLOPs at the compute peak. That is the most a batch-as-wide-as-the-
workload engine could do: no scheduler, sampling or framework time, every byte read once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.core.config.model_config import load_model_config
from tokenmill.core.layers.linear import Linear
from tokenmill.interfaces.platform import Platform


@dataclass(frozen=True)
class Machine:
    bandwidth: float  #: bytes/s, streaming read
    peak_flops: float  #: FLOP/s, square GEMM in the compute dtype


@dataclass(frozen=True)
class Workload:
    weight_bytes: float  #: read once per step: every matrix but the embedding table
    flops_per_token: float  #: 2 x the parameters a token multiplies (the output projection included)
    head_flops_per_token: float  #: the output projection's share: a prompt computes it for its last token only
    kv_bytes_per_token: float  #: a token's keys and values, all layers
    attention_flops_per_pair: float  #: q.k and p.v over all layers and heads, per (query, key) pair

    def kv_bytes(self, requests: int, tokens: int, max_model_len: int) -> int:
        """The KV cache ``requests`` requests of ``tokens`` tokens each hold at once (rounded up to
        blocks of 16, plus a block of slack), and at least one sequence of the model's full
        length, as both engines require: what a benchmark gives tokenmill and vLLM alike, so
        that neither preempts or queues for want of a cache the other has."""
        per_request = -(-tokens // 16) * 16 + 16
        return int(max(requests * per_request, max_model_len + 16) * self.kv_bytes_per_token)


def _timed(fn, device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_bandwidth(device: str = "cpu", buffer_mib: int = 512) -> float:
    """Bytes/s of a streaming read at the threads torch is set to (``torch.set_num_threads``)."""
    dev = torch.device(device)
    buffer = torch.ones(buffer_mib * 2**20 // 4, device=dev)
    return buffer.nbytes / _timed(buffer.sum, dev, 5)


def engine_linear(platform: Platform, weight: torch.Tensor) -> nn.Module:
    """A linear layer of ``weight`` [out, in], prepared by ``platform`` as it prepares a
    model's (prepacked, its own GEMM kernel where it has one)."""
    model = nn.Sequential(Linear(weight.shape[1], [weight.shape[0]], bias=False, dtype=weight.dtype))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    platform.optimize_model(model)
    return model


def measure_machine(dtype: torch.dtype, device: str = "cpu", gemm: int = 2048,
                    platform: Optional[Platform] = None) -> Machine:
    """Bandwidth and compute peak at the threads torch is set to (``torch.set_num_threads``);
    with ``platform`` (one whose layers run where ``device`` is), the peak is the faster of
    ``torch.mm`` and the platform's own linear layer."""
    dev = torch.device(device)
    bandwidth = measure_bandwidth(device)
    a = torch.randn(gemm, gemm, device=dev).to(dtype)
    b = torch.randn(gemm, gemm, device=dev).to(dtype)
    seconds = _timed(lambda: torch.mm(a, b), dev, 5)
    if platform is not None:
        layer = engine_linear(platform, b)
        with torch.inference_mode():
            seconds = min(seconds, _timed(lambda: layer(a), dev, 5))
    return Machine(bandwidth, 2 * gemm**3 / seconds)


def model_workload(model: Path, dtype: torch.dtype, kv_dtype: torch.dtype) -> Workload:
    """A decoder's per-token costs, from its checkpoint's tensor shapes (not its values)."""
    config = load_model_config(model)
    matrices = embedding = head = 0
    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2:
                    continue
                count = shape[0] * shape[1]
                if "embed_tokens" in name:
                    embedding = count
                else:
                    matrices += count
                    head = count if name.startswith("lm_head") else head
    if not head:  # tied: the embedding is also the output projection
        head = embedding
        matrices += embedding
    itemsize = torch.finfo(dtype).bits // 8
    kv_itemsize = torch.finfo(kv_dtype).bits // 8
    layers, heads, kv_heads, head_dim = config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim
    return Workload(weight_bytes=matrices * itemsize, flops_per_token=2 * matrices, head_flops_per_token=2 * head,
                    kv_bytes_per_token=2 * layers * kv_heads * head_dim * kv_itemsize,
                    attention_flops_per_pair=4 * layers * heads * head_dim)


def decode_bound(bandwidth: float, work: Workload, input_len: int, output_len: int) -> float:
    """The bound on one request's time per output token (batch 1: every weight and the
    request's K/V read once per token, at the mean context of its decode), at ``bandwidth`` bytes/s."""
    context = input_len + output_len / 2
    return (work.weight_bytes + context * work.kv_bytes_per_token) / bandwidth


def offline_bound(machine: Machine, work: Workload, num_prompts: int, input_len: int, output_len: int) -> float:
    """The bound on output tokens/s for ``num_prompts`` requests of ``input_len`` -> ``output_len``
    (the first output token comes from the prefill)."""
    prefill_pairs = input_len * (input_len + 1) / 2
    prefill_flops = (work.flops_per_token - work.head_flops_per_token) * input_len + work.head_flops_per_token \
        + work.attention_flops_per_pair * prefill_pairs
    seconds = num_prompts * prefill_flops / machine.peak_flops
    for step in range(1, output_len):
        context = input_len + step
        read = work.weight_bytes + num_prompts * context * work.kv_bytes_per_token
        flops = num_prompts * (work.flops_per_token + work.attention_flops_per_pair * context)
        seconds += max(read / machine.bandwidth, flops / machine.peak_flops)
    return num_prompts * output_len / seconds
