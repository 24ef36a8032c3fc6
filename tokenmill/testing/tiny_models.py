"""Deterministic tiny random-weight Hugging Face model directories, made locally.

``make_tiny_model("llama", path)`` writes config.json, model.safetensors,
generation_config.json and a byte-level BPE tokenizer trained on a fixed
corpus, exactly as ``save_pretrained`` would for a real checkpoint. Nothing
is downloaded. The same arguments always give the same bytes of weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tokenmill.testing.corpus import CORPUS

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    initializer_range=0.1, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

#: architecture key -> config overrides; every supported family has at least one
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen2-tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
}


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the fixed corpus, with a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>", chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(arch: str, path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight model of family ``arch`` (see ARCHITECTURES) to ``path``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    fields = {**_BASE, **ARCHITECTURES[arch], "vocab_size": len(tokenizer), **overrides}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class _seeded:
    """Seed torch's global RNG for the block, restoring its state afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        torch.random.set_rng_state(self.state)


MakeModel = Callable[..., Path]
