"""The Triton cache a CPU machine fills for the GPU (tokenmill.testing.triton_cache) is the one
a GPU process looks up: what the stand-in engine compiles, a recorded specialization compiles
again to the very same cache entries, the pruned entries are disk-cache hits, and the key
patch takes effect (under this machine's own key, nothing is found).

Each case runs in a child process without ``TRITON_INTERPRET=1`` (the suite's setting, under
which Triton's kernels are the interpreter's for the whole process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from tokenmill.testing.triton_cache import prune, summary  # noqa: E402

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from tokenmill.testing import triton_cache as tc
    cache, records, key, what, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3] or None, sys.argv[4], sys.argv[5]
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    with tc.compile_only(90, key):
        tc.record(out)
        if what == "engine":
            for label, seconds, error in tc.dry_run([("llama", "llama", {"dtype": "bfloat16", "max_num_seqs": 4})],
                                                    cache.parent / "models"):
                assert error is None, error
        else:
            done, failures = tc.preload(records)
            assert not failures, failures
""")
KERNELS = {"_rms_norm_kernel", "_rotary_kernel", "_write_kv_kernel", "_prefill_attention_kernel",
           "_paged_attention_kernel", "_act_and_mul_kernel"}


def run(cache: Path, what: str, records: Path, out: Path, key: str = "") -> set[str]:
    """The cache's entries after a child process ran ``what`` (the engine, or ``records``
    preloaded) and recorded what it used to ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    child = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), str(records), key, what, str(out)], env=env,
                           timeout=600, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    return set(os.listdir(cache))


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> tuple[Path, Path, set[str]]:
    root = tmp_path_factory.mktemp("triton-cache")
    cache, records = root / "engine", root / "records.jsonl"
    return cache, records, run(cache, "engine", Path(os.devnull), records, key="the-gpu-key")


def test_the_stand_in_engine_compiles_its_kernels_for_sm90(engine_run):
    cache, records, entries = engine_run
    kernels = {file.name.split(".")[0] for entry in entries for file in (cache / entry).glob("*.cubin")}
    assert KERNELS <= kernels
    targets = {json.dumps(json.loads(file.read_text())["target"]) for entry in entries
               for file in (cache / entry).glob("*.json") if not file.name.startswith("__grp__")}
    assert targets == {json.dumps({"backend": "cuda", "arch": 90, "warp_size": 32})}
    specializations = {line for line in records.read_text().splitlines() if '"specialization"' in line}
    assert len(specializations) == len(entries)


def test_recorded_specializations_compile_to_the_same_entries(engine_run, tmp_path):
    """What a GPU records (its libdevice at its own path), compiled here, is filed where that GPU's
    Triton looks."""
    _, records, entries = engine_run
    site = str(Path(triton.__file__).parents[1])
    assert site in records.read_text()
    gpu_records = tmp_path / "gpu.jsonl"
    gpu_records.write_text(records.read_text().replace(site, "/opt/torch/.venv/lib/python3.12/site-packages"))
    assert run(tmp_path / "again", "preload", gpu_records, Path(os.devnull), key="the-gpu-key") == entries


def test_pruned_entries_are_cache_hits_and_the_summary_counts_them(engine_run, tmp_path):
    """What is carried (cubins and metadata only) is what a launch reads: every compile is a hit;
    the first run's compiles were all misses, named by kernel."""
    cache, records, entries = engine_run
    carried = tmp_path / "carried"
    shutil.copytree(cache, carried)
    assert prune(carried)[0] == len(entries)
    assert not list(carried.glob("*/*.ptx")) and not list(carried.glob("*/*.ttir"))
    again = tmp_path / "again.jsonl"
    assert run(carried, "preload", records, again, key="the-gpu-key") == entries
    hits = summary(again, carried)
    assert f"triton compiles: {len(entries)} from the cache, 0 compiled here" in hits[1]
    assert hits[0].startswith(f"triton cache: {len(entries)} kernels carried")
    first = summary(records, carried)
    assert f"triton compiles: 0 from the cache, {len(entries)} compiled here" in first[1]
    assert {line.split()[-1] for line in first[2:]} >= KERNELS


def test_under_another_triton_build_nothing_is_found(engine_run, tmp_path):
    """The mutation: this machine's own triton_key instead of the GPU's (what a Python 3.11 build
    of Triton gives where the GPU runs 3.12's) files every kernel elsewhere, so the key patch
    decides where the entries go; whether the key is the GPU's own, the GPU run's summary says."""
    _, records, entries = engine_run
    assert not run(tmp_path / "other", "preload", records, Path(os.devnull), key="") & entries
