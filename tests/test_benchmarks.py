"""The benchmark scripts run as the README shows, and their rounds take turns.

Timings themselves are never asserted (the host is shared); what is checked is the
bookkeeping a reader relies on: one figure per round, medians, and ratios that match them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.bench.common import engine_memory, engine_platform, interleaved_rounds
from tokenmill.bench.roofline import (Machine, Workload, decode_bound, engine_linear, model_workload,
                                     offline_bound)
from tokenmill.core.layers.linear import UnquantizedLinearMethod
from tokenmill.demo_models import DEMO_MODEL


def test_roofline_counts_the_checkpoints_tensors(model_dir):
    """The workload's costs come from the checkpoint's shapes: every matrix but the embedding
    table is read once per decode step (a tied embedding is the output projection too)."""
    from safetensors import safe_open

    path = model_dir("llama")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    config = json.loads((path / "config.json").read_text())
    matrices = sum(s[0] * s[1] for name, s in shapes.items() if len(s) == 2 and "embed" not in name)
    head = config["vocab_size"] * config["hidden_size"]
    if "lm_head.weight" not in shapes:
        matrices += head
    work = model_workload(path, torch.float32, torch.bfloat16)
    assert work.weight_bytes == 4 * matrices and work.flops_per_token == 2 * matrices
    assert work.head_flops_per_token == 2 * head
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert work.kv_bytes_per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


def test_roofline_takes_each_step_at_its_slower_limit():
    """Prefill at the compute peak (the output projection for a prompt's last token only);
    each decode step the longer of its reads at the bandwidth and its FLOPs at the peak."""
    work = Workload(weight_bytes=1000, flops_per_token=300, head_flops_per_token=100, kv_bytes_per_token=10,
                    attention_flops_per_pair=1)
    machine = Machine(bandwidth=1e4, peak_flops=1e5)
    prefill = 2 * ((300 - 100) * 3 + 100 + 1 * (3 * 4 / 2)) / 1e5
    decode = sum(max((1000 + 2 * (3 + s) * 10) / 1e4, 2 * (300 + 3 + s) / 1e5) for s in range(1, 4))
    assert offline_bound(machine, work, num_prompts=2, input_len=3, output_len=4) == pytest.approx(
        2 * 4 / (prefill + decode))


def test_roofline_times_the_engines_own_linear_layer():
    """The compute peak is also timed on the layer the platform prepares (on AVX2-only CPUs the
    cpu platform's own GEMM outruns oneDNN's): a prepared layer, computing x W^T."""
    weight = torch.randn(96, 64)
    layer = engine_linear(engine_platform(DEMO_MODEL), weight)
    assert type(layer[0].method) is not UnquantizedLinearMethod
    x = torch.randn(16, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-4, atol=1e-4)


def test_rounds_take_turns_and_rotate_the_first_engine():
    calls: list[str] = []

    def engine(name: str):
        def timed() -> str:
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"
        return timed

    results = interleaved_rounds({"a": engine("a"), "b": engine("b"), "c": engine("c")}, rounds=4)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert results == {"a": ["a1", "a2", "a3", "a4"], "b": ["b1", "b2", "b3", "b4"], "c": ["c1", "c2", "c3", "c4"]}


def _run(benchmark: str, tmp_path: Path, *args: str, model: list[str] | None = None) -> dict:
    """``tokenmill bench BENCHMARK`` on the tiny preset (or ``model``), two rounds."""
    out = tmp_path / f"{benchmark}.json"
    source = model or ["--preset", "tiny", "--cache-dir", str(tmp_path)]
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", benchmark, *source, "--rounds", "2",
                    "--json", str(out), *args], check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_throughput_reports_medians_of_rounds(tmp_path):
    results = _run("throughput", tmp_path, "--num-prompts", "4", "--input-len", "16", "--output-len", "4")
    engines = results["engines"]
    assert set(engines) == {"tokenmill", "hf-generate"}
    for r in engines.values():
        assert len(r["seconds_by_round"]) == 2
        assert r["seconds"] == pytest.approx(statistics.median(r["seconds_by_round"]), abs=2e-3)
        assert r["output_tokens_per_s"] == pytest.approx(16 / statistics.median(r["seconds_by_round"]), rel=0.05)
    by_round = [h / t for h, t in zip(engines["hf-generate"]["seconds_by_round"], engines["tokenmill"]["seconds_by_round"])]
    assert results["ratio_tokenmill_vs_hf_by_round"] == pytest.approx(by_round, rel=0.05)
    assert results["ratio_tokenmill_vs_hf"] == pytest.approx(
        engines["tokenmill"]["output_tokens_per_s"] / engines["hf-generate"]["output_tokens_per_s"], rel=0.05)
    roofline = results["roofline"]
    assert roofline["bandwidth_gb_s"] > 0 and roofline["peak_tflops"] > 0
    assert roofline["tokenmill_share"] == pytest.approx(
        engines["tokenmill"]["output_tokens_per_s"] / roofline["output_tokens_per_s"], rel=0.01, abs=1e-3)


#: a `vllm` executable as tokenmill's benchmarks call it (vLLM itself, with its own torch, is not
#: installed beside tokenmill): it checks the command line and environment it is given, and
#: reports an elapsed time the way `vllm bench throughput --output-json` does
_VLLM = """#!{python}
import argparse, json, os, sys
assert sys.argv[1:3] == ["bench", "throughput"], sys.argv
parser = argparse.ArgumentParser()
for flag in ("--model", "--dtype", "--dataset-name", "--random-input-len", "--random-output-len", "--num-prompts",
             "--kv-cache-memory-bytes",
             "--seed", "--num-warmups", "--output-json"):
    parser.add_argument(flag, required=True)
args = parser.parse_args(sys.argv[3:])
assert (args.dtype, args.dataset_name, args.random_input_len, args.random_output_len, args.num_prompts) == (
    "float32", "random", "16", "4", "4"), args
assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1", os.environ["VLLM_CPU_OMP_THREADS_BIND"]
with open(args.output_json, "w") as f:
    json.dump({{"elapsed_time": 0.5 + int(args.seed), "num_requests": 4}}, f)
with open(os.path.join(os.path.dirname(sys.argv[0]), "kv_cache_memory_bytes"), "w") as f:
    f.write(args.kv_cache_memory_bytes)
"""


@pytest.mark.slow
def test_throughput_runs_vllm_as_a_peer(tmp_path):
    """`--vllm`: one `vllm bench throughput` per round, in tokenmill's dtype, with one bound
    core per thread and tokenmill's KV cache size (by default what every request needs at
    once), its elapsed time beside tokenmill's and the ratio of their medians."""
    vllm = tmp_path / "vllm"
    vllm.write_text(_VLLM.format(python=sys.executable))
    vllm.chmod(0o755)
    results = _run("throughput", tmp_path, "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                   "--skip-hf", "--threads", "2", "--seed", "3", "--vllm", str(vllm))
    engines = results["engines"]
    assert engines["vllm"]["seconds_by_round"] == [3.5, 4.5]  # a new prompt seed per round
    per_token = model_workload(tmp_path / "tiny-float32", torch.float32, torch.float32).kv_bytes_per_token
    assert int((tmp_path / "kv_cache_memory_bytes").read_text()) == (512 + 16) * per_token  # max_model_len's
    tokenmill = statistics.median(engines["tokenmill"]["seconds_by_round"])
    assert results["ratio_tokenmill_vs_vllm"] == pytest.approx(4.0 / tokenmill, rel=0.01)


@pytest.mark.slow
def test_latency_reports_a_tpot_per_round(tmp_path):
    results = _run("latency", tmp_path, "--input-len", "16", "--output-len", "6", "--num-iters", "2")
    engines = results["engines"]
    assert set(engines) == {"tokenmill", "hf-generate"}
    for r in engines.values():
        assert len(r["tpot_ms_median_by_round"]) == 2
        assert min(r["tpot_ms_median_by_round"]) <= r["tpot_ms_median"] <= max(r["tpot_ms_median_by_round"])
    assert len(results["tpot_speedup_vs_hf_by_round"]) == 2
    roofline = results["roofline"]  # batch 1's weight-streaming bound, and tokenmill's TPOT against it
    assert roofline["tpot_ms"] > 0 and roofline["bandwidth_gb_s"] > 0
    assert roofline["tokenmill_tpot_vs_bound"] == pytest.approx(engines["tokenmill"]["tpot_ms_median"]
                                                                / roofline["tpot_ms"], rel=0.01)


def test_the_batch_1_bound_reads_the_weights_and_the_mean_contexts_kv_once_a_token():
    work = Workload(weight_bytes=1000, flops_per_token=300, head_flops_per_token=100, kv_bytes_per_token=10,
                    attention_flops_per_pair=1)
    assert decode_bound(1e4, work, input_len=20, output_len=8) == \
        pytest.approx((1000 + 24 * 10) / 1e4)


def test_engines_in_one_bench_process_share_the_gpu(tmp_path):
    """`--async-scheduling both` keeps two tokenmill engines up in one process: on a GPU each
    takes half the default share (two at 0.9 cannot both start), or `--gpu-memory-utilization`."""
    results = _run("latency", tmp_path, "--input-len", "8", "--output-len", "3", "--num-iters", "1",
                   "--async-scheduling", "both", "--skip-hf")
    assert set(results["engines"]) == {"tokenmill", "tokenmill-async"}
    assert results["config"]["engine_memory"] == {"gpu_memory_utilization": 0.45}
    assert engine_memory(argparse.Namespace(gpu_memory_utilization=None), 1) == {}
    assert engine_memory(argparse.Namespace(gpu_memory_utilization=0.3), 2) == {"gpu_memory_utilization": 0.3}


@pytest.mark.slow
def test_bench_throughput_on_the_demo_model(tmp_path):
    """`tokenmill bench throughput --model <demo>`, as the README shows it, with tiny sizes."""
    results = _run("throughput", tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--skip-hf",
                   model=["--model", str(DEMO_MODEL)])
    assert set(results["engines"]) == {"tokenmill"}
    assert len(results["engines"]["tokenmill"]["seconds_by_round"]) == 2


def test_bench_throughput_compares_parallel_layouts(tmp_path):
    """`--parallel tp1,tp2,pp2`: an engine per layout, with the driver's collective time per step."""
    results = _run("throughput", tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--skip-hf",
                   "--parallel", "tp1,tp2,pp2")
    assert set(results["engines"]) == {"tokenmill", "tokenmill-tp2", "tokenmill-pp2"}
    for name in ("tokenmill-tp2", "tokenmill-pp2"):
        rounds = results["engines"][name]["collectives_by_round"]
        assert len(rounds) == 2 and all(r["steps"] >= 4 and r["ms_per_step"] > 0 for r in rounds)
        assert results[f"ratio_{name}_vs_tokenmill"] > 0
    # tiny preset: per step, one all-reduce for the embedding and two per layer (2 layers), one argmax gather
    assert results["engines"]["tokenmill-tp2"]["collectives_by_round"][0]["calls_per_step"] == 6


@pytest.mark.slow
def test_bench_serve_launches_tokenmill_and_reports_latencies(tmp_path):
    """Two rounds, a server started for each: each round's figures kept, the engine's figures
    their medians, the requests summed; two API servers in front of an engine process beside it,
    and the ratio; the load from two processes, whose busy share each pass reports.
    16 tokens a request: a server behind on a stream sends several tokens as one chunk, and on
    a busy machine 4 tokens could all come in one, leaving no inter-token latency to report."""
    results = _run("serve", tmp_path, "--launch", "tokenmill,tokenmill-api-servers", "--num-prompts", "4",
                   "--random-input-len", "8", "--random-output-len", "16", "--max-concurrency", "2", "--rounds", "2",
                   "--client-processes", "2")
    own = results["engines"]["tokenmill-api-servers"]
    assert own["completed"] == 8 and own["failed"] == 0
    assert results["ratio_tokenmill_api_servers_vs_tokenmill_by_round"] == pytest.approx(
        [r["output_throughput"] / t["output_throughput"] for r, t in zip(own["rounds"],
                                                                         results["engines"]["tokenmill"]["rounds"])],
        rel=1e-2)
    served = results["engines"]["tokenmill"]
    rounds = served["rounds"]
    assert [(r["completed"], r["failed"]) for r in rounds] == [(4, 0), (4, 0)]
    assert served["completed"] == 8 and served["failed"] == 0
    assert all(0 < r["client_busy"] < 1 for r in rounds)
    assert results["config"]["kv_cache_memory_bytes"] > 0  # launched servers share one KV size on a CPU
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for figures in (served[metric], *(r[metric] for r in rounds)):
            assert 0 < figures["median_ms"] <= figures["p99_ms"]
        assert served[metric]["median_ms"] == pytest.approx(statistics.median(r[metric]["median_ms"] for r in rounds),
                                                            abs=1e-3)
    assert served["output_throughput"] == pytest.approx(statistics.median(r["output_throughput"] for r in rounds),
                                                        abs=1e-3)


@pytest.mark.slow
def test_speculative_benchmark_reports_each_proposer_against_none(tmp_path):
    """benchmarks/speculative.py as the README shows it, tiny sizes: every proposer's ratios are
    against the engine without speculation, and acceptances by position never grow."""
    out = tmp_path / "speculative.json"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "speculative.py"),
                    "--rounds", "2", "--num-prompts", "4", "--batch1-prompts", "2", "--max-tokens", "12",
                    "--preset", "tiny", "--cache-dir", str(tmp_path), "--json", str(out)], check=True, timeout=600)
    results = json.loads(out.read_text())
    for workload in ("continue", "repeat"):
        for label in ("batch1", "saturation"):
            base = results["results"][f"{workload}/{label}/none"]
            assert base["acceptance_rate"] is None and base["draft_tokens"] == 0
            for name in ("ngram", "draft_model"):
                r = results["results"][f"{workload}/{label}/{name}"]
                assert len(r["rounds"]) == 2
                # each round's pair (the host drifts between rounds), then their median
                by_round = [b["tpot_ms"] / e["tpot_ms"] for b, e in zip(base["rounds"], r["rounds"])]
                assert r["tpot_speedup_by_round"] == pytest.approx(by_round)
                assert r["tpot_speedup"] == pytest.approx(statistics.median(by_round))
                assert r["throughput_ratio"] == pytest.approx(statistics.median(
                    e["output_tok_s"] / b["output_tok_s"] for b, e in zip(base["rounds"], r["rounds"])))
                positions = r["accepted_per_position"]
                assert all(a >= b for a, b in zip(positions, positions[1:]))
                assert sum(positions) == pytest.approx(r["acceptance_rate"] * r["draft_tokens"])
    ceiling = results["ceiling"]
    rounds = ceiling["rounds"]
    assert ceiling["speedup"] == pytest.approx(statistics.median(
        b["tpot_ms"] / o["tpot_ms"] for b, o in zip(rounds["none"], rounds["oracle"])))


