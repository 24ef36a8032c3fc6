"""A REINFORCE trainer for the training-loop tests (tests/test_rl_training_loop.py): a
Hugging Face model trained with torch autograd on a reward that counts one token in each
completion. Imported by the in-process loop; run as a script, it is the separate trainer
process of the torch.distributed loop, taking JSON lines on stdin and answering on stdout:

    python tests/rl_trainer.py MODEL_DIR MASTER_PORT WORLD_SIZE

For each line ``{"prompts": [...], "completions": [...]}`` it answers with its logprobs
of the sampled tokens, takes a step, then writes the update's names, dtypes and shapes and
broadcasts the new weights to the engine (tokenmill.weight_transfer, vLLM's names).
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

TEMPERATURE = 1.0
LEARNING_RATE = 0.01
SEED = 0


def make_trainer(path: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def reinforce_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prompts: list[list[int]],
                   completions: list[list[int]], target: int) -> tuple[list[list[float]], list[list[float]]]:
    """One policy-gradient step (advantage: reward minus the batch's mean); returns the
    trainer's raw and processed (at the sampling temperature) logprobs of the sampled
    tokens, as the engine that sampled them should have reported them."""
    rewards = torch.tensor([float(c.count(target)) for c in completions])
    advantages = rewards - rewards.mean()
    raw, processed, loss = [], [], 0.0
    for prompt, completion, advantage in zip(prompts, completions, advantages):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        index = torch.tensor(completion)[:, None]
        sampled = (logits / TEMPERATURE).log_softmax(-1).gather(1, index).squeeze(1)
        raw.append(logits.detach().log_softmax(-1).gather(1, index).squeeze(1).tolist())
        processed.append(sampled.detach().tolist())
        loss = loss - advantage * sampled.sum()
    (loss / len(completions)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return raw, processed


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters()}


def main() -> None:
    from tokenmill.weight_transfer import GLOOTrainerSendWeightsArgs, GLOOWeightTransferEngine

    path, port, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model, optimizer = make_trainer(path)
    group = GLOOWeightTransferEngine.trainer_init(
        dict(master_address="127.0.0.1", master_port=port, world_size=world_size, authkey="ab" * 16))
    for line in sys.stdin:
        batch = json.loads(line)
        raw, processed = reinforce_step(model, optimizer, batch["prompts"], batch["completions"], batch["target"])
        weights = named_weights(model)
        print(json.dumps({"raw": raw, "processed": processed, "names": list(weights),
                          "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
                          "shapes": [list(t.shape) for t in weights.values()]}), flush=True)
        GLOOWeightTransferEngine.trainer_send_weights(iter(weights.items()), GLOOTrainerSendWeightsArgs(group=group))


if __name__ == "__main__":
    main()
