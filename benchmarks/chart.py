"""The README's chart: tokenmill, HF transformers and llama.cpp from results/*.json (one
run each, the median of its rounds where it ran several, this machine), beside the peers'
figures quoted in the CPU-performance issue (measured elsewhere).

    python benchmarks/chart.py --out benchmarks/results/cpu-performance.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
#: (title, results file, metric, HF engine key, peers quoted in the issue: name -> value)
PANELS = [
    ("W1 offline, 350M bf16\noutput tok/s (higher is better)", "throughput-350m-bf16.json",
     "output_tokens_per_s", "hf-generate", {"vLLM 0.32": 165, "llama.cpp": 97.6}),
    ("W1 offline, 52M fp32\noutput tok/s", "throughput-52m-fp32.json",
     "output_tokens_per_s", "hf-generate", {"vLLM 0.32": 830, "llama.cpp": 546}),
    ("Serving, 52M fp32, 32 at once\noutput tok/s", "serve-52m-fp32-c32.json",
     "output_throughput", "transformers", {"vLLM 0.32": 729, "llama.cpp": 446}),
    ("Batch-1 decode, 350M bf16\nTPOT ms (lower is better)", "latency-350m-bf16.json",
     "tpot_ms_median", "hf-generate", {"llama.cpp": 21.5}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "cpu-performance.png"))
    args = parser.parse_args()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4))
    for ax, (title, name, metric, hf_key, peers) in zip(axes, PANELS):
        path = RESULTS / name
        measured = json.loads(path.read_text())["engines"] if path.exists() else {}
        labels, values, colors, hatches = [], [], [], []
        for engine, color in (("tokenmill", "tab:blue"), (hf_key, "tab:orange"), ("llama.cpp", "tab:green")):
            if engine in measured:
                labels.append({hf_key: "HF", "llama.cpp": "llama.cpp\n(here)"}.get(engine, engine))
                values.append(measured[engine][metric])
                colors.append(color)
                hatches.append("")
        for peer, value in peers.items():
            labels.append(peer + "*")
            values.append(value)
            colors.append("lightgray")
            hatches.append("//")
        bars = ax.bar(labels, values, color=colors, hatch=hatches, edgecolor="black", linewidth=0.5)
        ax.bar_label(bars, fmt="%.0f" if max(values, default=0) > 50 else "%.1f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle("tokenmill vs HF transformers and llama.cpp on this machine, 1 thread "
                 "(* = figure quoted in the issue, measured elsewhere)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
