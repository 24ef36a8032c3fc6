"""The ``tokenmill`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from server_harness import serve_process, wait_until_healthy


def tokenmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_plugins_json_lists_distributions_and_registrations():
    """`tokenmill plugins --json` reports each plugin's distribution, version and registrations."""
    result = tokenmill("plugins", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert data["hookspec_version"] >= 1
    assert plugins["fifo"]["distribution"] == "tokenmill"
    assert plugins["shortest_prompt"]["registers"] == {"scheduling_policies": ["shortest-prompt"]}
    assert "LlamaForCausalLM" in plugins["llama"]["registers"]["model_architectures"]


def test_a_reader_that_stops_early_gets_no_traceback():
    """`tokenmill plugins | head -1`: the pipe closes before the table is written."""
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "plugins"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # before the command has imported anything, let alone printed
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 1
    assert stderr == ""


def test_make_model_then_generate_from_yaml(tmp_path):
    """make-model writes a loadable model; generate --config runs it with flags overriding YAML."""
    model = tmp_path / "model"
    made = tokenmill("make-model", "--arch", "qwen2", str(model))
    assert made.returncode == 0, made.stderr
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "scheduler": {"max_num_seqs": 2},
                                      "cache": {"kv_cache_memory": "8MiB"}}))
    result = tokenmill("generate", "--config", str(config), "--prompt", "The quick", "--prompt", "brown fox",
                       "--max-tokens", "5", "--block-size", "8", "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["The quick", "brown fox"]
    assert all(len(line["token_ids"]) <= 5 for line in lines)


def test_config_errors_exit_2_with_a_message(tmp_path):
    """A bad config is a one-line error and exit code 2, not a traceback."""
    config = tmp_path / "engine.yaml"
    config.write_text("scheduler: {bogus: 1}\n")
    result = tokenmill("generate", "--config", str(config), "--prompt", "x")
    assert result.returncode == 2
    assert "scheduler.bogus" in result.stderr and "Traceback" not in result.stderr


def test_serve_runs_the_demo_model_with_vllm_flags(tmp_path):
    """`tokenmill serve` with no model serves the shipped demo model on 127.0.0.1, and says
    what it is doing before importing torch."""
    import os

    import httpx

    from server_harness import free_port

    port = free_port()
    env = dict(os.environ)
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--max-num-seqs", "4",
         "--served-model-name", "demo", "--kv-cache-memory-bytes", "16MiB", "--log-format", "json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, process=process)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "demo", "prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert lines[0]["event"].startswith("starting") and lines[0]["model"].endswith("demo-llama")
    request_lines = [json.loads(line) for line in stderr.splitlines() if '"request finished"' in line]
    assert request_lines and request_lines[0]["generation_tokens"] == 3


def test_compare_reports_identical_greedy_outputs_across_backends(tmp_path, model_dir):
    """`tokenmill compare --attention-backend torch,cpu,triton` agrees exactly and writes its table as JSON;
    the model given as vLLM's ``--model``."""
    import os

    out = tmp_path / "compare.json"
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "compare", "--model", str(model_dir("llama")), "--attention-backend",
         "torch,cpu,triton", "--num-prompts", "3", "--input-len", "10", "--output-len", "6",
         "--kv-cache-memory-bytes", "16MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == [f"attention_backend={b}" for b in ("torch", "cpu", "triton")]
    for row in rows:
        assert row["agreement"]["exact"] == 3 and row["agreement"]["first_divergence"] is None
        assert row["agreement"]["max_logprob_diff"] < 1e-4
        assert row["tokens_per_s"] > 0 and row["peak_rss_mib"] > row["runtime_mib"] > 0
        # the tiny Llama's fp32 checkpoint, and the 16 MiB cache asked for (whole blocks of it)
        assert row["weights_mib"] == sum(f.stat().st_size for f in model_dir("llama").glob("*.safetensors")) / 2**20
        assert 15 < row["kv_mib"] <= 16
    assert "attention_backend=triton" in result.stdout


def test_triton_without_a_gpu_fails_at_startup_with_the_reason(model_dir):
    """Selecting the Triton backend on a CPU machine, without asking for the interpreter, is refused."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", str(model_dir("llama")),
                             "--attention-backend", "triton", "--prompt", "hi"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2
    assert "needs a cuda device" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


def test_server_flags_reach_the_server_section():
    """vLLM's network flags, including --allowed-origins in vLLM's JSON-list form."""
    from tokenmill.cli.command import _parser
    from tokenmill.cli.flags import resolve_config

    args = _parser().parse_args(["serve", "m", "--allowed-origins", '["https://a.example", "https://b.example"]',
                                 "--allowed-methods", "GET", "POST", "--ssl-cert-reqs", "2", "--root-path", "/llm",
                                 "--enable-request-id-headers", "--disable-fastapi-docs"])
    server = resolve_config(args).server
    assert server.allowed_origins == ["https://a.example", "https://b.example"]
    assert server.allowed_methods == ["GET", "POST"] and server.ssl_cert_reqs == 2
    assert server.root_path == "/llm" and server.enable_request_id_headers and server.disable_fastapi_docs
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "m", "--allowed-origins", "[not json"])


def test_compilation_config_takes_vllms_custom_ops_and_names_what_it_does_not_read(model_dir):
    """vLLM's JSON flag: custom_ops reaches the config (its effect: tests/test_fast_paths.py), and
    the capture-size flags (tests/test_decode_graphs.py);
    a torch.compile key is a one-line error naming it, before the model loads."""
    from tokenmill.cli.command import _parser
    from tokenmill.cli.flags import resolve_config

    args = _parser().parse_args(["serve", "m", "--compilation-config", '{"custom_ops": ["none", "+rms_norm"]}',
                                 "--enforce-eager"])
    config = resolve_config(args)
    assert config.compilation_config.custom_ops == ["none", "+rms_norm"] and config.enforce_eager
    args = _parser().parse_args(["serve", "m", "--cudagraph-capture-sizes", "1", "2", "8",
                                 "--max-cudagraph-capture-size", "8"])
    assert resolve_config(args).compilation_config.capture_sizes(256) == [1, 2, 8]  # the buckets, in vLLM's flags
    result = tokenmill("generate", "--model", str(model_dir("llama")), "--prompt", "x",
                       "--compilation-config", '{"level": 3, "custom_ops": ["-rms_norm"]}')
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "compilation_config" in result.stderr and "level: not read" in result.stderr


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_serve_with_tensor_parallelism_answers_the_openai_client_and_stops_its_workers(model_dir, mode):
    """`tokenmill serve MODEL -tp 2`: a worker process per extra rank (the engine core's, with
    --engine-process), all gone after SIGTERM."""
    import os

    import openai

    from server_harness import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir("llama")), "-tp", "2", "--port", str(port),
         "--served-model-name", "tiny", "--kv-cache-memory-bytes", "16MiB", *mode],
        env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, process=process)
        workers = _children(process.pid)
        if mode:
            assert len(workers) == 1  # the engine core, the driver of the ranks
            workers += _children(workers[0])
        assert len(workers) == 1 + len(mode)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode in (0, -15), stderr[-2000:]  # uvicorn re-raises the SIGTERM it handled
    assert "Application shutdown complete" in stderr
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)


def test_serve_with_a_draft_model_reports_acceptance(tmp_path):
    """`--speculative-config` takes vLLM's JSON; the openai client gets the replies, /metrics
    counts drafts and acceptances by position, and each request's log line its acceptances."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    import httpx

    from server_harness import free_port
    from tokenmill.demo_models import DEMO_DRAFT_MODEL

    port = free_port()
    spec = json.dumps({"model": str(DEMO_DRAFT_MODEL), "num_speculative_tokens": 3})
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--served-model-name", "demo",
         "--kv-cache-memory-bytes", "32MiB", "--log-format", "json", "--speculative-config", spec],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, process=process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="demo", prompt="The with statement is used to wrap the execution of",
                                          max_tokens=24, temperature=0)
        assert reply.choices[0].text
        metrics = {sample.name + str(sample.labels.get("position", "")): sample.value
                   for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
                   for sample in family.samples}
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert metrics["tokenmill:spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["tokenmill:spec_decode_num_accepted_tokens_total"] \
        <= metrics["tokenmill:spec_decode_num_draft_tokens_total"]
    assert metrics["tokenmill:spec_decode_num_accepted_tokens_per_pos_total0"] > 0
    [finished] = [json.loads(line) for line in stderr.splitlines() if '"request finished"' in line]
    assert 0 < finished["spec_accepted_tokens"] <= finished["spec_draft_tokens"]


def test_a_server_that_exits_while_starting_fails_its_test_at_once(model_dir):
    """The harness sees the process end (here: a KV budget under one block) and raises with
    its reason; it polled /health until its timeout instead, and a GPU test that waited on a
    dead server ran to its 150 s limit."""
    with pytest.raises(RuntimeError, match="exited with status 2") as failure:
        with serve_process(str(model_dir("llama")), "--kv-cache-memory-bytes", "4KiB", timeout=600):
            pass
    assert "cache.kv_cache_memory" in str(failure.value)
