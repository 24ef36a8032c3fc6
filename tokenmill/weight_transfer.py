"""The trainer's side of weight transfer, under vLLM 0.32's names, so that a training script
written for vLLM changes its imports only:

    from tokenmill import LLM, SamplingParams, WeightTransferConfig
    from tokenmill.weight_transfer import (GLOOTrainerSendWeightsArgs, GLOOWeightTransferEngine,
                                           WeightTransferInitRequest, WeightTransferUpdateRequest)

``GLOOWeightTransferEngine.trainer_init(dict(master_address=..., master_port=..., world_size=...))``
joins the engine's ranks in a torch.distributed group as rank 0, and
``trainer_send_weights(named_tensors, GLOOTrainerSendWeightsArgs(group=group))`` broadcasts
an update while the engine's ``update_weights`` receives it (see
tokenmill/plugins/weight_transfer/torch_distributed.py; the NCCL names are the same over NCCL).
"""

from __future__ import annotations

from tokenmill.interfaces.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest
from tokenmill.plugins.weight_transfer.torch_distributed import GlooWeightTransfer as GLOOWeightTransferEngine
from tokenmill.plugins.weight_transfer.torch_distributed import NcclWeightTransfer as NCCLWeightTransferEngine
from tokenmill.plugins.weight_transfer.torch_distributed import TrainerGroup
from tokenmill.plugins.weight_transfer.torch_distributed import TrainerSendWeightsArgs as GLOOTrainerSendWeightsArgs
from tokenmill.plugins.weight_transfer.torch_distributed import TrainerSendWeightsArgs as NCCLTrainerSendWeightsArgs

__all__ = ["GLOOTrainerSendWeightsArgs", "GLOOWeightTransferEngine", "NCCLTrainerSendWeightsArgs",
           "NCCLWeightTransferEngine", "TrainerGroup", "WeightTransferInitRequest", "WeightTransferUpdateRequest"]
