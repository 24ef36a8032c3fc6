"""Quantization plugins: GPTQ, AWQ (4/8-bit integer groups) and FP8 (vLLM fp8, compressed-tensors)."""
