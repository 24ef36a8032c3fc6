"""Speculative decoding on the shipped demo pair: batch-1 time per output token and saturation
throughput, without speculation, with prompt lookup (ngram) and with the draft model, and
each proposer's acceptance rate by draft position, all in one run (engines take turns).

Random weights would make acceptance meaningless, so this uses the trained demo-llama (4.3M
parameters) and demo-llama-draft (0.9M, same tokenizer), on held-out Python documentation
(never trained on): "continue" prompts are a paragraph's first 48 tokens; "repeat" prompts
hold a paragraph, then its opening again, where a model that copies lets drafts match.
Greedy, ``ignore_eos``, fixed reply length, so every engine does the same work.

The ceiling: what speculation could give a model if every draft were right. An oracle
proposer replays the reply the engine without speculation generated (acceptance 1.0), on a
bigger model (``--preset``, default the 52M Llama; or ``--model``), at batch 1. It shows how
the cost of a verification step compares with a plain decode step at that size.

    taskset -c 0 python benchmarks/speculative.py --threads 1 --rounds 5 --json out.json

On a GPU (``--device cuda``) the demo pair is all launches and host work: the draft model's
passes replay their own CUDA graphs and chain on the device, and this shows what that buys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import add_common_args, interleaved_rounds, prepare, random_prompts, write_json
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.demo_models import DEMO_DRAFT_MODEL, DEMO_MODEL
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.speculative import SpeculativeProposer
from tokenmill.testing.demo_corpus import corpus_paragraphs

PROMPT_TOKENS = 48


def workloads(tokenizer, count: int) -> dict[str, list[list[int]]]:
    _, held_out = corpus_paragraphs()
    paragraphs = [tokenizer.encode(p, add_special_tokens=True) for p in held_out]
    paragraphs = [p for p in paragraphs if len(p) > PROMPT_TOKENS + 16][:count]
    return {"continue": [p[:PROMPT_TOKENS] for p in paragraphs],
            "repeat": [p[:PROMPT_TOKENS] + p[1:PROMPT_TOKENS // 2] for p in paragraphs]}


class Oracle(SpeculativeProposer):
    """Proposes the rest of the reply the engine without speculation gave (by prompt)."""

    replies: dict[tuple[int, ...], list[int]] = {}

    def propose(self, requests):
        drafts = []
        for request in requests:
            prompt = next(p for p in self.replies if tuple(request.token_ids[:len(p)]) == p)
            done = len(request.token_ids) - len(prompt)
            drafts.append(self.replies[prompt][done:done + request.max_draft_tokens])
        return drafts


class _OraclePlugin:
    @hookimpl
    def register_speculative_proposers(self, register):
        register("oracle", Oracle)


def ceiling(args: argparse.Namespace, params: SamplingParams) -> dict[str, float]:
    """Batch-1 TPOT on ``--preset``/``--model`` without speculation and with the oracle."""
    path = prepare(args)
    prompts = random_prompts(args.batch1_prompts, PROMPT_TOKENS, path, seed=0)
    plain = LLM(str(path), device=args.device, num_threads=args.threads, kv_cache_memory_bytes=256 * 2**20)
    for prompt, output in zip(prompts, plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                      use_tqdm=False)):
        Oracle.replies[tuple(prompt)] = list(output.outputs[0].token_ids)
    pm = make_plugin_manager()
    pm.register(_OraclePlugin(), "oracle")
    oracle = LLM(str(path), device=args.device, num_threads=args.threads, kv_cache_memory_bytes=256 * 2**20,
                 plugin_manager=pm,
                 speculative_config={"method": "oracle", "num_speculative_tokens": args.num_speculative_tokens})
    rounds = interleaved_rounds({name: (lambda llm=llm: timed_pass(llm, prompts, params, 1))
                                 for name, llm in (("none", plain), ("oracle", oracle))}, args.rounds)
    tpot = {name: statistics.median(r["tpot_ms"] for r in runs) for name, runs in rounds.items()}
    speedup = statistics.median(by_round(rounds["none"], rounds["oracle"], "tpot_ms"))
    print(f"ceiling ({path.name}, batch 1): TPOT {tpot['none']:.2f} ms without, {tpot['oracle']:.2f} ms with every "
          f"draft right ({speedup:.2f}x by round; {args.num_speculative_tokens + 1} tokens per step)")
    return {"model": str(path), "tpot_ms": tpot, "speedup": speedup, "rounds": rounds}


def by_round(base: list[dict], runs: list[dict], key: str) -> list[float]:
    """Each round's ``key`` in ``base`` over the one in ``runs``: the engines took turns, and the
    host's speed drifts between rounds, not within one."""
    return [b[key] / r[key] for b, r in zip(base, runs)]


