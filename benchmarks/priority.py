"""Time to first token of a high-priority class under load: FIFO vs the priority policy.

One Poisson arrival trace (fixed seed) of mixed priorities is replayed in
real time through the offline engine twice, once per policy, on the same
model. Prints TTFT p50/p99 per priority class and the high class's gain.

    python benchmarks/priority.py --preset tiny --num-requests 200 --rate 40 --high-fraction 0.2
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from tokenmill.bench.common import add_common_args, prepare, write_json
from tokenmill import LLM, SamplingParams


def replay(path, trace, policy: str, args) -> dict[int, list[float]]:
    llm = LLM(str(path), scheduling_policy=policy, max_num_seqs=args.max_num_seqs,
              kv_cache_memory_bytes=256 * 2**20)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttft: dict[int, list[float]] = {}
    start = time.monotonic()
    pending = list(trace)
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            at, i, priority, prompt = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params, priority=priority,
                               arrival_time=start + at)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for output in engine.step():
            if output.finished:
                m = output.metrics
                priority = trace[int(output.request_id)][2]
                ttft.setdefault(priority, []).append(m.first_token_time - m.arrival_time)
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.set_defaults(preset="tiny")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--high-fraction", type=float, default=0.2)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = prepare(args)
    rng = random.Random(args.seed)
    trace, at = [], 0.0
    for i in range(args.num_requests):
        at += rng.expovariate(args.rate)
        priority = 0 if rng.random() < args.high_fraction else 1
        trace.append((at, i, priority, [rng.randrange(10, 500) for _ in range(args.input_len)]))

    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "policies": {}}
    for policy in ("fifo", "priority"):
        ttft = replay(path, trace, policy, args)
        report["policies"][policy] = {
            f"priority_{p}": {"count": len(v), "ttft_p50_ms": round(1000 * float(np.percentile(v, 50)), 1),
                              "ttft_p99_ms": round(1000 * float(np.percentile(v, 99)), 1)}
            for p, v in sorted(ttft.items())}
    print(f"{'policy':<10} {'class':<12} {'n':>5} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for policy, classes in report["policies"].items():
        for name, r in classes.items():
            print(f"{policy:<10} {name:<12} {r['count']:>5} {r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}")
    fifo, prio = report["policies"]["fifo"]["priority_0"], report["policies"]["priority"]["priority_0"]
    print(f"high-priority TTFT p50: {fifo['ttft_p50_ms'] / prio['ttft_p50_ms']:.1f}x lower with priority; "
          f"p99: {fifo['ttft_p99_ms'] / prio['ttft_p99_ms']:.1f}x")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
