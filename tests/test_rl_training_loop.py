"""tokenmill as the rollout engine of a real training loop (fp32, CPU): a Hugging Face model
trained by REINFORCE with torch autograd to write one token more often, tokenmill
generating every rollout and taking the new weights after every step.

After every push, tokenmill's logprobs of the tokens it sampled are the trainer's on the
same weights (1e-4): ``raw_logprobs`` the log-softmax of the logits, ``processed_logprobs``
that of the logits at the sampling temperature (what GRPO's importance ratios need). The
reward of the last five steps beats the first five's by at least ``MARGIN`` tokens per
completion (measured here: about 0.1 before, 12 of 12 after).

The weights go through the in-process backend (the trainer holds the LLM), and from a
separate trainer process over a torch.distributed gloo group (vLLM's GLOO backend names),
at TP=1 and TP=2. The NCCL backend is the same code over NCCL; it needs two GPUs and is
not run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import make_llm
from rl_trainer import TEMPERATURE, make_trainer, named_weights, reinforce_step
from server_harness import free_port
from tokenmill import SamplingParams

STEPS = 20
MAX_TOKENS = 12
#: the reward (target tokens per completion) the last five steps gain over the first five
MARGIN = 3.0
PROMPTS = [[3 + 7 * i + j for j in range(6)] for i in range(8)] * 2


def rollouts(llm, step: int) -> tuple[list[list[int]], list[list[float]]]:
    """One sample per prompt, seeded per step and row: the completions and their logprobs."""
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1000 * step + i, logprobs=0,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[entry[t].logprob for t, entry in zip(c, o.outputs[0].logprobs)]
                for c, o in zip(completions, outputs)]
    return completions, logprobs


def max_error(got: list[list[float]], expected: list[list[float]]) -> float:
    return max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e))


def most_common(completions: list[list[int]]) -> int:
    """The target: the untrained model's most frequent sampled token."""
    return Counter(t for c in completions for t in c).most_common(1)[0][0]


def mean_reward(completions: list[list[int]], target: int) -> float:
    return sum(c.count(target) for c in completions) / len(completions)


def assert_learned(rewards: list[float]) -> None:
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + MARGIN, f"mean reward {first:.2f} -> {last:.2f}"


def test_reinforce_with_in_process_weight_transfer(model_dir):
    """Two engines take every push: one reports raw logprobs, the other processed ones; with
    the same weights and seeds they sample the same tokens."""
    path = model_dir("llama")
    model, optimizer = make_trainer(str(path))
    transfer = {"weight_transfer_config": {"backend": "in_process"}}
    with make_llm(path, logprobs_mode="raw_logprobs", **transfer) as raw_llm, \
            make_llm(path, logprobs_mode="processed_logprobs", **transfer) as processed_llm:
        for llm in (raw_llm, processed_llm):
            llm.init_weight_transfer_engine({"init_info": {}})
        rewards, target = [], None
        for step in range(STEPS):
            completions, raw_logprobs = rollouts(raw_llm, step)
            same, processed_logprobs = rollouts(processed_llm, step)
            assert same == completions
            target = target if target is not None else most_common(completions)
            rewards.append(mean_reward(completions, target))
            raw, processed = reinforce_step(model, optimizer, PROMPTS, completions, target)
            assert max_error(raw_logprobs, raw) < 1e-4, step
            assert max_error(processed_logprobs, processed) < 1e-4, step
            for llm in (raw_llm, processed_llm):
                llm.start_weight_update()
                llm.update_weights({"update_info": {"weights": named_weights(model)}})
                llm.finish_weight_update(weight_version=str(step))
        assert raw_llm.get_weight_version() == str(STEPS - 1)
    assert_learned(rewards)


@pytest.mark.parametrize("tp", [1, 2])
def test_reinforce_from_a_separate_trainer_process_over_gloo(tp, model_dir):
    """The trainer is another process (tests/rl_trainer.py): it joins a gloo group with the
    engine's ranks (rank 0; the engine's from rank_offset 1) and broadcasts every update
    while the engine receives it, each rank keeping its shard."""
    path = model_dir("llama")
    port = free_port()
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).parent / "rl_trainer.py"), str(path), str(port),
                                str(1 + tp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with make_llm(path, tensor_parallel_size=tp, weight_transfer_config={"backend": "gloo"}) as llm:
            llm.init_weight_transfer_engine({"init_info": dict(master_address="127.0.0.1", master_port=port,
                                                               rank_offset=1, world_size=1 + tp,
                                                               authkey="ab" * 16)})
            rewards, target = [], None
            for step in range(STEPS):
                completions, logprobs = rollouts(llm, step)
                target = target if target is not None else most_common(completions)
                rewards.append(mean_reward(completions, target))
                trainer.stdin.write(json.dumps({"prompts": PROMPTS, "completions": completions,
                                                "target": target}) + "\n")
                trainer.stdin.flush()
                answer = json.loads(trainer.stdout.readline())
                assert max_error(logprobs, answer["raw"]) < 1e-4, step
                llm.start_weight_update()
                llm.update_weights({"update_info": {key: answer[key] for key in ("names", "dtype_names", "shapes")}})
                llm.finish_weight_update(str(step))
    finally:
        trainer.stdin.close()
        trainer.wait(timeout=60)
    assert trainer.returncode == 0
    assert_learned(rewards)
