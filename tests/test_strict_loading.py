"""Checkpoints load strictly: every tensor is taken and every parameter filled, or the load
fails naming the offenders; ``tie_word_embeddings`` is honoured both ways by every family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import make_llm
from tokenmill.interfaces.errors import ConfigError
from tokenmill.testing.logits import prompt_logits
from tokenmill.testing.tiny_models import make_tiny_model

PROMPT = list(range(6, 40))

#: one tiny model per family that generates text
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2"]


def edited_copy(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the model directory ``source`` whose checkpoint tensors ``edit`` changed."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        make_llm(path)
    return str(info.value)


def test_an_extra_and_a_missing_tensor_are_both_named(model_dir, tmp_path):
    """A checkpoint with a tensor no parameter takes and a parameter no tensor fills fails
    naming both (the loader used to stop at the first unexpected tensor)."""

    def edit(tensors):
        del tensors["model.layers.1.mlp.down_proj.weight"]
        tensors["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    message = load_error(edited_copy(model_dir("llama"), tmp_path / "edited", edit))
    assert "model.layers.1.mlp.extra_proj.weight" in message
    assert "model.layers.1.mlp.down_proj.weight" in message


def test_a_long_list_of_names_is_cut_short(model_dir, tmp_path):
    """25 unexpected tensors: the first 10 are named, then how many more there are."""

    def edit(tensors):
        for i in range(25):
            tensors[f"extra.{i:02d}.weight"] = torch.zeros(2)

    message = load_error(edited_copy(model_dir("llama"), tmp_path / "edited", edit))
    assert "extra.09.weight" in message and "and 15 more" in message
    assert "extra.10.weight" not in message


def test_a_fused_layer_missing_one_of_its_parts_fails(model_dir, tmp_path):
    """q and v without k used to count qkv_proj as loaded, leaving k's rows uninitialised."""
    edited = edited_copy(model_dir("llama"), tmp_path / "edited",
                         lambda tensors: tensors.pop("model.layers.0.self_attn.k_proj.weight"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_error(edited)


def test_moe_experts_must_all_arrive_and_belong_to_an_moe_layer(model_dir, tmp_path):
    """One expert's gate missing leaves w13 unfilled; expert tensors for a dense layer
    (mlp_only_layers) are unexpected, not a crash."""

    def edit(tensors):
        del tensors["model.layers.0.mlp.experts.2.gate_proj.weight"]
        tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)

    message = load_error(edited_copy(model_dir("qwen3-moe"), tmp_path / "edited", edit))
    assert "model.layers.0.mlp.w13" in message and "model.layers.0.mlp.w2" not in message
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in message


@pytest.mark.parametrize("name,tensor", [
    ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 64)),  # [64, 128] in the model
    ("model.norm.weight", torch.zeros(64, dtype=torch.int32)),
    ("model.embed_tokens.weight", torch.zeros(3, 64)),
])
def test_a_tensor_that_does_not_fit_its_parameter_is_named(name, tensor, model_dir, tmp_path):
    """Another shape (through a fused layer's loader or a plain parameter) or another kind
    of dtype fails naming the tensor."""
    edited = edited_copy(model_dir("llama"), tmp_path / "edited", lambda tensors: tensors.update({name: tensor}))
    assert name in load_error(edited)


def hf_logprobs(path: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def assert_matches_hf(path: Path) -> None:
    got = prompt_logits(make_llm(path).llm_engine, PROMPT).log_softmax(-1)
    assert (got - hf_logprobs(path)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", FAMILIES)
def test_tie_word_embeddings_is_honoured_both_ways(arch, tmp_path):
    """Tied: a checkpoint without lm_head.weight loads and computes HF's logits. Untied: the
    head is its own weight (HF's logits again), and a checkpoint lacking it fails naming it."""
    tied = make_tiny_model(arch, tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")
    assert_matches_hf(tied)

    untied = make_tiny_model(arch, tmp_path / "untied", tie_word_embeddings=False)
    tensors = load_file(untied / "model.safetensors")
    embedding = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    assert not torch.equal(tensors["lm_head.weight"], tensors[embedding])
    assert_matches_hf(untied)
    headless = edited_copy(untied, tmp_path / "headless", lambda tensors: tensors.pop("lm_head.weight"))
    assert "lm_head.weight" in load_error(headless)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_config_without_tie_word_embeddings_follows_the_family_default(arch, model_dir, tmp_path):
    """transformers 4 leaves the key out when it equals the family's default (Gemma's and
    GPT-2's: tied); a tied checkpoint then loads exactly where HF's default ties too."""
    target = edited_copy(model_dir(arch), tmp_path / "no-key", lambda tensors: tensors.pop("lm_head.weight", None))
    config = json.loads((target / "config.json").read_text())
    del config["tie_word_embeddings"]
    (target / "config.json").write_text(json.dumps(config))
    if AutoConfig.from_pretrained(target).tie_word_embeddings:
        make_llm(target)
    else:
        assert "lm_head.weight" in load_error(target)
