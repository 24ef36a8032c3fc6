"""The layers models are built from: tokenmill's public, documented model-facing API.

A model written outside tokenmill (a plugin registering an architecture) builds with these,
as vLLM's out-of-tree models build with ``vllm.attention.Attention``:

- ``Attention``: **required** for every attention layer. The engine allocates and binds each
  layer's paged KV cache to the ``Attention`` modules it finds (worker/kv_cache.py), and the
  configured attention backend does the work; a model with its own attention module gets no
  cache.
- ``Linear``: weights that quantization methods (GPTQ, AWQ, FP8), adapters (LoRA) and the
  platform's prepacking understand; q/k/v or gate/up fused along outputs, loaded shard by shard.
- ``RMSNorm``, ``GatedActivation``, ``ApplyRotary`` (with ``RotaryEmbedding`` for the step's
  cos/sin): ``CustomOp``s, which a platform may replace with fused kernels; write your own
  op by subclassing ``CustomOp``.
- ``FusableDecoder`` / ``DecoderLayerParts``: describe standard pre-norm decoder layers, and a
  platform may run the whole stack as one call at decode batch sizes.
- ``FusedMoE``: a mixture-of-experts MLP (softmax top-k routing, experts grouped per matmul).
- ``load_weights``: checkpoint tensors into parameters by name, with fused shards and strict
  checking (tokenmill.core.model_loader.weights).
- Tensor and pipeline parallelism (``ModelContext.parallel``): give each ``Linear`` its
  ``shard`` (``column_shard``, ``qkv_shard``, ``row_shard``, ``vocab_shard``), embed with
  ``VocabParallelEmbedding``, and build only ``parallel.layer_range(n)``, standing in
  ``MissingLayer`` for the rest (``stage_skips`` names the tensors to skip). With
  ``SINGLE`` every one of these is the plain, unsharded layer.

``tokenmill.testing.model_conformance.check_model`` tests a model built from these against
Hugging Face transformers on the same weights.
"""

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.core.layers.fused_decoder import DecoderLayerParts, FusableDecoder, FusedDecoder
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.linear_shard import LinearShard, column_shard, qkv_shard, row_shard, vocab_shard
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.core.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.core.layers.pipeline import MissingLayer, stage_skips
from tokenmill.core.layers.rotary import ApplyRotary, RotaryEmbedding, rotary_dim
from tokenmill.core.layers.vocab_parallel import VocabParallelEmbedding
from tokenmill.core.model_loader.weights import load_weights

__all__ = [
    "ApplyRotary", "Attention", "CustomOp", "DecoderLayerParts", "FusableDecoder", "FusedDecoder", "FusedMoE",
    "GatedActivation", "GemmaRMSNorm", "Linear", "LinearShard", "MissingLayer", "RMSNorm", "RotaryEmbedding",
    "VocabParallelEmbedding", "column_shard", "load_weights", "qkv_shard", "rotary_dim", "row_shard", "stage_skips",
    "vocab_shard",
]