def test_gpu_attention_benchmark_checks_each_case_against_sdpa_before_timing(tmp_path):
    """benchmarks/gpu_attention.py's dry run (the Triton interpreter, small shapes): the paged
    cache, metadata and SDPA inputs it builds describe the same attention (bf16 agreement), for
    the Triton backend and for flex beside it."""
    import os

    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "gpu_attention.py"),
                    "--device", "cpu", "--small", "--flex", "--json", str(out)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"].split()[0] for row in rows] == ["decode", "prefill"]
    assert all(row["rel_error"] < 1e-2 for row in rows)  # bf16 rounding; a mis-built case is off by ~1
    assert all(row.get("flex_rel_error", 1) < 1e-2 for row in rows), rows
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "gpu_attention.py"),
                    "--device", "cpu", "--small", "--sweep", "--json", str(out)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    rows = json.loads(out.read_text())["rows"]
    assert {row["case"].split()[0] for row in rows} == {"decode", "prefill"}
    assert all(row["rel_error"] < 1e-2 for row in rows)  # every tile choice computes the default's result


def test_gpu_profile_benchmark_reports_each_workload(model_dir):
    """benchmarks/gpu_profile.py on the CPU (no CUDA activity): a block per workload with the
    wall per output token and the host ops."""
    result = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "gpu_profile.py"),
                             "--model", str(model_dir("llama")), "--device", "cpu", "--top", "3"],
                            capture_output=True, text=True, check=True, timeout=600)
    blocks = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    assert blocks == ["== batch 1: 1 x (256 -> 64), prompts included",
                      "== batch 256: 256 x (256 -> 16), prompts included"]
    assert result.stdout.count("ms per output token") == 2 and result.stdout.count("host op") == 2
