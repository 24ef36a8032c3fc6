"""A conformance kit for model plugins: a model class served by the engine must give
transformers' greedy tokens and logprobs on the same weights (fp32: logprob error below
1e-4; a divergence only where the reference's top-2 logits tie within 1e-5).

Any model package can use it::

    from tokenmill.testing.model_conformance import check_model

    def test_my_model(tmp_path):
        check_model(MyLlamaForCausalLM, "path/to/a/llama/checkpoint", tmp_path)

The checkpoint is one transformers can load. The kit serves it under an architecture name
of the model's own (a copy of config.json naming it; the safetensors files are linked, not
copied), registered by a plugin made here, once with the platform's fast paths (custom ops,
prepacked weights, fused decoders) and once as plain PyTorch (``compilation_config``'s
``custom_ops: ["none"]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from tokenmill.core.engine.llm import LLM
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy

#: prompts of different lengths, including one token and one past a 16-token KV block
DEFAULT_PROMPTS = ([1], [5, 9, 3, 7], list(range(2, 21)), [11, 4] * 9)


def check_model(model_cls: type, checkpoint: str | Path, workdir: str | Path, *,
                prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS, max_tokens: int = 8,
                **engine_args: Any) -> None:
    """Assert ``model_cls`` serving ``checkpoint`` matches transformers, fast paths on and off.

    ``workdir`` receives the renamed checkpoint; ``engine_args`` go to ``LLM`` (vLLM's names).
    """
    checkpoint, workdir = Path(checkpoint), Path(workdir)
    architecture = f"Conformance{model_cls.__name__}"
    served = workdir / architecture
    served.mkdir(parents=True, exist_ok=True)
    for source in checkpoint.iterdir():
        if source.name == "config.json":
            config = json.loads(source.read_text())
            config["architectures"] = [architecture]
            (served / source.name).write_text(json.dumps(config))
        elif not (served / source.name).exists():
            (served / source.name).symlink_to(source.resolve())

    class ModelPlugin:
        @hookimpl
        def register_model_architectures(self, register):
            register(architecture, model_cls)

    reference = hf_greedy(checkpoint, prompts, max_tokens, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for plain in (False, True):
        pm = make_plugin_manager()
        pm.register_plugin(ModelPlugin(), f"conformance-{model_cls.__name__}")
        engine_args = {"kv_cache_memory_bytes": 32 * 2**20, **engine_args, "dtype": "float32",
                       **({"compilation_config": {"custom_ops": ["none"]}} if plain else {})}
        llm = LLM(str(served), plugin_manager=pm, **engine_args)
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                    for o in outputs]
        try:
            assert_matches_reference(reference, tokens, logprobs)
        except AssertionError as exc:
            kind = "plain PyTorch" if plain else "fast paths"
            raise AssertionError(f"{model_cls.__name__} ({kind}): {exc}") from None
