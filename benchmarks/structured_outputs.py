"""What structured outputs cost per step: the time spent advancing matchers and filling and
applying the token bitmask, as a share of step time, at batch 1 and at batch 64, with a nested
JSON schema on every request. Also the same prompts' step time without a constraint, for scale.

The constraint's work runs inside the sampler (the StructuredOutput logits processor), so the
script times that processor's ``apply`` beside each engine step; one engine, rounds alternate
constrained and plain passes.

    taskset -c 0 python benchmarks/structured_outputs.py --preset 52m --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import add_common_args, prepare, random_prompts, write_json
from tokenmill.core.sample.logits_processors.structured_output import StructuredOutput

#: nested objects, an array of objects, enums and bounded numbers and strings
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["order", "items"],
    "properties": {
        "order": {"type": "object", "additionalProperties": False, "required": ["id", "status", "customer"],
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                 "status": {"enum": ["new", "paid", "shipped"]},
                                 "customer": {"type": "object", "additionalProperties": False, "required": ["name"],
                                              "properties": {"name": {"type": "string", "maxLength": 12},
                                                             "vip": {"type": "boolean"}}}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 4,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "maxLength": 8},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    },
}


class _Timed:
    """Accumulates the time of StructuredOutput.apply."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        original = StructuredOutput.apply

        def apply(processor, logits):
            start = time.perf_counter()
            try:
                return original(processor, logits)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        StructuredOutput.apply = apply


def run_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams, timer: _Timed) -> dict[str, float]:
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    steps, step_seconds, tokens = 0, 0.0, 0
    timer.seconds, timer.calls = 0.0, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        step_seconds += time.perf_counter() - start
        steps += 1
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    return {"steps": steps, "step_ms": 1000 * step_seconds / steps, "output_tokens": tokens,
            "constraint_ms": 1000 * timer.seconds / max(timer.calls, 1),
            "constraint_share": timer.seconds / step_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = prepare(args)
    llm = LLM(str(path), num_threads=args.threads, max_num_seqs=64)
    timer = _Timed()
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens)
    warm = random_prompts(2, args.input_len, path, args.seed + 999)
    run_pass(llm, warm, constrained, timer)  # compiles the schema once (cached after)
    results: dict[str, list[dict[str, float]]] = {}
    for batch in (1, 64):
        for round_index in range(args.rounds):
            prompts = random_prompts(batch, args.input_len, path, args.seed + 100 * batch + round_index)
            order = [("constrained", constrained), ("plain", plain)]
            for name, params in order if round_index % 2 == 0 else order[::-1]:
                results.setdefault(f"batch{batch}_{name}", []).append(run_pass(llm, prompts, params, timer))
    summary = {"model": str(path), "threads": args.threads, "rounds": results}
    for key, runs in results.items():
        step = statistics.median(r["step_ms"] for r in runs)
        line = f"{key:>22}: step {step:7.2f} ms (median of {len(runs)})"
        if key.endswith("constrained"):
            share = statistics.median(r["constraint_share"] for r in runs)
            per_call = statistics.median(r["constraint_ms"] for r in runs)
            line += f", constraint {per_call:.3f} ms per step = {100 * share:.1f}% of step time"
            summary[f"{key}_constraint_share"] = share
        summary[f"{key}_step_ms"] = step
        print(line)
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
