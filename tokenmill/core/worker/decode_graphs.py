"""Decode steps replayed from recorded device graphs (vLLM's CUDA graphs), per batch-size bucket.

A decode step launches a few kernels per layer for a handful of tokens, so on a GPU it is
bound by launch overhead rather than by the work. Recording the whole forward pass once
per batch size and replaying it removes that overhead. A recording fixes every kernel's
grid and every tensor's address, so:

- the inputs live in fixed buffers, refilled before each replay;
- a step of ``n`` decode rows replays the smallest recorded size ``>= n`` (the buckets are
  vLLM's 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs`` or 512, or compilation_config's sizes), its
  extra rows padded: token 0 at position 0 with slot -1, so they write no KV; they read block 0
  and their outputs are dropped;
- the attention metadata is built once per bucket, by the backend's ``graph_metadata``, and
  kept as long as the graphs (a recording holds addresses, not references);
- the logits and sampling stay outside the graph, on the rows that are real.

Which platform records (CUDA graphs, or a stand-in in the tests) is the platform's
``capture_graph``; a step that is not all decode rows, or larger than the largest bucket,
runs eagerly.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
import structlog
import torch
from tqdm import tqdm

from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.interfaces.attention import AttentionBackend, AttentionMetadata
from tokenmill.interfaces.models import CausalLM
from tokenmill.interfaces.platform import DeviceGraph, Platform

log = structlog.get_logger("tokenmill.worker")

#: copies a host array to the model's device (through the step's staging buffers)
Put = Callable[[np.ndarray, str], torch.Tensor]


class DecodeGraphs:
    """The recorded decode steps of one model and its input buffers."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, max_seq_len: int, device: str) -> None:
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        #: the forward pass's hidden states, written by every replay (set by ``capture``)
        self.hidden: Optional[torch.Tensor] = None
        self.graphs: dict[int, DeviceGraph] = {}
        #: each bucket's attention metadata, made before its recording and read by every
        #: replay: a recorded graph holds its tensors' addresses, not references, so they
        #: live as long as the graphs do (freed, the replay reads whatever reuses the memory)
        self.metadata: dict[int, AttentionMetadata] = {}
        #: where the model's tensors were when the graphs were recorded
        self.addresses: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = []

    @classmethod
    def for_engine(cls, model: CausalLM, backend: AttentionBackend, platform: Platform, sizes: list[int],
                   block_size: int, max_seq_len: int, lookahead_slots: int) -> Optional["DecodeGraphs"]:
        """The engine's decode steps recorded at batch ``sizes`` (``CompilationConfig.capture_sizes``),
        or None where there are none, where its platform records no graphs, or where a layer runs a
        plain PyTorch path that reads from the device mid-step."""
        if not sizes:
            return None
        unrecordable = sorted({module.op_name for module in model.modules() if isinstance(module, CustomOp)
                               and module.op_impl is None and not module.native_in_graphs})
        if unrecordable:
            log.info("decode steps run without graphs", because=f"{', '.join(unrecordable)} runs its plain PyTorch "
                     "path (compilation_config.custom_ops), which reads from the device mid-step")
            return None
        graphs = cls(model, backend, sizes, -(-(max_seq_len + lookahead_slots) // block_size),
                     block_size, max_seq_len, platform.device_type)
        return graphs if graphs.capture(platform) else None

    def capture(self, platform: Platform) -> bool:
        """Record every bucket, the largest first (the smaller ones then reuse its memory).
        False where the platform records no graphs."""
        started = time.perf_counter()
        with torch.inference_mode():
            # an eager one-row pass gives the output's width and dtype
            row = self._forward(1)
            self.hidden = row.new_zeros(self.sizes[-1], *row.shape[1:])
            for size in tqdm(reversed(self.sizes), total=len(self.sizes), desc="Capturing decode graphs",
                             unit="graph", leave=False):
                self.metadata[size] = self._metadata(size)
                graph = platform.capture_graph(self._forward_into(size, self.metadata[size]))
                if graph is None:
                    self.hidden = None
                    return False
                self.graphs[size] = graph
        self.addresses = tensor_addresses(self.model)
        log.info("decode graphs captured", sizes=self.sizes, seconds=round(time.perf_counter() - started, 2))
        return True

    def addresses_unchanged(self) -> bool:
        """Whether every tensor of the model is where it was at recording, so the graphs replay
        over its current values (a weight update that copied in place); else they must be recorded
        again."""
        return tensor_addresses(self.model) == self.addresses

    def _forward(self, size: int, metadata: Optional[AttentionMetadata] = None) -> torch.Tensor:
        metadata = metadata or self._metadata(size)
        return self.model.forward(self.input_ids[:size], self.positions[:size], metadata)

    def _forward_into(self, size: int, metadata: AttentionMetadata) -> Callable[[], None]:
        hidden = self.hidden

        def forward() -> None:
            hidden[:size].copy_(self._forward(size, metadata))

        return forward

    def _metadata(self, size: int) -> AttentionMetadata:
        common = AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_start_loc_cpu=tuple(range(size + 1)), seq_lens_cpu=(self.max_seq_len,) * size,
            block_size=self.block_size)
        return self.backend.graph_metadata(common, self.positions[:size], self.max_seq_len)

    def bucket(self, query_lens: np.ndarray, blocks_per_row: int) -> Optional[int]:
        """The recorded size a step replays: its rows all decode rows (one query token), no
        more of them than the largest bucket, their block tables within the buffer's width."""
        if not self.graphs or blocks_per_row > self.block_table.shape[1] or (query_lens != 1).any():
            return None
        rows = len(query_lens)
        return next((size for size in self.sizes if size >= rows), None)

    def run(self, size: int, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            seq_lens: np.ndarray, block_table: np.ndarray, put: Put,
            fill: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """Fill the buffers with a step's rows (padded to ``size``), replay, return the real rows'
        hidden states. The values go through ``put`` first: pinned host buffers and
        non-blocking copies, then a device-side copy into the graph's buffers; ``fill`` then
        writes the input ids that are still on the device (placeholder tokens)."""
        rows, width = len(token_ids), block_table.shape[1]

        def padded(values: np.ndarray, pad: int) -> np.ndarray:
            out = np.full((size, *values.shape[1:]), pad, dtype=values.dtype)
            out[:rows] = values
            return out

        self.input_ids[:size].copy_(put(padded(token_ids, 0), "input_ids"), non_blocking=True)
        if fill is not None:
            fill(self.input_ids)
        self.positions[:size].copy_(put(padded(positions, 0), "positions"), non_blocking=True)
        self.slot_mapping[:size].copy_(put(padded(slots, -1), "slot_mapping"), non_blocking=True)
        self.seq_lens[:size].copy_(put(padded(seq_lens.astype(np.int32), 1), "seq_lens"), non_blocking=True)
        self.block_table[:size, :width].copy_(put(padded(block_table, 0), "block_table"), non_blocking=True)
        self.graphs[size].replay()
        return self.hidden[:rows]


def tensor_addresses(model: torch.nn.Module) -> list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Where each tensor of ``model`` lives and its geometry (parameters, buffers and plain
    tensor attributes, which a platform's optimisation may add): what a recorded graph reads
    from. Opaque layouts (oneDNN's packed weights) have no address to record and are left out."""
    return [(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for module in model.modules()
            for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values())
            if isinstance(t, torch.Tensor) and t.layout is torch.strided]
