"""Weights on transparent huge pages: placed where asked, alive as long as their tensors,
and the engine's outputs unchanged (fp32 parity against HF)."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tokenmill.plugins.platforms.cpu.huge_pages as huge_pages
from conftest import PROMPTS, greedy_in_batches, make_llm
from tokenmill.testing.hf_reference import assert_matches_reference

pytestmark = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                                reason="this kernel has transparent huge pages off")


def _advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor`` carries MADV_HUGEPAGE (VmFlags ``hg``)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_huge_page_zeros_is_aligned_advised_and_outlives_its_mapping():
    tensor = huge_pages.huge_page_zeros((3, 1 << 20), torch.float32)
    assert tensor.shape == (3, 1 << 20) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert _advised_huge(tensor) and not _advised_huge(torch.zeros(3, 1 << 20))
    assert not tensor.any()
    gc.collect()  # only the tensor refers to the mapping now
    tensor.fill_(2.5)
    assert tensor.sum().item() == 2.5 * 3 * (1 << 20)


def test_move_keeps_values_and_parameters_and_moves_tied_weights_once(monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.LayerNorm(64))
    model[1].weight = model[0].weight  # tied, as in models with tie_word_embeddings
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = list(model.parameters())
    # the tied [64, 32] fp32 weight is 8 KB; biases and the norm's (256 B) stay put
    assert huge_pages.move_parameters_to_huge_pages(model) == 1
    assert _advised_huge(model[0].weight) and model[1].weight is model[0].weight
    assert not _advised_huge(model[2].weight)
    assert list(model.parameters()) == params  # the same Parameter objects, new storage
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied"])
def test_engine_on_huge_pages_matches_hf(arch, model_dir, hf_reference, monkeypatch):
    """Every weight of the tiny models moved (the threshold lowered to a byte), then
    prepacked and streamed by the GEMV at batch 1-2 and the decode stack."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)
    llm = make_llm(model_dir(arch))
    model = llm.llm_engine.runner.model
    assert all(_advised_huge(p) for p in model.parameters())
    gc.collect()
    for batch in (1, 2, len(PROMPTS)):
        assert_matches_reference(hf_reference(arch), *greedy_in_batches(llm, PROMPTS, batch))


CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import tokenmill.plugins.platforms.cpu.huge_pages as huge_pages
from conftest import make_llm
from test_huge_pages import _advised_huge
huge_pages.MIN_BYTES = 1
model = make_llm(sys.argv[2], huge_pages=sys.argv[3] == "on").llm_engine.runner.model
print(sum(_advised_huge(p) for p in model.parameters()), len(list(model.parameters())))
"""


@pytest.mark.parametrize("setting", ["off", "on"])
def test_huge_pages_off_leaves_weights_in_place(setting, model_dir):
    """With huge_pages off no weight is advised (on: every one, the threshold lowered to a byte).
    In a fresh process: in this one, earlier tests advised heap memory that glibc, keeping freed
    memory, may hand to the next engine's weights."""
    result = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(model_dir("llama")),
                             setting], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    advised, total = map(int, result.stdout.split()[-2:])
    assert total > 0 and advised == (total if setting == "on" else 0)


def test_collapse_in_place_advises_memory_it_does_not_own_and_keeps_its_values():
    """oneDNN's packed weights cannot be copied elsewhere: their own pages are advised (and
    collapsed where the kernel can), values untouched; under one huge page nothing is done."""
    weight = torch.randn(4096, 2048)  # fp32: oneDNN packs bf16 only on AVX-512 or AVX-NE-CONVERT cores
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    start = torch.ops.mkldnn.data_ptr(packed)
    huge_pages.collapse_in_place(start, nbytes)
    inner = -(-start // huge_pages.HUGE_PAGE_BYTES) * huge_pages.HUGE_PAGE_BYTES  # the first whole huge page
    assert _advised_huge(_AtAddress(inner))
    assert torch.equal(packed.to_dense(), weight)
    assert not huge_pages.collapse_in_place(start, huge_pages.HUGE_PAGE_BYTES // 2)


class _AtAddress:
    """What ``_advised_huge`` reads of a tensor: its address."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address