def timed_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict[str, float]:
    """Requests ``batch`` at a time: output tokens per second, and the decode time per output
    token (first token to last, per request; the median over requests)."""
    stats = llm.llm_engine.scheduler.spec_stats
    before = stats.snapshot()
    tokens, tpot = 0, []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for output in llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False):
            m, n = output.metrics, len(output.outputs[0].token_ids)
            tokens += n
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    seconds = time.perf_counter() - start
    new = stats.since(before)
    return {"output_tok_s": tokens / seconds, "tpot_ms": 1000 * statistics.median(tpot),
            "drafts": new.num_drafts, "draft_tokens": new.num_draft_tokens,
            "accepted_tokens": new.num_accepted_tokens, "accepted_per_position": new.accepted_per_position}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per pass (the saturation batch)")
    parser.add_argument("--batch1-prompts", type=int, default=16, help="requests run one at a time per pass (enough that one slow "
                        "stretch of a shared host does not decide the batch-1 ratio)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (each engine's KV cache is 256 MiB)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    # speculation at every batch size (no disable_by_batch_size): the saturation rows measure what it costs there
    specs = {"none": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                       "disable_by_batch_size": None},
             "draft_model": {"model": str(DEMO_DRAFT_MODEL), "num_speculative_tokens": k,
                             "disable_by_batch_size": None}}
    engines = {name: LLM(str(DEMO_MODEL), device=args.device, num_threads=args.threads, max_num_seqs=args.num_prompts,
                         kv_cache_memory_bytes=256 * 2**20, **({"speculative_config": spec} if spec else {}))
               for name, spec in specs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = workloads(engines["none"].get_tokenizer(), args.num_prompts)
    for llm in engines.values():  # warm-up: first-call allocations and kernel choices
        llm.generate([{"prompt_token_ids": p} for p in prompts["continue"][:2]], params, use_tqdm=False)
    summary: dict = {"model": str(DEMO_MODEL), "draft": str(DEMO_DRAFT_MODEL), "threads": args.threads,
                     "num_speculative_tokens": k, "max_tokens": args.max_tokens, "results": {}}
    for workload, workload_prompts in prompts.items():
        for label, batch, count in (("batch1", 1, args.batch1_prompts), ("saturation", args.num_prompts,
                                                                        args.num_prompts)):
            rounds = interleaved_rounds({name: (lambda llm=llm: timed_pass(llm, workload_prompts[:count], params,
                                                                           batch))
                                         for name, llm in engines.items()}, args.rounds)
            for name, runs in rounds.items():
                tpot = statistics.median(r["tpot_ms"] for r in runs)
                tput = statistics.median(r["output_tok_s"] for r in runs)
                speedups = by_round(rounds["none"], runs, "tpot_ms")
                speedup = statistics.median(speedups)
                tput_ratio = statistics.median(by_round(runs, rounds["none"], "output_tok_s"))
                drafted = sum(r["draft_tokens"] for r in runs)
                accepted = sum(r["accepted_tokens"] for r in runs)
                per_position = [sum(r["accepted_per_position"][j] if j < len(r["accepted_per_position"]) else 0
                                    for r in runs) for j in range(k)]
                drafts = sum(r["drafts"] for r in runs)  # vLLM's per-position rate: accepted at j / drafts
                rate = f"{accepted / drafted:.2f}" if drafted else "-"
                positions = " ".join(f"{c / drafts:.2f}" for c in per_position) if drafts else "-"
                print(f"{workload:>8} {label:>10} {name:>11}: TPOT {tpot:6.2f} ms ({speedup:4.2f}x, rounds "
                      f"{min(speedups):4.2f}-{max(speedups):4.2f}), {tput:7.1f} out tok/s ({tput_ratio:4.2f}x), "
                      f"acceptance {rate} [by position {positions}]")
                summary["results"][f"{workload}/{label}/{name}"] = {
                    "tpot_ms": tpot, "output_tok_s": tput, "tpot_speedup": speedup,
                    "tpot_speedup_by_round": speedups,
                    "throughput_ratio": tput_ratio, "acceptance_rate": accepted / drafted if drafted else None,
                    "accepted_per_position": per_position, "draft_tokens": drafted, "rounds": runs}
    summary["ceiling"] = ceiling(args, params)
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
