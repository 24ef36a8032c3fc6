"""Shared fixtures: tiny model directories and Hugging Face references, made once per session."""

from __future__ import annotations

import os

# The suite runs on several workers (pytest-xdist: the README's test command), each starting
# servers, engine processes and ranks on a machine of a few cores: OpenMP's idle threads wait
# passively rather than spin on a core another process needs (libgomp reads this when torch
# loads it, so it is set first; the processes the tests start inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Triton kernels run in the interpreter without a GPU; triton reads this when a kernel
# module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path
from typing import Any, Callable

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.testing.hf_reference import ReferenceSequence, hf_greedy
from tokenmill.testing.tiny_models import make_tiny_model

NEW_TOKENS = 24
#: engine arguments for plain PyTorch everywhere: none of the platform's kernels (vLLM's spelling)
PLAIN = {"compilation_config": {"custom_ops": ["none"]}}

#: the shared quantized checkpoints (FP8, GPTQ, AWQ): ../shared beside the checkout, or the
#: copy benchmarks/gpu_prepare.py puts in the checkout for a GPU machine (../shared does not travel)
QUANT_CHECKPOINTS = next((path for path in (Path(__file__).parents[1] / ".gpu-data" / "quant-checkpoints",
                                            Path(__file__).parents[1].parent / "shared" / "quant-checkpoints")
                          if path.is_dir()), Path(__file__).parents[1].parent / "shared" / "quant-checkpoints")


#: the files that take minutes on a 2-vCPU machine, longest first: the workers take files in
#: collection order, so these start first and the last minutes are not one long file on one
#: worker while the others idle
LONGEST_FILES = ("test_device_boundaries.py", "test_benchmarks.py", "test_async_scheduling.py", "test_openapi.py",
                 "test_attention_conformance.py", "test_cli.py", "test_distributed.py")


def pytest_collection_modifyitems(config, items):
    """tests/gpu is the GPU suite (marker ``gpu``), skipped where no CUDA device is visible;
    ``bash benchmarks/gpu_check.sh`` runs it on a GPU. The longest files come first."""
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="no CUDA device is visible"))
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _release_gpu_engines(request):
    """After each GPU test, its engines' memory goes back to the GPU, the failed ones' too:
    pytest keeps a failure's traceback (``sys.last_traceback``, for post-mortem debugging), and
    with it the test's frames and engines, whose KV caches would starve the next tests on the
    same GPU."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        torch.cuda.empty_cache()


def random_prompts(count: int = 12, seed: int = 0, low: int = 3, high: int = 150) -> list[list[int]]:
    """Token-id prompts of mixed lengths, avoiding the special tokens 0-5."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


PROMPTS = random_prompts()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """``model_dir("llama")`` -> a tiny model directory, built once per session."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_reference(model_dir) -> Callable[[str], list[ReferenceSequence]]:
    """``hf_reference("llama")`` -> HF greedy references for PROMPTS, computed once."""
    cache: dict[str, list[ReferenceSequence]] = {}

    def get(arch: str) -> list[ReferenceSequence]:
        if arch not in cache:
            cache[arch] = hf_greedy(model_dir(arch), PROMPTS, NEW_TOKENS)
        return cache[arch]

    return get


def greedy_in_batches(llm, prompts, batch):
    """Token ids and their logprobs, ``batch`` prompts at a time."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    tokens, logprobs = [], []
    for i in range(0, len(prompts), batch):
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False):
            tokens.append(o.outputs[0].token_ids)
            logprobs.append([e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
    return tokens, logprobs


def make_llm(path: Path, **engine_args: Any) -> LLM:
    """An LLM with a small KV budget, so tests stay light on memory."""
    engine_args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    return LLM(str(path), **engine_args)


#: engine arguments under which PROMPTS preempt each other: a pool of 24 blocks of 8 tokens
PREEMPTING = dict(num_gpu_blocks_override=24, block_size=8, max_model_len=192, swap_space=2**22)


def assert_preempted(llm: LLM, mode: str) -> None:
    """The engine preempted requests (by swap, in swap mode) and got every block back."""
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert scheduler.num_swaps_total > 0
    assert scheduler.kv_cache.pool.num_free_blocks == PREEMPTING["num_gpu_blocks_override"]


@pytest.fixture(scope="session")
def llama(model_dir) -> LLM:
    """A default-configured engine over the tiny Llama, shared by read-only tests."""
    return make_llm(model_dir("llama"))


def sampler_for(rows: list, seed: int = 0, eos: tuple[int, ...] = (), vocab: int = 50):
    """A Sampler with the built-in logits processors, told about ``rows`` as a new batch."""
    import torch

    from tokenmill.core.sample.logits_processors import BUILTIN_LOGITS_PROCESSORS
    from tokenmill.core.sample.sampler import Sampler
    from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate, LogitsProcessorContext

    context = LogitsProcessorContext(vocab, eos, 8, torch.device("cpu"), None)
    sampler = Sampler(seed, [cls(context) for cls in BUILTIN_LOGITS_PROCESSORS])
    sampler.update_batch(BatchUpdate(len(rows), added=tuple(
        AddedRow(i, r.params, r.prompt_token_ids, r.output_token_ids) for i, r in enumerate(rows))))
    return sampler


def with_platforms(*platforms):
    """The plugin manager with ``platforms`` (Platform subclasses) registered beside the installed ones."""
    from tokenmill import hookimpl
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager

    class Plugin:
        @hookimpl
        def register_platforms(self, register):
            for cls in platforms:
                register(cls.name, cls)

    pm = make_plugin_manager()
    pm.register_plugin(Plugin(), "test-platforms")
    return pm
