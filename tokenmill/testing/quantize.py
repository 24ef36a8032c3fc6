"""Round-to-nearest quantizers that write GPTQ, AWQ and FP8 checkpoints in the exact
on-disk layouts the loaders read (the shared test checkpoints' formats).

For tests and benchmarks: ``quantize_model(src, dst, "gptq")`` turns any
tokenmill/HF model directory into a quantized one; with ``dense_copy`` it
also writes the dequantized weights as a plain checkpoint, the exact
reference the quantized model must reproduce.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from tokenmill.plugins.quantization.packing import pack, pack_awq

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max

#: the linear layers a Llama-family checkpoint quantizes (lm_head stays dense); Phi-3 stores
#: qkv_proj and gate_up_proj fused
LINEAR_SUFFIXES = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
                   ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight",
                   ".qkv_proj.weight", ".gate_up_proj.weight")


def _rtn_groups(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric round-to-nearest per group of inputs: (q [K, N], zeros [G, N], scales [G, N], dequant [N, K])."""
    n, k = w.shape
    wg = w.float().T.reshape(k // group_size, group_size, n)  # [G, gs, N]
    lo, hi = wg.amin(dim=1), wg.amax(dim=1)
    maxq = 2**bits - 1
    scales = ((hi - lo) / maxq).clamp(min=1e-8).to(torch.float16).float()
    zeros = torch.round(-lo / scales).clamp(0, maxq)
    q = torch.round(wg / scales[:, None] + zeros[:, None]).clamp(0, maxq)
    dequant = ((q - zeros[:, None]) * scales[:, None]).reshape(k, n).T
    return q.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales.to(torch.float16), dequant


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scale per ``block`` tile of ``w [N, K]``, the last row and column of tiles partial
    where N or K is not a multiple of the block: (fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)],
    dequant [N, K])."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    tiles = padded.view(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    fp8 = (w.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8, scale, fp8.float() * expanded


def quantize_model(src: str | Path, dst: str | Path, method: str, *, bits: int = 4, group_size: int = 64,
                   dense_copy: Optional[str | Path] = None,
                   weight_block_size: Optional[tuple[int, int]] = None) -> Path:
    """Write ``dst``, a ``method`` ("gptq", "awq" or "fp8") checkpoint of the model at ``src``.

    FP8 is per-tensor, or with ``weight_block_size`` block-wise (``weight_scale_inv`` per tile).
    """
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out, dense = {}, {}
    for name, w in tensors.items():
        if not name.endswith(LINEAR_SUFFIXES):
            out[name] = dense[name] = w
            continue
        base = name[: -len(".weight")]
        if method == "fp8" and weight_block_size is not None:
            fp8, scale, dequant = _fp8_blocks(w, weight_block_size)
            out[name], out[f"{base}.weight_scale_inv"] = fp8, scale
            dense[name] = dequant.to(w.dtype)
            continue
        if method == "fp8":  # per-tensor weights, dynamic per-token activations (vLLM "fp8")
            scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
            fp8 = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[name], out[f"{base}.weight_scale"] = fp8, scale.reshape(())
            dense[name] = (fp8.float() * scale).to(w.dtype)
            continue
        q, zeros, scales, dequant = _rtn_groups(w, bits, group_size)
        if method == "gptq":  # v1: zeros stored minus one, packed along the output dim
            out[f"{base}.qweight"] = pack(q, bits, dim=0)
            out[f"{base}.qzeros"] = pack((zeros - 1) & (2**bits - 1), bits, dim=1)
            out[f"{base}.g_idx"] = (torch.arange(q.shape[0]) // group_size).to(torch.int32)
        elif method == "awq":
            out[f"{base}.qweight"] = pack_awq(q)
            out[f"{base}.qzeros"] = pack_awq(zeros)
        else:
            raise ValueError(f"unknown method {method!r}")
        out[f"{base}.scales"] = scales
        dense[name] = dequant.to(w.dtype)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    fp8_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if weight_block_size is not None:
        fp8_config["weight_block_size"] = list(weight_block_size)
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"},
        "fp8": fp8_config,
    }[method]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if dense_copy is not None:
        dense_dir = Path(dense_copy)
        shutil.copytree(src, dense_dir, dirs_exist_ok=True)
        save_file(dense, dense_dir / "model.safetensors", metadata={"format": "pt"})
    return dst
