"""The Triton cache a CPU machine fills for the GPU (tokenmill.testing.triton_cache) is the one
a GPU process looks up: what the stand-in engine compiles, a recorded specialization compiles
again to the very same cache entries, and a process of another Triton build finds none of them.

Each case runs in a child process without ``TRITON_INTERPRET=1`` (the suite's setting, under
which Triton's kernels are the interpreter's for the whole process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from tokenmill.testing import triton_cache as tc
    cache, records, key, what = Path(sys.argv[1]), sys.argv[2], sys.argv[3] or None, sys.argv[4]
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    with tc.compile_only(90, key):
        if what == "engine":
            tc.record(records)
            for label, seconds in tc.dry_run([("llama", "llama", {"dtype": "bfloat16", "max_num_seqs": 4})],
                                             cache.parent / "models"):
                print(label, seconds)
        else:
            done, failures = tc.preload(records)
            assert not failures, failures
            print("preloaded", done)
""")


def run(cache: Path, records: Path, what: str, key: str = "") -> set[str]:
    """The cache's entries after a child process ran ``what`` (the engine, or the records preloaded)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    subprocess.run([sys.executable, "-c", SCRIPT, str(cache), str(records), key, what], env=env, check=True,
                   timeout=600, capture_output=True)
    return set(os.listdir(cache))


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> tuple[Path, Path, set[str]]:
    root = tmp_path_factory.mktemp("triton-cache")
    cache, records = root / "engine", root / "records.jsonl"
    return cache, records, run(cache, records, "engine", key="the-gpu-key")


def test_the_stand_in_engine_compiles_its_kernels_for_sm90(engine_run):
    cache, records, entries = engine_run
    kernels = {file.name.split(".")[0] for entry in entries for file in (cache / entry).glob("*.cubin")}
    assert {"_rms_norm_kernel", "_rotary_kernel", "_write_kv_kernel", "_prefill_attention_kernel",
            "_paged_attention_kernel", "_act_and_mul_kernel"} <= kernels
    targets = {json.dumps(json.loads(file.read_text())["target"]) for entry in entries
               for file in (cache / entry).glob("*.json") if not file.name.startswith("__grp__")}
    assert targets == {json.dumps({"backend": "cuda", "arch": 90, "warp_size": 32})}
    assert len(set(records.read_text().splitlines())) == len(entries)


def test_recorded_specializations_compile_to_the_same_entries(engine_run, tmp_path):
    """What a GPU records (its libdevice at its own path), compiled here, is filed where that GPU's
    Triton looks."""
    _, records, entries = engine_run
    site = str(Path(triton.__file__).parents[1])
    assert site in records.read_text()
    gpu_records = tmp_path / "gpu.jsonl"
    gpu_records.write_text(records.read_text().replace(site, "/opt/torch/.venv/lib/python3.12/site-packages"))
    assert run(tmp_path / "again", gpu_records, "preload", key="the-gpu-key") == entries


def test_another_triton_build_finds_none_of_them(engine_run, tmp_path):
    """The mutation: the CPU's own triton_key instead of the GPU's (what a cp311 build gives a
    cp312 GPU image) files every kernel elsewhere; a cache that would miss on the GPU fails here."""
    _, records, entries = engine_run
    assert not run(tmp_path / "other", records, "preload", key="") & entries
