"""Which of the platform's kernels a model runs: vLLM's ``compilation_config``, the part of it
with a meaning here.

tokenmill compiles nothing with torch.compile; its platforms bring kernels instead: the
``CustomOp`` layers' fused implementations (``rms_norm``, ``silu_and_mul``,
``rotary_embedding``, ``fused_moe``, ... by vLLM's op names), and their other fast paths
(prepacked GEMM weights, fused decode stacks, the greedy argmax head). ``custom_ops`` picks
among them in vLLM's grammar, so a ``--compilation-config '{"custom_ops": ["none"]}'`` that
asks vLLM for plain PyTorch ops asks tokenmill for the same: the reference every kernel is
tested against. CUDA graphs are ``enforce_eager``'s, as in vLLM.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator, model_validator

from tokenmill.core.config.strict import STRICT


class CompilationConfig(BaseModel):
    model_config = STRICT

    #: "all" (the default) or "none" sets whether the platform's kernels run; "+op" / "-op"
    #: then turns one CustomOp on or off by name ("-rms_norm"). "none" also turns off the fast
    #: paths that are not CustomOps (prepacked GEMMs, fused decode stacks, the greedy head):
    #: plain PyTorch everywhere
    custom_ops: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _only_custom_ops(cls, value: Any) -> Any:
        """vLLM's other keys configure torch.compile and graph capture, which tokenmill does its own
        way: named in the error rather than pydantic's 'extra inputs are not permitted'."""
        if isinstance(value, int) and not isinstance(value, bool):  # vLLM's `--compilation-config 3`
            raise ValueError(f"level {value}: a level configures torch.compile, which tokenmill does not use "
                             "(it reads {\"custom_ops\": [...]})")
        if isinstance(value, dict):
            others = sorted(set(value) - {"custom_ops"})
            if others:
                raise ValueError(f"{', '.join(others)}: not read, as tokenmill does not use torch.compile "
                                 "(custom_ops is the key it reads); CUDA graphs are recorded per batch-size "
                                 "bucket up to max_num_seqs, and enforce_eager turns them off")
        return value

    @field_validator("custom_ops")
    @classmethod
    def _grammar(cls, ops: list[str]) -> list[str]:
        for op in ops:
            if op not in ("all", "none") and (op[:1] not in ("+", "-") or not op[1:].isidentifier()):
                raise ValueError(f"{op!r}: each entry is 'all', 'none', '+op' or '-op' (an op name: rms_norm, ...)")
        if "all" in ops and "none" in ops:
            raise ValueError("'all' and 'none' together: name one")
        named = [op[1:] for op in ops if op[0] in "+-"]
        if len(named) != len(set(named)):
            raise ValueError("an op is named twice")
        return ops

    def named_ops(self) -> set[str]:
        """The ops "+op" and "-op" name."""
        return {op[1:] for op in self.custom_ops if op[0] in "+-"}

    @property
    def platform_kernels(self) -> bool:
        """Whether the platform's kernels run unless named off ("none" is absent)."""
        return "none" not in self.custom_ops

    def op_enabled(self, name: str) -> bool:
        """Whether the CustomOp ``name`` takes the platform's implementation."""
        if f"+{name}" in self.custom_ops:
            return True
        return self.platform_kernels and f"-{name}" not in self.custom_ops
