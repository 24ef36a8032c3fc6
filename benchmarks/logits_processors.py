"""What a logits processor on every request costs: the same engine, the same prompts, with and
without ``allowed_token_ids`` (half the vocabulary) on every request, taking turns.

The processor masks the logits of the whole batch in one operation, and a greedy batch that
carries it can no longer take the platform's argmax-only head (the logits are needed), so
the figure is the whole price a user pays. Prints each variant's output tokens/s per round,
the median overhead as a share of step time, and the ratio per round.

    taskset -c 0 python benchmarks/logits_processors.py --preset 52m --num-prompts 64 \\
        --input-len 128 --output-len 64 --rounds 4 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import add_common_args, interleaved_rounds, prepare, random_prompts, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = prepare(args)
    llm = LLM(str(path), num_threads=args.threads)
    vocab = llm.llm_engine.model_config.vocab_size
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    allowed = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                             allowed_token_ids=list(range(0, vocab, 2)))
    # a prompt set per pass (a repeated one would be served from the prefix cache), one for warm-up
    sets = iter([random_prompts(args.num_prompts, args.input_len, path, args.seed + i)
                 for i in range(2 * args.rounds + 1)])
    warm = next(sets)
    llm.generate([{"prompt_token_ids": p} for p in warm[:4]], [plain] * 2 + [allowed] * 2, use_tqdm=False)

    def run(params: SamplingParams):
        def timed() -> float:
            prompts = next(sets)
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
            if params.allowed_token_ids:
                assert all(t % 2 == 0 for o in outputs for t in o.outputs[0].token_ids)
            return args.num_prompts * args.output_len / elapsed
        return timed

    results = interleaved_rounds({"plain": run(plain), "allowed_token_ids": run(allowed)}, args.rounds)
    overheads = [p / a - 1 for p, a in zip(results["plain"], results["allowed_token_ids"])]
    summary = {
        "model": str(path), "threads": args.threads, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "output_tokens_per_s": {name: statistics.median(values) for name, values in results.items()},
        "rounds": results, "overhead_share_of_step_time": overheads,
        "overhead_median": statistics.median(overheads),
    }
    for name, values in results.items():
        print(f"{name:>18}: {statistics.median(values):8.1f} output tok/s  (rounds: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")
    print(f"allowed_token_ids costs {100 * summary['overhead_median']:.1f}% of step time (median; rounds: "
          + ", ".join(f"{100 * o:.1f}%" for o in overheads) + ")")
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
