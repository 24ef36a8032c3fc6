"""``tokenmill config explain``: each setting's value and where it came from, every problem at once."""

from __future__ import annotations

import subprocess
import sys


def explain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "config", "explain", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def sources(stdout: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in stdout.splitlines():
        key, *middle, source = line.split("  ")
        rows[key.strip()] = ("".join(middle).strip(), source.strip())
    return rows


def test_flag_beats_env_beats_yaml_beats_default(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("model: /models/m\nscheduler:\n  max_num_seqs: 8\n  max_num_batched_tokens: 1024\n"
                      "  policy: fifo\ncache: {block_size: 32}\n")
    result = explain(str(config), "--max-num-seqs", "4", "--port", "9000",
                     env={"TOKENMILL_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "2048"})
    assert result.returncode == 0, result.stderr
    rows = sources(result.stdout)
    assert rows["scheduler.max_num_seqs"] == ("4", "flag")  # over the YAML's 8
    assert rows["scheduler.max_num_batched_tokens"] == ("2048", "env TOKENMILL_SCHEDULER__MAX_NUM_BATCHED_TOKENS")
    assert rows["scheduler.policy"] == ("'fifo'", f"{config}:5")
    assert rows["cache.block_size"] == ("32", f"{config}:6")
    assert rows["server.port"] == ("9000", "flag")
    assert rows["cache.prefix_caching"] == ("True", "default")


def test_every_problem_at_once_with_suggestions(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model: m\nschedular: {max_num_seqs: 2}\ncache: {block_size: 0, prefix_cachng: true}\n")
    result = explain(str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "schedular: unknown key; did you mean scheduler" in result.stderr
    assert "cache.prefix_cachng: unknown key; did you mean cache.prefix_caching?" in result.stderr
    assert "cache.block_size: Input should be greater than or equal to 1" in result.stderr


def test_an_api_key_is_never_printed():
    result = explain("--api-key", "hunter2")
    assert result.returncode == 0 and "hunter2" not in result.stdout
    assert sources(result.stdout)["server.api_key"] == ("'**********'", "flag")


def test_a_json_section_and_flat_flags_inside_it_merge_and_bad_json_is_one_line():
    """vLLM's --compilation-config beside --cudagraph-capture-sizes: both reach the section; a
    TOKENMILL_* variable holding broken JSON, and a validator's complaint, read as plain lines."""
    result = explain("--compilation-config", '{"custom_ops": ["none"]}', "--cudagraph-capture-sizes", "1", "2")
    assert result.returncode == 0, result.stderr
    rows = sources(result.stdout)
    assert rows["compilation_config.custom_ops"] == ("['none']", "flag")
    assert rows["compilation_config.cudagraph_capture_sizes"] == ("[1, 2]", "flag")
    broken = explain(env={"TOKENMILL_COMPILATION_CONFIG": '{"custom_ops": ['})
    assert broken.returncode == 2 and "Traceback" not in broken.stderr and "compilation_config" in broken.stderr
    invalid = explain("--compilation-config", '{"cudagraph_capture_sizes": [1, 4], "max_cudagraph_capture_size": 8}')
    assert invalid.returncode == 2 and "compilation_config: max_cudagraph_capture_size 8 is not" in invalid.stderr
