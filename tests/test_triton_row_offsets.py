"""The Triton GEMMs of quantized layers and LoRA address rows past 2**31 elements.

A row offset is a row index times a row stride. Triton passes integer arguments that fit 32
bits as int32, so ``row * stride`` wrapped once a tensor's rows pass 2**31 elements: a
GPTQ/AWQ gate_up of Llama-3-70B (N = 57344) at 37k tokens, or the memory profile's pass at
``--max-num-batched-tokens 65536``, read and wrote stray memory (an illegal address on a GPU).
Here a 17-row input whose rows sit 2**27 elements apart puts its last row at 2**31; its pages
are never touched beyond the first 128 columns, so the reservation costs no memory. Each case
runs in a child process under the interpreter (a wrapped offset there is a segfault) and
compares the strided input's result with a contiguous copy's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRELUDE = """
import torch
torch.manual_seed(0)
ROWS, STRIDE, K, N = 17, 2**27, 128, 64

def strided(columns):
    # rows 2**27 elements apart: row 16 starts at element 2**31
    values = torch.empty(ROWS, STRIDE, dtype=torch.bfloat16)[:, :columns]
    values.copy_(torch.randn(ROWS, columns))
    return values

def same(got, want):
    assert torch.equal(got.float(), want.float()), (got.float() - want.float()).abs().max()
"""

CASES = {
    "block_fp8_gemm": """
from tokenmill.plugins.quantization.triton_block_fp8 import block_fp8_gemm
a = strided(K)
w = (torch.randn(N, K) * 0.1).to(torch.float8_e4m3fn)
args = (w, torch.ones(1, 1), torch.zeros(N, dtype=torch.int32), 128)
same(block_fp8_gemm(a, *args), block_fp8_gemm(a.contiguous(), *args))
""",
    "dequant_gemm": """
from tokenmill.plugins.quantization.triton_gemm import dequant_gemm
a = strided(K)
qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32)
args = (qweight, torch.full((1, N), 8, dtype=torch.int32), torch.rand(1, N, dtype=torch.bfloat16) / 64,
        torch.zeros(K, dtype=torch.int32), 4)
same(dequant_gemm(a, *args), dequant_gemm(a.contiguous(), *args))
""",
    "bgmv": """
from tokenmill.plugins.adapters.triton_lora import bgmv
x, weights = strided(K), torch.randn(2, N, K, dtype=torch.bfloat16)
slots = torch.tensor([i % 3 - 1 for i in range(ROWS)])  # -1 (no adapter), 0 and 1
y = strided(N)
want = y.contiguous()
bgmv(x, weights, slots, y, accumulate=True)
bgmv(x.contiguous(), weights, slots, want, accumulate=True)
same(y, want)
""",
}


@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 12 * 2**30,
                    reason="Linux refuses a 4.5 GiB reservation past RAM + swap (a few MB are touched)")
@pytest.mark.parametrize("kernel", sorted(CASES))
def test_rows_past_int32_elements_are_addressed_in_64_bits(kernel):
    done = subprocess.run([sys.executable, "-c", PRELUDE + CASES[kernel]], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-3000:]}"
