#!/usr/bin/env bash
# The GPU check, on a bare GPU machine with no package index, in under 9 minutes.
#
# First, on a CPU machine, in the checkout:  python benchmarks/gpu_prepare.py
# (wheels of what the GPU image lacks into .whl/, the shared quantized checkpoints into
# .gpu-data/, Triton's kernels compiled for sm_90 into .triton-cache/; all ignored). Then, on the
# GPU machine, from the repository root, with those three folders carried along:
# bash benchmarks/gpu_check.sh
#
# Stages, each under a hard cap (45 + 240 + 70 + 110 + 75 + 40 s), each run whatever the one before
# it did, so a crash of one hides none of the others' results; a stage's cap shrinks to what is
# left of DEADLINE (575 s, set it to the device call's timeout_s less 15), and a stage with
# under 10 s left is skipped, so the summary always prints:
#   0. install: the wheels with --no-index --no-deps, the project without its dependencies;
#   1. the GPU suite (tests/gpu): the tests marked gpu_alone, then the rest on 4 workers;
#      meanwhile the CPUs make the 1b model (TinyLlama-1.1B's shapes, random bf16 weights);
#   2. the Triton attention against SDPA's FlashAttention, one layer call (gpu_attention.py);
#   3. offline throughput against HF transformers on the 1b model, 256 requests of 256 -> 128 tokens,
#      tokenmill step by step and with async scheduling (tokenmill-async);
#   4. batch-1 latency against HF on the same weights, both ways too;
#   5. where a step's time goes on the GPU (gpu_profile.py: kernel time, idle share, top kernels);
#   and, named alone (not defaults): sweep, the attention kernels' tile choices timed (150 s); flex, the
#   flex backend (FlexAttention, compiled) through tests/gpu/test_cuda_flex.py and timed beside the
#   Triton attention and SDPA (150 + 120 s: its kernels compile at first use); speculative, the demo
#   pair without speculation, with ngram and with the draft model, batch 1 and 32 (speculative.py, 120 s);
#   serve, `bench serve` on the 1b model at 64 streams, 256 x (256 -> 128), the engine in the server's process,
#   in its own (--engine-process), and behind four API servers (--api-server-count 4), beside the offline
#   figure of the throughput stage (210 s);
#   8b, Llama-3-8B's shapes (random bf16 weights drawn on the GPU, 16 GB): throughput 256 x (256 -> 128) and
#   batch-1 latency against HF, one tokenmill engine (async scheduling) at 0.6 of the GPU so HF's copy
#   fits beside it (120 + 180 + 130 s: a call of its own, DEADLINE=495 and timeout_s=510; the caps and
#   install's fill the deadline, less the summary's 20 s).
# It prints a summary (last, on stdout; with the Triton compiles the carried cache held and those it
# missed) and writes at most 8 files to $OUT, triton.jsonl among them (the Triton specializations used). Exit status: the suite's.
# Arguments name the stages to run after install (default: suite attention throughput latency profile), so a rerun
# within the same lease can spend its minutes on the suite alone.
# A stage that reaches its cap gets SIGINT first: pytest then still prints the failures so far,
# and suite.jsonl (pytest-reportlog) holds a line per test, traceback included, as each ends.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary=()
started=$SECONDS
deadline=${DEADLINE:-575}
[[ $deadline =~ ^[0-9]+$ ]] || { echo "DEADLINE is whole seconds, not $deadline" >&2; exit 2; }

stage() {  # stage NAME SECONDS COMMAND...: run under a cap, log to $OUT/NAME.txt, note the status
    local name=$1 cap=$2
    shift 2
    local t0=$SECONDS
    local left=$((deadline - (SECONDS - started) - 20))  # for a stopped stage's kill and the summary
    if ((left < 10)); then
        summary+=("$name: skipped, $((SECONDS - started)) s of the ${deadline}s deadline used")
        return 125  # not run: never a pass
    fi
    ((cap > left)) && cap=$left
    timeout --signal=INT --kill-after=15 "$cap" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    local what="exit $rc"
    [[ $rc == 124 || $rc == 137 ]] && what="stopped at its ${cap}s cap"
    summary+=("$name: $what, $((SECONDS - t0)) s")
    return $rc
}

gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1)
commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

install() {
    set -e
    [[ -d .whl ]] || { echo "no .whl/: run python benchmarks/gpu_prepare.py on a CPU machine, carry .whl"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    PYTHONPATH=/tmp/site python3 -c "import tokenmill, fastapi, uvicorn, openai, xgrammar, torch
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('tokenmill', tokenmill.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
    PYTHONPATH=/tmp/site python3 -m pip check || true  # the image's versions against the wheels' needs (--no-deps)
}
export -f install
if stage install 45 bash -c install; then  # its lines into the summary, so that $OUT keeps 8 files for the rest
    mapfile -t -O "${#summary[@]}" summary < <({ grep '^tokenmill ' "$OUT/install.txt"; grep -v '^tokenmill ' \
        "$OUT/install.txt" | tail -2; } | sed 's/^/install: /')  # the versions, and pip check's last word
    rm -f "$OUT/install.txt"
    # benchmarks/gpu_site's sitecustomize: every process appends the Triton specializations it uses,
    # for the next gpu_prepare.py to compile on the CPU too
    export TOKENMILL_TRITON_RECORDS=$OUT/triton.jsonl
fi
# Triton's kernels as the CPU compiled them for this GPU (gpu_prepare.py: .triton-cache, carried),
# at the absolute path their group files name
export TRITON_CACHE_DIR=/tmp/tokenmill-triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[[ -d .triton-cache ]] && cp -r .triton-cache/. "$TRITON_CACHE_DIR"
export PYTHONPATH=/tmp/site:$PWD/benchmarks/gpu_site
stages=" ${*:-suite attention throughput latency profile} "

model=/tmp/tokenmill-1b
maker=
if [[ $stages == *" throughput "* || $stages == *" latency "* || $stages == *" profile "* || $stages == *" serve "* ]]; then
    timeout --kill-after=5 240 python3 -m tokenmill.cli make-model "$model" --preset 1b >"$OUT/model.log" 2>&1 &
    maker=$!
fi

suite() {  # the tests that read the GPU's free memory alone, then 4 workers; a line per test
    # SUITE_TESTS (node ids, space-separated) reruns only those, say the last call's failures
    local tests
    read -ra tests <<<"${SUITE_TESTS:-tests/gpu}"
    local pytest=(python3 -m pytest -p no:cacheprovider -rfE --tb=short --timeout 150 -W ignore::FutureWarning
                  "${tests[@]}" --ignore tests/gpu/test_cuda_flex.py)
    "${pytest[@]}" -v -m gpu_alone --report-log "$OUT/suite-alone.jsonl"  # appended to suite.jsonl after
    local alone=$?
    ((alone == 5)) && alone=0  # none of the tests named is gpu_alone
    ((alone == 2)) && return 2  # interrupted at the cap: no time for the rest
    "${pytest[@]}" -v -n 4 -m "gpu and not gpu_alone" --report-log "$OUT/suite.jsonl"
    local rest=$?
    ((rest == 5)) && rest=0
    ((rest != 0)) && return $rest
    return $alone
}
export -f suite
suite=0
if [[ $stages == *" suite "* ]]; then
    stage suite 240 bash -c suite
    suite=$?
    cat "$OUT/suite-alone.jsonl" >>"$OUT/suite.jsonl" 2>/dev/null && rm -f "$OUT/suite-alone.jsonl"
fi
[[ $stages == *" attention "* ]] && stage attention 70 python3 benchmarks/gpu_attention.py
[[ $stages == *" sweep "* ]] && stage sweep 150 python3 benchmarks/gpu_attention.py --sweep  # asked for by name only
if [[ $stages == *" flex "* ]]; then  # asked for by name only
    stage flex-suite 150 python3 -m pytest -p no:cacheprovider -rfE --tb=short -v -W ignore::FutureWarning \
        tests/gpu/test_cuda_flex.py
    stage flex 120 python3 benchmarks/gpu_attention.py --flex
fi
if [[ $stages == *" 8b "* ]]; then  # asked for by name only
    big=/tmp/tokenmill-8b
    stage make-8b 120 python3 -m tokenmill.cli make-model "$big" --preset 8b --device cuda
    for bench in throughput latency; do
        extra=(--num-prompts 256 --hf-batch-size 128)
        [[ $bench == latency ]] && extra=(--num-iters 3)
        stage "$bench-8b" $([[ $bench == throughput ]] && echo 180 || echo 130) python3 -m tokenmill.cli bench "$bench" \
            --device cuda --model "$big" --dtype bfloat16 --input-len 256 --output-len 128 --rounds 2 \
            --async-scheduling on --gpu-memory-utilization 0.6 "${extra[@]}"
    done
fi
[[ $stages == *" speculative "* ]] && stage speculative 120 python3 benchmarks/speculative.py --device cuda \
    --rounds 2 --batch1-prompts 8  # asked for by name only

if [[ -n $maker ]]; then
    wait "$maker" || summary+=("the 1b model was not made: $(tail -1 "$OUT/model.log")")
    rm -f "$OUT/model.log"
fi

[[ $stages == *" throughput "* ]] && stage throughput 110 python3 -m tokenmill.cli bench throughput --device cuda --model "$model" --dtype bfloat16 \
    --num-prompts 256 --input-len 256 --output-len 128 --hf-batch-size 128 --rounds 2 --async-scheduling both \
    --json "$OUT/throughput.json"

[[ $stages == *" latency "* ]] && stage latency 75 python3 -m tokenmill.cli bench latency --device cuda --model "$model" --dtype bfloat16 \
    --input-len 256 --output-len 128 --num-iters 3 --rounds 2 --async-scheduling both

[[ $stages == *" profile "* ]] && stage profile 40 python3 benchmarks/gpu_profile.py --model "$model"

[[ $stages == *" serve "* ]] && stage serve 210 python3 -m tokenmill.cli bench serve --device cuda --model "$model" \
    --dtype bfloat16 --launch tokenmill,tokenmill-engine-process,tokenmill-api-servers --api-server-count 4 \
    --num-prompts 256 --max-concurrency 64 --input-len 256 --output-len 128 --json "$OUT/serve.json"  # by name only

# the compiles' hits and misses by kernel, and what the carried cache was built from against this machine
triton=$(TOKENMILL_TRITON_RECORDS= python3 -m tokenmill.testing.triton_cache summary "$OUT/triton.jsonl" \
    --carried .triton-cache 2>&1 | tail -40)
[[ -f $OUT/triton.jsonl ]] && sort -u -o "$OUT/triton.jsonl" "$OUT/triton.jsonl"
{
    echo "$gpu"
    printf '%s\n' "${summary[@]}"
    echo "$triton"
    grep -E "^(FAILED|ERROR) |(passed|failed|error|skipped|deselected)( |,|$)" "$OUT/suite.txt" 2>/dev/null | sed 's/^/suite: /' | tail -60
    grep -E "(passed|failed|error)( |,|$)" "$OUT/flex-suite.txt" 2>/dev/null | sed 's/^/flex suite: /' | tail -8
    grep -E "^(case|decode|prefill|  flex) " "$OUT/attention.txt" "$OUT/sweep.txt" "$OUT/flex.txt" 2>/dev/null
    grep -E "tok/s|x HF|TPOT|tokenmill|hf-generate|roofline" "$OUT/throughput.txt" "$OUT/latency.txt" \
        "$OUT/throughput-8b.txt" "$OUT/latency-8b.txt" 2>/dev/null | tail -24
    grep -E "TPOT|tok/s" "$OUT/speculative.txt" 2>/dev/null | tail -12
    grep -E "^tokenmill" "$OUT/serve.txt" 2>/dev/null | tail -9
    grep -E "^(== |wall )" "$OUT/profile.txt" 2>/dev/null
    echo "total $((SECONDS - started)) s"
}
exit "$suite"
