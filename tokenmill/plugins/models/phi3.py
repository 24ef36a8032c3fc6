"""Phi-3: the Llama block with checkpoint-fused qkv_proj and gate_up_proj, and longrope.

The fused tensors load as whole parameters (no stacking needed); ``longrope``
(a.k.a. ``su``) scaling comes from the shared rotary layer.
"""

from __future__ import annotations

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass


@hookimpl
def register_model_architectures(register):
    register("Phi3ForCausalLM", Phi3ForCausalLM)
