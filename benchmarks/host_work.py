"""The engine's host work per request-step, by phase: what bounds a GPU's decode at large batch.

On a GPU a decode step of a small model at batch 256 is one or two milliseconds of device
work; the engine's Python around it (schedule, launch bookkeeping, sampling, outputs) runs
per request, and once it costs more than the device's share it is the step's time. Here
every phase is timed on the host with the forward pass (``ModelStep.run``) apart, so the
figures are per request-step and the forward's share is visible:

    python benchmarks/host_work.py --preset host --num-prompts 1024 --output-len 128 --max-num-seqs 256

On the CPU the forward pass is the model's compute; on a GPU it is the launch (a graph
replay) and whatever it waits for.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import Counter
from typing import Any, Callable

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import add_common_args, prepare, random_prompts, write_json
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.worker.model_runner import ModelRunner
from tokenmill.core.worker.model_step import ModelStep

#: (class, method, phase): a phase's time includes the phases it calls
PHASES = ((LLMEngine, "step", "step"), (Scheduler, "schedule", "schedule"), (ModelRunner, "launch", "launch"),
          (ModelStep, "run", "forward"), (ModelRunner, "finish", "finish"), (LLMEngine, "_advance", "advance"),
          (Scheduler, "update", "scheduler update"))


def timed(method: Callable, phase: str, totals: Counter) -> Callable:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, default_preset="host")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    path = prepare(args)
    totals: Counter = Counter()
    for cls, name, phase in PHASES:
        setattr(cls, name, timed(getattr(cls, name), phase, totals))
    llm = LLM(str(path), num_threads=args.threads, max_num_seqs=args.max_num_seqs, device=args.device)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, path, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:args.max_num_seqs], params, use_tqdm=False)  # warm-up
    request_steps = args.num_prompts * args.output_len
    rounds = []
    for _ in range(args.rounds):
        totals.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        us = {phase: 1e6 * seconds / request_steps for phase, seconds in totals.items()}
        us["wall"] = 1e6 * wall / request_steps
        us["host (wall - forward)"] = us["wall"] - us["forward"]
        us["launch - forward"] = us["launch"] - us["forward"]
        us["advance - scheduler update"] = us["advance"] - us["scheduler update"]
        us["outside step"] = us["wall"] - us["step"]
        rounds.append(us)
    medians = {phase: statistics.median(r[phase] for r in rounds) for phase in rounds[0]}
    print(f"us per request-step, medians of {args.rounds} round(s), {args.num_prompts} x "
          f"({args.input_len} -> {args.output_len}), max_num_seqs {args.max_num_seqs}:")
    for phase in ("wall", "forward", "host (wall - forward)", "schedule", "launch - forward", "finish",
                  "scheduler update", "advance - scheduler update", "outside step"):
        print(f"  {phase:28s} {medians[phase]:7.2f}")
    write_json(args.json, {"config": vars(args), "us_per_request_step": medians, "rounds": rounds})


if __name__ == "__main__":
    main()
