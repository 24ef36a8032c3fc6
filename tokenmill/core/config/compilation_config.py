"""Which of the platform's kernels a model runs and which decode batch sizes are recorded as
CUDA graphs: vLLM's ``compilation_config``, the part of it with a meaning here.

tokenmill compiles nothing with torch.compile; its platforms bring kernels instead: the
``CustomOp`` layers' fused implementations (``rms_norm``, ``silu_and_mul``,
``rotary_embedding``, ``fused_moe``, ... by vLLM's op names), and their other fast paths
(prepacked GEMM weights, fused decode stacks, the greedy argmax head). ``custom_ops`` picks
among them in vLLM's grammar, so a ``--compilation-config '{"custom_ops": ["none"]}'`` that
asks vLLM for plain PyTorch ops asks tokenmill for the same: the reference every kernel is
tested against. CUDA graphs are recorded for decode steps (vLLM's ``FULL_DECODE_ONLY``) at
``cudagraph_capture_sizes``, or vLLM's default buckets (1, 2, 4, then steps of 8 to 248 and of 16
from 256) up to ``max_cudagraph_capture_size``; a decode step pads to the smallest size that holds
it and runs eagerly above the largest.
``enforce_eager`` records none, as in vLLM.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field, field_validator, model_validator

from tokenmill.core.config.strict import STRICT


#: the largest decode batch recorded unless max_cudagraph_capture_size says otherwise (vLLM's
#: 512: each recording costs startup time, and above this a step's launches are a small share)
DEFAULT_MAX_CAPTURE_SIZE = 512


class CompilationConfig(BaseModel):
    model_config = STRICT

    #: "all" (the default) or "none" sets whether the platform's kernels run; "+op" / "-op"
    #: then turns one CustomOp on or off by name ("-rms_norm"). "none" also turns off the fast
    #: paths that are not CustomOps (prepacked GEMMs, fused decode stacks, the greedy head):
    #: plain PyTorch everywhere
    custom_ops: list[str] = []
    #: the decode batch sizes recorded as graphs (vLLM's name); default: vLLM's buckets up to
    #: max_cudagraph_capture_size, and it. Sizes above max_num_seqs are never recorded
    cudagraph_capture_sizes: Optional[list[int]] = None
    #: the largest batch size recorded (vLLM's name); default max_num_seqs up to 512. (vLLM's
    #: default doubles max_num_seqs, as its graphs also hold speculative verify tokens; tokenmill's
    #: hold decode steps, one row per request, so no step has more rows than max_num_seqs)
    max_cudagraph_capture_size: Optional[int] = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _only_known_keys(cls, value: Any) -> Any:
        """vLLM's other keys (and its level shorthand) configure torch.compile and graph modes,
        which tokenmill does not have: named in the error rather than pydantic's 'extra inputs
        are not permitted'."""
        if isinstance(value, int) and not isinstance(value, bool):  # vLLM's `--compilation-config 3`
            raise ValueError(f"level {value}: a level configures torch.compile, which tokenmill does not use "
                             "(it reads {\"custom_ops\": [...]})")
        if isinstance(value, dict):
            others = sorted(set(value) - set(cls.model_fields))
            if others:
                raise ValueError(f"{', '.join(others)}: not read, as tokenmill does not use torch.compile "
                                 f"(it reads {', '.join(cls.model_fields)}); CUDA graphs are recorded for decode "
                                 "steps, and enforce_eager turns them off")
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

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive(cls, sizes: Optional[list[int]]) -> Optional[list[int]]:
        if sizes is not None and any(size < 1 for size in sizes):
            raise ValueError("batch sizes are 1 or more")
        return sizes

    @model_validator(mode="after")
    def _consistent(self) -> "CompilationConfig":
        sizes, largest = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if sizes and largest is not None and max(sizes) != largest:
            raise ValueError(f"max_cudagraph_capture_size {largest} is not the largest of cudagraph_capture_sizes "
                             f"({max(sizes)}): give one of them")
        return self

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        """The decode batch sizes to record, ascending (none above ``max_num_seqs``: no step has
        more rows)."""
        if self.cudagraph_capture_sizes is not None:
            largest = min(max_num_seqs, self.max_cudagraph_capture_size or max_num_seqs)
            return sorted({size for size in self.cudagraph_capture_sizes if size <= largest})
        largest = min(max_num_seqs, self.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE)
        # vLLM's buckets: a batch pads by at most 7 rows below 256 and 15 above (129 rows replay
        # 136; with powers of two they would replay 256, twice the GEMM work of a large batch)
        buckets = (1, 2, 4, *range(8, 256, 8), *range(256, largest, 16))
        return [*(size for size in buckets if size < largest), largest]

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
