#!/usr/bin/env bash
# Every shipped Triton kernel compiled for sm_80 and sm_90 by the GPU image's Triton, on this CPU
# machine: registers, shared memory, spills and stack per case, and a non-zero exit on any spill.
#
# The CPU suite's compile test (tests/test_triton_compile.py) uses the Triton this machine
# installed (the newest); the lent GPU image runs torch 2.11's Triton 3.6, whose register
# allocation differs (it spilled 8-56 bytes in 10 of the cases 3.9 compiles clean). This runs
# the same cases with that version, in a throwaway venv over this Python's packages:
#
#   bash benchmarks/triton_aot_gpu_image.sh [TRITON_VERSION]     # default 3.6.0, ~2 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.6.0}
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || { echo "a full version, such as 3.6.0" >&2; exit 2; }
venv=${TMPDIR:-/tmp}/tokenmill-triton-$version
if [ ! -x "$venv/bin/python" ]; then
    python -m venv --system-site-packages "$venv"
fi
installed() { "$venv/bin/python" -c "import triton; print(triton.__version__)" 2>/dev/null || true; }
if [ "$(installed)" != "$version" ]; then  # a fresh venv, or an install that failed half way
    "$venv/bin/pip" install -q --no-deps "triton==$version"
fi
if [ "$(installed)" != "$version" ]; then
    echo "the venv $venv runs triton $(installed), not $version" >&2
    exit 2
fi
table=$(PYTHONPATH=$PWD "$venv/bin/python" -m tokenmill.testing.triton_aot)
echo "$table"
# columns: target, case, registers, shared, spill bytes, stack bytes
bad=$(echo "$table" | awk -F'|' 'NR > 2 && ($6 + 0 > 0 || $7 + 0 > 0 || $4 ~ /error/)')
if [ -n "$bad" ]; then
    echo "spills or errors under triton $version:"
    echo "$bad"
    exit 1
fi
echo "no spills, no errors under triton $version ($(echo "$table" | grep -c '^| sm') cases)"
