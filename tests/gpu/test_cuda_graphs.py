"""On a CUDA GPU: decode steps replayed from CUDA graphs give exactly the tokens and logprobs
of the same engine under ``enforce_eager``, which launches every kernel itself (the same
kernels: vLLM's meaning, graphs only), for every family, with batch sizes that fill a bucket
and sizes that pad one.

Dense families run in bf16. The mixture-of-experts families run in fp32: in bf16 their
router logits tie exactly every few hundred steps, and a padded bucket's router GEMM may
round a near-tie the other way than the unpadded eager step's, which routes the token
elsewhere; that is the arithmetic's, not the graph's. (Routing ties against HF:
tests/gpu/test_cuda_parity.py; the fused-MoE kernels in bf16 graphs: test_cuda_kernels.py.)"""

from __future__ import annotations

import pytest

from conftest import PROMPTS
from cuda_engines import cuda_llm
from tokenmill import SamplingParams

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2"]
MIXTURE_OF_EXPERTS = {"mixtral", "qwen3-moe"}


def decode(llm, prompts, max_tokens):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in max_tokens],
                           use_tqdm=False)
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_graphs_on_and_off_give_identical_tokens(arch, model_dir):
    prompts = PROMPTS[:7]
    max_tokens = [24, 20, 16, 12, 8, 6, 4]  # the batch shrinks from 7 (bucket 8) through every bucket
    dtype = "float32" if arch in MIXTURE_OF_EXPERTS else "bfloat16"
    graphed = cuda_llm(model_dir(arch), dtype=dtype, max_num_seqs=8)
    graphs = graphed.llm_engine.runner.model_step.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    eager = cuda_llm(model_dir(arch), dtype=dtype, max_num_seqs=8, enforce_eager=True)
    assert eager.llm_engine.runner.model_step.graphs is None
    assert_identical(decode(graphed, prompts, max_tokens), decode(eager, prompts, max_tokens))


def assert_identical(got, want):
    """Tokens and logprobs to the bit; a failure names the first step that differs and by how much."""
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, want)):
        steps = [s for s, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b]
        assert not steps, f"prompt {i}: tokens differ from step {steps and steps[0]}"
        off = [(abs(a - b), s) for s, (a, b) in enumerate(zip(logprobs, want_logprobs)) if a != b]
        assert not off, f"prompt {i}: logprobs differ from step {off[0][1]}, at most by {max(off)[0]:.3g}"


def test_a_weight_update_replays_the_recorded_graphs_over_the_new_weights(model_dir):
    """A trainer's update (vLLM's weight-transfer cycle) copies into the tensors the graphs read:
    no bucket is recorded again, and the graphed engine decodes the new weights exactly as the
    same engine under enforce_eager updated alike."""
    from test_weight_transfer import TRANSFER, perturbed, push
    from tokenmill.interfaces.weight_transfer import WeightTransferInitRequest

    path, prompts, max_tokens = model_dir("llama"), PROMPTS[:7], [12, 10, 8, 6, 4, 4, 4]
    graphed, eager = (cuda_llm(path, dtype="bfloat16", max_num_seqs=8, enforce_eager=e, **TRANSFER)
                      for e in (False, True))
    step = graphed.llm_engine.runner.model_step
    graphs, recorded = step.graphs, dict(step.graphs.graphs)
    before = decode(graphed, prompts, max_tokens)
    weights = perturbed(path, 1)
    for llm in (graphed, eager):
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        push(llm, weights, "v1")
    assert step.graphs is graphs and graphs.graphs == recorded
    after = decode(graphed, prompts, max_tokens)
    assert_identical(after, decode(eager, prompts, max_tokens))
    assert after != before
