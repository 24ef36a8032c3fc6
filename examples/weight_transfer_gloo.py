"""A training loop's weight sync over gloo, as a script for vLLM 0.32 writes it: only the
imports name tokenmill (for vLLM they read ``from vllm import LLM, SamplingParams``,
``from vllm.config import WeightTransferConfig``, ``from
vllm.distributed.weight_transfer.base import ...`` and ``from
vllm.distributed.weight_transfer.gloo_engine import ...``).

    python examples/weight_transfer_gloo.py MODEL_DIR [PORT]

The trainer is a thread of this process here, to keep the example to one file; a real
trainer is its own process, on the same machine or another. It sleeps the engine while it
"trains" (scales every weight), then broadcasts the new weights while the engine receives
them, and the engine answers with them.
"""

import json
import sys
import threading

import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams, WeightTransferConfig
from tokenmill.weight_transfer import (
    GLOOTrainerSendWeightsArgs,
    GLOOWeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)


def main(model: str, port: int) -> None:
    llm = LLM(model=model, enable_sleep_mode=True, weight_transfer_config=WeightTransferConfig(backend="gloo"))
    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

    # rendezvous: the trainer is rank 0 of the group, the engine's workers follow it
    init_info = dict(master_address="127.0.0.1", master_port=port, world_size=2)
    group = {}
    joining = threading.Thread(target=lambda: group.update(group=GLOOWeightTransferEngine.trainer_init(init_info)))
    joining.start()
    llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info, rank_offset=1)))
    joining.join()

    prompts = [{"prompt_token_ids": list(range(5, 17))}, {"prompt_token_ids": list(range(40, 47))}]
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling)]

    llm.sleep(level=1)  # the trainer has the memory while it trains
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(0.9)
    llm.wake_up()

    params = list(trainer.named_parameters())
    llm.start_weight_update()
    sending = threading.Thread(target=GLOOWeightTransferEngine.trainer_send_weights,
                               args=(((n, p.detach()) for n, p in params), GLOOTrainerSendWeightsArgs(group=group["group"])))
    sending.start()
    llm.update_weights(WeightTransferUpdateRequest(update_info=dict(
        names=[n for n, _ in params], dtype_names=[str(p.dtype).split(".")[-1] for _, p in params],
        shapes=[list(p.shape) for _, p in params])))
    sending.join()
    llm.finish_weight_update()
    llm.reset_prefix_cache()

    after = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling)]
    print(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 29555)
