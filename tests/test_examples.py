"""The examples run as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from server_harness import free_port

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_the_vllm_style_weight_transfer_script_needs_only_its_imports_changed(model_dir):
    """examples/weight_transfer_gloo.py is vLLM 0.32's API: no line but the imports names
    tokenmill, and after the trainer's push the engine answers as transformers does with
    the trainer's new weights."""
    script = EXAMPLES / "weight_transfer_gloo.py"
    code = script.read_text().split('"""', 2)[2]
    imports_done = False
    for line in code.splitlines():
        if line.startswith("def "):
            imports_done = True
        if imports_done:
            assert "tokenmill" not in line, line
    path = model_dir("llama")
    result = subprocess.run([sys.executable, str(script), str(path), str(free_port())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    for prompt, got in zip([list(range(5, 17)), list(range(40, 47))], outputs["after"]):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(prompt):]
    assert outputs["after"] != outputs["before"]
