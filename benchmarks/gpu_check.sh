#!/usr/bin/env bash
# The GPU check (issue "The cuda platform"), from the repository root on a machine with an
# NVIDIA GPU:  bash benchmarks/gpu_check.sh
# Installs what it needs (as far as the machine's package index allows), runs the GPU suite
# (tests/gpu), then the offline throughput and the online serving benchmarks on the GPU
# against HF transformers, and against vLLM (PyPI `vllm`) where it installs, in the same run
# on the same weights. Everything it writes goes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$OUT/gpu.csv"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device')" || exit 1
python -m pip install --quiet -e ".[test]" 2>"$OUT/pip.log" || python -m pip install --quiet --no-deps -e . 2>>"$OUT/pip.log"

# 1. the GPU suite: HF parity on CUDA (bf16, fp16), Triton kernels at serving shapes, CUDA graphs
#    on/off, FP8 checkpoints
python -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt"
suite=${PIPESTATUS[0]}

# vLLM where it installs (the machine may have no package index), in a venv of its own so that
# its pinned torch does not replace the one tokenmill was tested with: a peer in both benchmarks
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
if python -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/pip" install --quiet vllm 2>>"$OUT/pip.log"; then
    peers=transformers,vllm
else
    peers=transformers
    echo "vllm did not install here: no vLLM comparison" | tee "$OUT/vllm.txt"
fi

# 2. offline throughput against HF transformers, both on the GPU, the same weights (bf16)
tokenmill bench throughput --device cuda --preset 350m --dtype bfloat16 --num-prompts 256 --input-len 256 \
    --output-len 128 --rounds 3 --json "$OUT/throughput-350m-bf16.json" 2>&1 | tee "$OUT/throughput.txt"
if [[ $peers == *vllm* ]]; then
    model=$(ls -d ~/.cache/tokenmill/bench-models/350m-* | head -1)
    "$VLLM_VENV/bin/vllm" bench throughput --model "$model" --dtype bfloat16 --num-prompts 256 --input-len 256 \
        --output-len 128 --output-json "$OUT/vllm-throughput-350m-bf16.json" 2>&1 | tail -5 | tee "$OUT/vllm-throughput.txt"
fi

# 3. online serving (streamed completions, 32 concurrent), each server launched in turn
tokenmill bench serve --launch "tokenmill,$peers" --vllm "$VLLM_VENV/bin/vllm" --device cuda --dtype bfloat16 \
    --preset 350m --num-prompts 256 --input-len 256 --output-len 128 --max-concurrency 32 --json "$OUT/serve-350m-bf16.json" 2>&1 | tee "$OUT/serve.txt"
exit "$suite"
