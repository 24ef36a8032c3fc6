"""One rank's part of a step: a ``Step`` message -> flat tensors -> forward -> logits rows.

Every rank of a model runs the same ``Step`` (the driver builds it and sends it to the
others), so this part holds no per-request state: the message carries each row's tokens,
blocks and adapter. What comes back, on the driver only, is either the logits rows or,
where every row takes the argmax of its raw logits, their token ids: under tensor
parallelism those come from gathering each vocabulary shard's (max, index), not the logits.
A step whose rows all decode replays a recorded graph where the engine captured them
(``DecodeGraphs``); every other step launches its kernels one by one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.layers.linear_shard import vocab_range
from tokenmill.core.worker.decode_graphs import DecodeGraphs
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.kv_cache import SwapCaches
from tokenmill.core.worker.placeholder_tokens import PlaceholderTokens
from tokenmill.interfaces.adapters import AdapterType
from tokenmill.interfaces.attention import AttentionBackend, AttentionMetadata
from tokenmill.interfaces.models import CausalLM
from tokenmill.interfaces.parallel import SINGLE, ParallelContext
from tokenmill.interfaces.platform import GreedyArgmax


@dataclass(frozen=True)
class StepResult:
    """The driver's result of a step: token ids (argmax rows) or float32 logits rows."""

    tokens: Optional[list[int]] = None
    logits: Optional[torch.Tensor] = None


class ModelStep:
    def __init__(self, model: CausalLM, attention: AttentionBackend, block_size: int, vocab_size: int,
                 parallel: ParallelContext = SINGLE, swap: Optional[SwapCaches] = None,
                 adapters: Optional[AdapterType] = None, greedy_head: Optional[GreedyArgmax] = None,
                 staging: Optional[InputStaging] = None, graphs: Optional[DecodeGraphs] = None) -> None:
        self.model = model
        #: the backend's per-step metadata builder, where it has one (AttentionBackend)
        self._build_metadata = getattr(attention, "build_metadata", None)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.swap = swap
        self.adapters = adapters
        #: tokens for steps whose rows all take the argmax of their raw logits (one rank only)
        self.greedy_head = greedy_head
        #: copies the inputs to the model's device (None: the model runs on the host)
        self.staging = staging
        #: recorded decode steps, replayed for steps of decode rows only; None runs all eagerly
        self.graphs = graphs

    def swap_blocks(self, out: Sequence[Sequence[int]], into: Sequence[Sequence[int]]) -> None:
        """Copy (device block, host block) pairs out to and in from the swap space."""
        assert self.swap is not None, "swap requested but no swap space was allocated"
        self.swap.copy(out, to_host=True)
        self.swap.copy(into, to_host=False)

    @torch.inference_mode()
    def run(self, step: Step, wait: bool = True, placeholders: Optional[PlaceholderTokens] = None
            ) -> Optional[StepResult]:
        """The forward pass for ``step``; the result on the driver (rank 0), None elsewhere.
        With ``wait=False`` a driver that is not the last stage returns once its own stage
        is done, and takes the result later with ``receive`` (pipelined batches).
        ``placeholders``: input tokens that are still on the device (async scheduling)."""
        stage = self.parallel
        if self.staging is not None:
            self.staging.next_step()
        host = HostInputs.of(step.rows, self.block_size)
        size = None if self.graphs is None else self.graphs.bucket(host.query_lens, host.block_table.shape[1])
        fill = None if placeholders is None else partial(placeholders.fill, put=self._put)
        if size is not None:
            hidden = self.graphs.run(size, host.token_ids, host.positions, host.slots, host.seq_lens,
                                     host.block_table, self._put, fill)
            self._mark_copies()  # after the replay: one-token rows nearly always sample, and are read
        else:
            if self.adapters is not None:
                self.adapters.prepare_step([r.adapter for r in step.rows], [len(r.token_ids) for r in step.rows])
            input_ids, positions, metadata = self._prepare_inputs(host)
            if fill is not None:
                fill(input_ids)
            self._mark_copies()  # before the forward, so that the next step waits for the copies only
            hidden = self.model.forward(input_ids, positions, metadata)
        if not step.logits_rows:  # a prefill chunk that samples nothing: only its KV was wanted
            return StepResult() if stage.rank == 0 else None
        if not stage.is_last_stage:
            return self.receive(step) if stage.rank == 0 and wait else None
        # the rows' index staged like the inputs: a host index tensor is a blocking copy
        rows = self._put(np.asarray(step.logits_rows, dtype=np.int64), "logits_rows")
        self._mark_copies()  # a stage that hands its logits on reads no result here
        result = self._head(hidden[rows], step.greedy)
        if stage.rank == 0 or result is None:
            return result
        # the last stage's first rank hands the result to the driver, without waiting for the
        # driver to take it (it may be sending this stage the next batch first)
        stage.comm.wait_sends()
        # on the hidden states' device: NCCL sends device tensors only
        stage.comm.send(torch.tensor(result.tokens, device=hidden.device) if step.greedy else result.logits, 0,
                        wait=False)
        return None

    def _head(self, hidden: torch.Tensor, greedy: bool) -> Optional[StepResult]:
        stage = self.parallel
        if stage.tp_size == 1:
            if greedy and self.greedy_head is not None:
                tokens = self.greedy_head.tokens(hidden)
                if tokens is not None:
                    return StepResult(tokens=tokens)
            logits = self.model.compute_logits(hidden)
            if greedy and stage.world_size > 1:
                return StepResult(tokens=logits.argmax(dim=-1).tolist())
            return StepResult(logits=logits)
        local = self.model.compute_logits(hidden)
        if greedy:
            tokens = stage.comm.argmax_vocab(local, vocab_range(self.vocab_size, stage)[0])
            return None if tokens is None else StepResult(tokens=tokens.tolist())
        logits = stage.comm.gather_vocab(local, self.vocab_size)
        return None if logits is None else StepResult(logits=logits)

    def receive(self, step: Step) -> StepResult:
        """The driver's result of ``step`` from the last pipeline stage."""
        if not step.logits_rows:
            return StepResult()
        comm, rows = self.parallel.comm, len(step.logits_rows)
        if step.greedy:
            return StepResult(tokens=comm.recv((rows,), torch.long, comm.last_stage_driver).tolist())
        return StepResult(logits=comm.recv((rows, self.vocab_size), torch.float32, comm.last_stage_driver))

    def _mark_copies(self) -> None:
        if self.staging is not None:
            self.staging.mark_copies()

    def _put(self, values: np.ndarray, name: str) -> torch.Tensor:
        staging = self.staging
        return torch.from_numpy(values) if staging is None else staging.to_device(name, values)

    def _prepare_inputs(self, host: "HostInputs") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        put = self._put
        common = AttentionMetadata(
            query_start_loc=put(host.query_start.astype(np.int32), "query_start_loc"),
            seq_lens=put(host.seq_lens.astype(np.int32), "seq_lens"),
            block_table=put(host.block_table, "block_table"),
            slot_mapping=put(host.slots, "slot_mapping"),
            max_query_len=int(host.query_lens.max()),
            max_seq_len=int(host.seq_lens.max()),
            query_start_loc_cpu=tuple(host.query_start.tolist()),
            seq_lens_cpu=tuple(host.seq_lens.tolist()),
            block_size=self.block_size,
        )
        metadata = common if self._build_metadata is None else self._build_metadata(common)
        return put(host.token_ids, "input_ids"), put(host.positions, "positions"), metadata


