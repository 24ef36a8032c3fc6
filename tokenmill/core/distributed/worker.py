"""A worker rank: ``python -m tokenmill.core.distributed.worker RANK`` (spec in TOKENMILL_WORKER_SPEC),
or ``run_worker(spec, rank)`` in a process an executor owns (a Ray actor).

It builds its own plugin manager from entry points, its shard of the model, and its KV
cache, then runs the driver's messages until ``Shutdown`` or until the driver is gone:
its control connection closing (EOF) or a collective failing ends the process, so a
worker never outlives its engine.
"""

from __future__ import annotations

import os
import socket
import sys
from multiprocessing.connection import Client, Connection

import msgspec
import structlog
import torch.distributed as dist
from datetime import timedelta

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.distributed.communicator import Communicator
from tokenmill.core.distributed.driver import STARTUP_TIMEOUT_S
from tokenmill.core.distributed.messages import (
    PROTOCOL_VERSION,
    Control,
    Failed,
    Hello,
    LoadAdapter,
    Ready,
    Reply,
    Result,
    Setup,
    Shutdown,
    Step,
    Swap,
    UnloadAdapter,
    WorkerSpec,
    decode_from_driver,
    encode,
)
from tokenmill.core.engine.gc_heap import freeze_startup_heap
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.platform_selection import select_platform
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.core.worker.model_builder import build_model
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.model_step import ModelStep
from tokenmill.core.worker.worker_control import RankParts, WorkerControl
from tokenmill.interfaces.parallel import ParallelContext

log = structlog.get_logger("tokenmill.worker")


def run_worker(spec_json: str, rank: int) -> None:
    spec = msgspec.json.decode(spec_json, type=WorkerSpec)
    connection = Client((spec.driver_host, spec.control_port), authkey=bytes.fromhex(spec.authkey))
    try:
        step, control = _build(spec, rank, connection)
    except Exception as exc:
        log.exception("worker failed to start", rank=rank)
        try:
            connection.send_bytes(encode(Failed(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        raise
    freeze_startup_heap()
    _serve(step, control, rank, connection)


def _build(spec: WorkerSpec, rank: int, connection: Connection) -> tuple[ModelStep, WorkerControl]:
    config = EngineConfig.model_validate_json(spec.config_json)
    pm = make_plugin_manager()
    components = collect_components(pm)
    connection.send_bytes(encode(Hello(rank, PROTOCOL_VERSION, os.getpid(), socket.gethostname(),
                                       components.fingerprint())))
    platform = select_platform(components.platforms, config)
    platform.setup_process(rank)
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    store = dist.PrefixStore(bytes.fromhex(spec.authkey)[:8].hex(), dist.TCPStore(
        spec.driver_host, spec.store_port, tp * pp, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
    comm = Communicator(store, rank, tp, pp, platform.dist_backend, spec.timeout_s, platform.device_type)
    parallel = ParallelContext(tp, rank % tp, pp, rank // tp, comm)
    built = build_model(config, components, pm, platform, parallel)
    kv_blocks, host_blocks = built.kv_capacity(config, platform)
    connection.send_bytes(encode(Ready(kv_blocks, host_blocks)))
    setup = decode_from_driver(connection.recv_bytes())
    assert isinstance(setup, Setup), f"expected Setup, got {type(setup).__name__}"
    swap = built.allocate_caches(config, platform, setup.num_blocks, setup.num_host_blocks)
    step = ModelStep(built.model, built.backend, config.cache.block_size, built.model_config.vocab_size, parallel,
                     swap, built.adapters, staging=InputStaging.for_platform(platform))
    return step, WorkerControl(RankParts(config, components, platform, built, step, setup.num_blocks,
                                         setup.num_host_blocks))


def _serve(step: ModelStep, control: WorkerControl, rank: int, connection: Connection) -> None:
    while True:
        try:
            message = decode_from_driver(connection.recv_bytes())
        except (EOFError, OSError):
            log.warning("the driver is gone; worker exits", rank=rank)
            return
        if isinstance(message, Step):
            try:
                step.run(message)
            except Exception:  # the ranks are out of step now: the driver fails the engine
                log.exception("step failed; worker exits", rank=rank)
                return
        elif isinstance(message, Swap):
            step.swap_blocks(message.out, message.into)
        elif isinstance(message, (LoadAdapter, UnloadAdapter)):
            connection.send_bytes(encode(_adapter_change(step, message)))
        elif isinstance(message, Control):
            connection.send_bytes(encode(_control(control, message)))
        elif isinstance(message, Shutdown):
            return


def _control(control: WorkerControl, message: Control) -> Result:
    try:
        value = control.handle(message.op, msgspec.json.decode(message.payload))
        return Result(msgspec.json.encode(value))
    except Exception as exc:  # the caller gets it, naming this rank; the worker serves on
        log.warning("control call failed", op=message.op, error=repr(exc))
        return Result(error=f"{type(exc).__name__}: {exc}")


def _adapter_change(step: ModelStep, message: LoadAdapter | UnloadAdapter) -> Reply:
    adapters = step.adapters
    try:
        if isinstance(message, UnloadAdapter):
            adapters.unload(message.name)
            return Reply()
        adapters.in_use = lambda name: name in message.keep  # evict only what the driver evicted
        adapters.load(message.name, message.path)
        for name in list(adapters.loaded()):
            if name not in message.keep:  # the driver's LRU evicted it (it knows what is in use)
                adapters.unload(name)
        return Reply()
    except Exception as exc:
        return Reply(f"{type(exc).__name__}: {exc}")


def main() -> None:
    run_worker(os.environ["TOKENMILL_WORKER_SPEC"], int(sys.argv[1]))


if __name__ == "__main__":
    main()
