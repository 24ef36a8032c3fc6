"""The collectives of a multi-rank model, over torch.distributed process groups.

Groups are built from a TCPStore without ``init_process_group``: nothing process-global
is set, so one process can hold several engines (tests do), and an engine's groups die
with it. Every wait has the configured timeout; a collective that fails or times out (a
rank died or hangs) raises ``WorkerFailed``, which stops the engine instead of hanging it.
Each rank keeps ``stats``: the time its collectives took, for benchmarks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tokenmill.interfaces.errors import WorkerFailed


def new_group(store: dist.Store, prefix: str, rank: int, size: int, backend: str,
              timeout: timedelta) -> dist.ProcessGroup:
    """A process group of ``size`` ranks over ``store`` (under ``prefix``), without
    ``init_process_group``; it waits for every rank to join."""
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")


@dataclass
class CollectiveStats:
    """Time this rank spent in collectives (launch to completion, waiting for slower ranks
    included), how many, and the bytes it contributed: what benchmarks report per step."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0


class Communicator:
    """One rank's view: its tensor-parallel group (the ranks of its pipeline stage) and the
    whole world (stage-to-stage sends, results to the driver)."""

    def __init__(self, store: dist.Store, rank: int, tp_size: int, pp_size: int, backend: str,
                 timeout_s: float, device: str = "cpu") -> None:
        timeout = timedelta(seconds=timeout_s)
        #: where received tensors are allocated (NCCL receives into device memory only)
        self.device = device
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.tp_rank, self.stage = rank % tp_size, rank // tp_size
        self.world = new_group(store, "world", rank, tp_size * pp_size, backend, timeout)
        self.tp = (new_group(store, f"tp{self.stage}", self.tp_rank, tp_size, backend, timeout)
                   if tp_size > 1 else None)
        self.stats = CollectiveStats()
        #: sends started without waiting, with their tensors (kept alive until they complete)
        self._sends: list[tuple[dist.Work, torch.Tensor, str]] = []

    def _run(self, what: str, launch: Callable[[], dist.Work], tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            launch().wait()
        except RuntimeError as exc:  # gloo: a peer closed its connection, or the timeout passed
            raise WorkerFailed(f"{what} failed on rank {self.rank}: {exc}") from exc
        self.stats.seconds += time.perf_counter() - started
        self.stats.calls += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

    # --- tensor parallelism ---------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.tp is None:
            return x
        x = x.contiguous()
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self._run("all-reduce", lambda: self.tp.allreduce([x], options), x)
        return x

    def _gather(self, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """``x`` of every tensor-parallel rank, on the stage's first one (None elsewhere)."""
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else []
        self._run("gather", lambda: self.tp.gather([outputs] if outputs else [], [x], options), x)
        return outputs or None

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        if self.tp is None:
            return local
        shard = -(-vocab_size // self.tp_size)
        if local.shape[-1] < shard:  # the last shard is the short one: pad it to gather
            local = torch.nn.functional.pad(local, (0, shard - local.shape[-1]), value=float("-inf"))
        parts = self._gather(local)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    def argmax_vocab(self, local: torch.Tensor, vocab_start: int) -> Optional[torch.Tensor]:
        if local.shape[-1] == 0:  # a vocabulary smaller than the ranks leaves the last shards empty
            values = torch.full(local.shape[:-1], float("-inf"), device=local.device)
            indices = torch.zeros(local.shape[:-1], dtype=torch.long, device=local.device)
        else:
            values, indices = local.max(dim=-1)
        pairs = torch.stack([values.double(), (indices + vocab_start).double()], dim=-1)  # [n, 2]
        parts = [pairs] if self.tp is None else self._gather(pairs)
        if parts is None:
            return None
        stacked = torch.stack(parts)  # [tp, n, 2]
        # the first shard with the maximum wins a tie, as argmax over the whole row would
        best = stacked[..., 0].argmax(dim=0)
        return stacked[..., 1].gather(0, best[None])[0].long()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """``x`` from rank ``src`` into every rank's ``x``, across the whole world."""
        self._run(f"broadcast from rank {src}", lambda: self.world.broadcast(x, src), x)

    # --- pipeline parallelism ---------------------------------------------------
    def send_next(self, x: torch.Tensor) -> None:
        self.send(x, self.rank + self.tp_size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.recv(shape, dtype, self.rank - self.tp_size)

    def send(self, x: torch.Tensor, dst: int, wait: bool = True) -> None:
        """Send ``x``; with ``wait=False`` return at once (``wait_sends`` completes it): the
        last pipeline stage hands a result to a driver that may first be sending it the next
        batch's inputs, and two blocking sends would wait for each other."""
        x = x.contiguous()
        if wait:
            self._run(f"send to rank {dst}", lambda: self.world.send([x], dst, 0), x)
        else:
            self._sends.append((self.world.send([x], dst, 0), x, f"send to rank {dst}"))

    def wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work, x, what in sends:
            self._run(what, lambda: work, x)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._run(f"receive from rank {src}", lambda: self.world.recv([out], src, 0), out)
        return out

    @property
    def last_stage_driver(self) -> int:
        """The rank that hands the step's result back to the driver: the last stage's first."""
        return (self.pp_size - 1) * self.tp_size
