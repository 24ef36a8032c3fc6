"""One ``tokenmill bench`` benchmark, two revisions of tokenmill, taking turns on one host: before/after a refactor.

Two tokenmill revisions cannot share a process, so each round runs the benchmark script
once per revision, each in its own process, the order alternating from round to round.
The base is a git worktree of ``--base`` under ``--worktrees``, installed (without
dependencies) into a directory put first on ``PYTHONPATH``: its own package metadata
matters, because plugins are found through the installed distribution's entry points. The
figure compared is tokenmill's own (``--metric``, a path into the script's JSON); the peer
the script also runs (``--skip-hf`` to leave it out) stays a sanity check of the host.
Each run starts in an empty directory, so paths among the script's arguments are absolute.

    taskset -c 0 python benchmarks/revisions.py --base 2fe6256 --rounds 4 \\
        throughput --preset 52m --num-prompts 64 --input-len 128 --output-len 64 --skip-hf
    taskset -c 0 python benchmarks/revisions.py --base 2fe6256 --rounds 4 speculative --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the figure each benchmark's JSON reports for tokenmill, and whether larger is better
METRICS = {
    "throughput": ("engines.tokenmill.output_tokens_per_s", True),
    "latency": ("engines.tokenmill.tpot_ms_median", False),
    "serve": ("engines.tokenmill.output_throughput", True),
    # speculation's own gain, ngram against none in the same process (their ratio, not a speed)
    "speculative": ("results.repeat/batch1/ngram.tpot_speedup", True),
}


def checkout(revision: str, worktrees: Path) -> tuple[Path, Path]:
    """(a worktree of ``revision``, the directory it is installed in), both reused when they exist."""
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    path = worktrees / f"tokenmill-{commit}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True)
    site = worktrees / f"tokenmill-{commit}-site"
    if not site.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(path)], check=True)
    return path, site


def run(tree: Path, site: Path, benchmark: str, benchmark_args: list[str], metric: str) -> float:
    # `tokenmill bench`, or the script it was before it shipped with the package
    script = tree / "benchmarks" / f"{benchmark}.py"
    command = [str(script)] if script.is_file() else ["-m", "tokenmill.cli", "bench", benchmark]
    # run from an empty directory: `python -m` puts the working directory first on sys.path,
    # and from this checkout's root the base would import the head's package; third-party
    # plugins stay out (the contrib packages installed here are the head's, written against
    # its interfaces, which an older base may not have)
    env = {**os.environ, "PYTHONPATH": str(site), "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryDirectory() as cwd:
        subprocess.run([sys.executable, *command, *benchmark_args, "--json", out.name], cwd=cwd,
                       check=True, env=env, stdout=subprocess.DEVNULL)
        value = json.loads(Path(out.name).read_text())
    for key in metric.split("."):
        value = value[key]
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare HEAD's working tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--metric", help="dotted path into the script's JSON (default: per script)")
    parser.add_argument("--worktrees", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("benchmark", choices=sorted(METRICS))
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    metric, larger_is_better = (args.metric, True) if args.metric else METRICS[args.benchmark]
    # the head runs from this checkout, whose editable install provides its metadata
    trees = {"base": checkout(args.base, args.worktrees), "head": (ROOT, ROOT)}
    values: dict[str, list[float]] = {"base": [], "head": []}
    for round_index in range(args.rounds):
        order = ["base", "head"] if round_index % 2 == 0 else ["head", "base"]  # neither always goes first
        for name in order:
            tree, site = trees[name]
            values[name].append(run(tree, site, args.benchmark, args.benchmark_args, metric))
        print(f"round {round_index + 1}: base {values['base'][-1]:.2f}, head {values['head'][-1]:.2f}", flush=True)
    base, head = statistics.median(values["base"]), statistics.median(values["head"])
    ratio = head / base if larger_is_better else base / head
    by_round = [h / b if larger_is_better else b / h for b, h in zip(values["base"], values["head"])]
    print(f"{metric} medians: base ({args.base}) {base:.2f}, head {head:.2f}; head/base (higher is better): "
          f"{ratio:.3f}x; by round: " + ", ".join(f"{r:.3f}x" for r in by_round))


if __name__ == "__main__":
    main()