#: up to this many rows and tokens, a step's host inputs are worked out in Python
#: (``HostInputs.of_few``: ~0.3 µs a token, against numpy's ~50-130 µs a step)
_FEW_ROWS = 4
_FEW_TOKENS = 64


@dataclass(frozen=True)
class HostInputs:
    """A step's flat inputs on the host, as numpy arrays."""

    token_ids: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    query_start: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    slots: np.ndarray

    @classmethod
    def of(cls, rows: list[Row], block_size: int) -> "HostInputs":
        if len(rows) <= _FEW_ROWS and sum(len(r.token_ids) for r in rows) <= _FEW_TOKENS:
            return cls.of_few(rows, block_size)
        return cls.of_many(rows, block_size)

    @classmethod
    def of_few(cls, rows: list[Row], block_size: int) -> "HostInputs":
        """The inputs worked out in Python, then made arrays once each: for a few rows (batch 1,
        a verify step) this is 20-30 µs where ``of_many``'s twenty numpy calls on caches a
        forward pass left cold were 130-200 µs, the same host work on every platform's step."""
        bs = block_size
        width = max(len(r.block_ids) for r in rows)
        positions: list[int] = []
        slots: list[int] = []
        table: list[list[int]] = []
        for r in rows:
            ids = r.block_ids
            table.append(list(ids) + [0] * (width - len(ids)) if len(ids) < width else ids)
            for position in range(r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)):
                positions.append(position)
                slots.append(ids[position // bs] * bs + position % bs)
        query_lens = np.array([len(r.token_ids) for r in rows], dtype=np.int64)
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        return cls(np.array([t for r in rows for t in r.token_ids], dtype=np.int64),
                   np.array(positions, dtype=np.int64), query_lens, query_start,
                   np.array([r.num_computed_tokens + len(r.token_ids) for r in rows], dtype=np.int64),
                   np.array(table, dtype=np.int32).reshape(len(rows), width), np.array(slots, dtype=np.int64))

    @classmethod
    def of_many(cls, rows: list[Row], block_size: int) -> "HostInputs":
        bs = block_size
        query_lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        computed = np.fromiter((r.num_computed_tokens for r in rows), np.int64, len(rows))
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        request_index = np.repeat(np.arange(len(rows)), query_lens)
        positions = computed[request_index] + np.arange(num_tokens) - query_start[:-1][request_index]
        num_blocks = np.fromiter((len(r.block_ids) for r in rows), np.int64, len(rows))
        width, total = int(num_blocks.max()), int(num_blocks.sum())
        block_table = np.zeros((len(rows), width), dtype=np.int32)
        # each row's ids fill its leading columns, in one assignment rather than one per row, at
        # flat indices worked out per id: a mask over the whole table cost 10 ms a step at 1024
        # rows where one holds a 128k-token context (8192 columns), these 2-6
        first_id = np.cumsum(num_blocks) - num_blocks
        index = np.arange(total) + np.repeat(np.arange(len(rows)) * width - first_id, num_blocks)
        block_table.ravel()[index] = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in rows), np.int32,
                                                 total)
        slots = block_table[request_index, positions // bs].astype(np.int64) * bs + positions % bs
        token_ids = np.fromiter((t for r in rows for t in r.token_ids), np.int64, num_tokens)
        return cls(token_ids, positions, query_lens, query_start, computed + query_lens, block_table, slots)
