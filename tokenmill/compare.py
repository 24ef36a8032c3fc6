"""``tokenmill compare``: one workload through several engine variants, side by side.

Variants come from comma-separated engine flags (``--attention-backend
torch,cpu,triton``, ``--set scheduling_policy=fifo,priority``) or several
YAML files. Each variant runs in its own subprocess, so its peak memory is
its own, on the same prompts (random token ids, fixed seed), timed after a pass of the same
shapes on other prompts (kernels compiled at first use are not timed). The first
variant is the baseline: the table shows exact token agreement, the first
divergence and the largest logprob difference on the shared prefix, and
tokens/s, TTFT and TPOT, and peak RSS beside what the run cannot do without:
the checkpoint's weights plus the KV cache (as allocated: the cpu platform's
``kv_cache_memory``, resident from the start). The ratio leaves out the process's
RSS before the engine was built (the interpreter and torch's libraries, ~270 MiB).
"""

from __future__ import annotations

import itertools
import json
import random
import resource
import subprocess
import sys
import time
from typing import Any

from tokenmill.interfaces.errors import ConfigError


def variants_from(flags: dict[str, str], sets: list[str], configs: list[str]) -> list[dict[str, Any]]:
    """The cartesian product of every comma-separated value, times each YAML file."""
    axes: dict[str, list[str]] = {name: value.split(",") for name, value in flags.items()}
    for item in sets:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--set", f"expected KEY=V1,V2, got {item!r}")
        axes[name] = value.split(",")
    names = list(axes)
    combos = [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))] or [{}]
    yamls = configs or [None]
    return [{"config": yaml, "overrides": combo} for yaml in yamls for combo in combos]


def label(variant: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in variant["overrides"].items()]
    if variant["config"]:
        parts.insert(0, variant["config"])
    return " ".join(parts) or "default"


def run_worker() -> None:
    """Subprocess entry: read a spec on stdin, run the workload, print JSON on stdout."""
    import torch

    from tokenmill import LLM, SamplingParams, load_config

    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    config = load_config(spec["variant"]["config"], **spec["base"], **_typed(spec["variant"]["overrides"]))
    runtime_mib = _rss_mib()
    llm = LLM(config=config)
    rng = random.Random(spec["seed"])
    vocab = llm.llm_engine.model_config.vocab_size
    warm_up, prompts = ([{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(spec["input_len"])]}
                         for _ in range(spec["num_prompts"])] for _ in range(2))
    params = SamplingParams(temperature=spec["temperature"], seed=spec["seed"], max_tokens=spec["output_len"],
                            ignore_eos=True, logprobs=0)
    # the workload's shapes once, on prompts of their own (no prefix-cache hit later): kernels
    # compiled at first use (flex's torch.compile, Triton's JIT) are built before the timing
    llm.generate(warm_up, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    tpot = sorted((o.metrics.finished_time - o.metrics.first_token_time) / max(1, len(o.outputs[0].token_ids) - 1)
                  for o in outputs)
    kv_bytes = sum(m.kv_cache.nbytes for m in llm.llm_engine.runner.model.modules()
                   if isinstance(getattr(m, "kv_cache", None), torch.Tensor))
    print(json.dumps({
        "runtime_mib": runtime_mib,
        "weights_mib": sum(f.stat().st_size for f in llm.llm_engine.model_config.path.glob("*.safetensors")) / 2**20,
        "kv_mib": kv_bytes / 2**20,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs],
        "tokens_per_s": spec["num_prompts"] * spec["output_len"] / elapsed,
        "ttft_ms": 1000 * ttft[len(ttft) // 2],
        "tpot_ms": 1000 * tpot[len(tpot) // 2],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def _rss_mib() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    from tokenmill.bench.common import process_rss_mib  # the worker's import: torch and httpx

    try:
        return process_rss_mib()
    except (OSError, RuntimeError):
        return 0.0


def _typed(overrides: dict[str, str]) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for key, value in overrides.items():
        lowered = value.lower()
        typed[key] = True if lowered == "true" else False if lowered == "false" else value
    return typed


def agreement(baseline: dict, other: dict) -> dict[str, Any]:
    exact, first, max_diff = 0, None, 0.0
    for i, (a, b) in enumerate(zip(baseline["tokens"], other["tokens"])):
        if a == b:
            exact += 1
        shared = 0
        while shared < min(len(a), len(b)) and a[shared] == b[shared]:
            shared += 1
        if shared < max(len(a), len(b)) and first is None:
            first = {"request": i, "step": shared}
        diffs = [abs(x - y) for x, y in zip(baseline["logprobs"][i][:shared], other["logprobs"][i][:shared])]
        max_diff = max([max_diff, *diffs])
    return {"exact": exact, "total": len(baseline["tokens"]), "first_divergence": first,
            "max_logprob_diff": max_diff}


def compare(spec: dict[str, Any], variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for variant in variants:
        process = subprocess.run([sys.executable, "-m", "tokenmill.cli", "_compare-worker"],
                                 input=json.dumps({**spec, "variant": variant}), capture_output=True, text=True)
        if process.returncode != 0:
            raise ConfigError(label(variant), process.stderr.strip().splitlines()[-1] if process.stderr else "failed")
        rows.append({"variant": label(variant), **json.loads(process.stdout.strip().splitlines()[-1])})
    for row in rows:
        row["agreement"] = agreement(rows[0], row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':<34} {'exact':>7} {'first divergence':>17} {'max |dlogprob|':>15} "
          f"{'tok/s':>8} {'TTFT ms':>9} {'TPOT ms':>9} {'peak MiB':>9} {'runtime':>8} {'weights+KV':>10} {'ratio':>6}")
    for row in rows:
        a = row["agreement"]
        first = "-" if a["first_divergence"] is None else f"req {a['first_divergence']['request']} @ {a['first_divergence']['step']}"
        print(f"{row['variant']:<34} {a['exact']:>3}/{a['total']:<3} {first:>17} {a['max_logprob_diff']:>15.2e} "
              f"{row['tokens_per_s']:>8.1f} {row['ttft_ms']:>9.1f} {row['tpot_ms']:>9.1f} {row['peak_rss_mib']:>9.0f} "
              f"{row['runtime_mib']:>8.0f} {row['weights_mib'] + row['kv_mib']:>10.0f} "
              f"{(row['peak_rss_mib'] - row['runtime_mib']) / (row['weights_mib'] + row['kv_mib']):>5.2f}x")


def write_png(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--png", "the chart needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [row["variant"] for row in rows]
    for axis, key, title in zip(axes, ("tokens_per_s", "ttft_ms", "tpot_ms"), ("tokens/s", "TTFT (ms)", "TPOT (ms)")):
        axis.barh(names, [row[key] for row in rows])
        axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
