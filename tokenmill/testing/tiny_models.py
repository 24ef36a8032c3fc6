"""Deterministic tiny random-weight Hugging Face model directories, made locally.

``make_tiny_model("llama", path)`` writes config.json, model.safetensors,
generation_config.json and a byte-level BPE tokenizer trained on a fixed
corpus, exactly as ``save_pretrained`` would for a real checkpoint. Nothing
is downloaded. The same arguments always give the same bytes of weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          PreTrainedTokenizerFast)

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

#: architecture key -> config overrides; every supported family has at least one.
#: "_drop" lists base fields the family's config does not have.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    # Yi / DeepSeek-dense quirks: MQA, biases, head_dim != hidden / heads, other rope scalings
    "llama-mqa-bias": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=1,
                           attention_bias=True, head_dim=32, tie_word_embeddings=True),
    "llama-linear": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                         rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama-dynamic": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                          rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    "llama-yarn": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "mixtral-mqa-tied": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=3,
                             num_experts_per_tok=1, num_key_value_heads=1, tie_word_embeddings=True,
                             sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen2-tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
    "qwen3-mqa-tied": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16,
                           num_key_value_heads=1, tie_word_embeddings=True,
                           rope_scaling=dict(rope_type="linear", factor=2.0)),
    "qwen3-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"]),
    "phi3-partial-rotary": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5,
                                num_key_value_heads=4),
    "phi3-longrope": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], original_max_position_embeddings=256,
                          rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / 16 for i in range(8)],
                                            long_factor=[2.0 + i / 8 for i in range(8)],
                                            original_max_position_embeddings=256)),
    "gemma": dict(model_type="gemma", architectures=["GemmaForCausalLM"], head_dim=16,
                  hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma-mqa": dict(model_type="gemma", architectures=["GemmaForCausalLM"], head_dim=32, num_key_value_heads=1,
                      hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=16, sliding_window=16,
                   query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=4,
                 n_positions=512, activation_function="gelu_new", tie_word_embeddings=True,
                 _drop=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")),
    "gpt2-untied": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=4,
                        n_positions=512, activation_function="gelu_new", tie_word_embeddings=False,
                        _drop=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")),
    "gpt2-scaled": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=3, n_head=2,
                        n_positions=512, n_inner=96, scale_attn_by_inverse_layer_idx=True,
                        tie_word_embeddings=True,
                        _drop=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")),
    # an encoder for embeddings, with sentence-transformers' mean pooling + normalization
    "bert": dict(model_type="bert", architectures=["BertModel"], hidden_act="gelu", layer_norm_eps=1e-12,
                 type_vocab_size=2, initializer_range=0.05,
                 _drop=("rms_norm_eps", "num_key_value_heads", "tie_word_embeddings")),
    # sequence classifiers (three labels), for LLM.classify and the pooling routes
    "bert-cls": dict(model_type="bert", architectures=["BertForSequenceClassification"], hidden_act="gelu",
                     layer_norm_eps=1e-12, type_vocab_size=2, initializer_range=0.05,
                     id2label={0: "negative", 1: "neutral", 2: "positive"},
                     _drop=("rms_norm_eps", "num_key_value_heads", "tie_word_embeddings")),
    "qwen2-cls": dict(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"],
                      id2label={0: "negative", 1: "neutral", 2: "positive"}),
}

_ENCODERS = {"bert", "bert-cls"}
_CLASSIFIERS = {"bert-cls", "qwen2-cls"}
_SENTENCE_TRANSFORMERS_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


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


def make_tiny_model(arch: str, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", **overrides: Any) -> Path:
    """Write a random-weight model of family ``arch`` (see ARCHITECTURES) to ``path``.

    Weights are drawn in fp32 (the same values whatever ``dtype``) and saved in ``dtype``,
    which config.json then records, so ``dtype="auto"`` loads them as such. ``device="cuda"``
    draws them on a GPU (other values than the CPU's draws): an 8B model's initialisation
    takes seconds there and minutes on a CPU.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    spec = dict(ARCHITECTURES[arch])
    base = {k: v for k, v in _BASE.items() if k not in spec.pop("_drop", ())}
    fields = {**base, **spec, "vocab_size": len(tokenizer), **overrides}
    if fields["vocab_size"] > len(tokenizer):
        # a larger vocabulary (benchmark shapes): give every extra id a text of its own,
        # so generated ids decode to visible text and decoded prompts re-encode exactly
        tokenizer.add_tokens([f"<|t{i}|>" for i in range(len(tokenizer), fields["vocab_size"])])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    auto = (AutoModelForSequenceClassification if arch in _CLASSIFIERS else AutoModel if arch in _ENCODERS
            else AutoModelForCausalLM)
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]), torch.device(device):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    model.to(dtype)
    if arch == "bert":
        _write_sentence_transformers_config(path, config.hidden_size)
    elif arch not in _CLASSIFIERS:
        model.generation_config.eos_token_id = EOS_ID
        model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _write_sentence_transformers_config(path: Path, hidden: int) -> None:
    (path / "modules.json").write_text(json.dumps(_SENTENCE_TRANSFORMERS_MODULES, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
