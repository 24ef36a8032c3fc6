"""Freed activation buffers stay in the process: after an engine is built, a large block
freed and asked for again costs no page faults; with ``keep_freed_memory: false`` (and
glibc's own thresholds) every such block is faulted in again.

Each case runs in its own interpreter: malloc's thresholds are process-wide."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")

#: builds an engine, then allocates and frees a 48 MB tensor (over glibc's largest
#: dynamic mmap threshold, 32 MB) a few times and reports each round's minor faults
_PROBE = """
import json, resource, sys
import torch
from tokenmill import LLM
llm = LLM(sys.argv[1], kv_cache_memory_bytes=32 * 2**20, keep_freed_memory=sys.argv[2] == "on")
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(48 << 20, dtype=torch.uint8)
    block.fill_(1)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults_per_round(model: Path, setting: str) -> list[int]:
    result = subprocess.run([sys.executable, "-c", _PROBE, str(model), setting], capture_output=True,
                            text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_engine_keeps_freed_blocks_for_reuse(model_dir):
    pages = (48 << 20) // 4096

    def reused(kept: list[int]) -> bool:
        # a round may still grow the heap (an aligned request needs a little more than the
        # block freed, and small allocations can land in the freed space), but most reuse it
        return sum(count == 0 for count in kept) >= len(kept) // 2 and sum(kept) <= 4 * pages

    # A fresh process's heap layout varies from run to run (address randomisation), and in
    # some layouts seen in full-suite runs every round grew the heap: the claim is judged on
    # the best of three processes, while "off" below must return the block every time.
    attempts = []
    for _ in range(3):
        attempts.append(_faults_per_round(model_dir("llama"), "on"))
        if reused(attempts[-1]):
            break
    assert reused(attempts[-1]), attempts
    returned = _faults_per_round(model_dir("llama"), "off")
    assert all(count >= pages // 2 for count in returned), returned
