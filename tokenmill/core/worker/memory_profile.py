"""The profiling forward pass: how much device memory a step's activations take at their peak.

On a device whose memory is shared by the weights, the KV cache and each step's
activations (a GPU), the KV budget must leave room for the largest step the scheduler can
form, or that step runs out of memory mid-serving. vLLM measures it by running one such
step at startup; so does this: ``max_num_batched_tokens`` prompt tokens spread over as many
requests as ``max_num_seqs`` allows (each at most ``max_model_len``), every request's last
token taking logits. Its KV goes into a one-block cache bound for the pass, which the real
allocation replaces. Every rank runs it at the same point, so the collectives of tensor and
pipeline parallelism pair up.

Sampling is profiled too (vLLM's dummy sampler run): the most rows a step can sample
(``max_num_seqs``, times k + 1 with k speculative tokens) through every [rows, vocab]
transformation the sampler has. At 1024 rows of a 256k vocabulary those are ~10 GB, which a
profile of the forward alone leaves to the KV cache.
"""

from __future__ import annotations

import itertools

import torch

from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.sample.sampler import Sampler, SamplingRow
from tokenmill.core.worker.kv_cache import allocate_kv_caches
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.model_step import ModelStep
from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.models import CausalLM
from tokenmill.interfaces.parallel import ParallelContext
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.sampling_params import SamplingParams


def profile_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> Step:
    """The largest step: ``num_tokens`` split as evenly as possible over up to
    ``max_num_seqs`` requests of at most ``max_model_len`` tokens, all in block 0. The last
    request's tokens end a context of ``max_model_len`` (a long prompt's last chunk), so the
    step's block table is as wide as any step's: what attention builds per token and block
    table column (the flex backend's block masks) is measured at its widest."""
    num_seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    rows = [Row([0] * n, 0, [0] * -(-n // block_size), None) for n in lengths[:-1]]
    rows.append(Row([0] * lengths[-1], max_model_len - lengths[-1], [0] * -(-max_model_len // block_size), None))
    return Step(rows, [end - 1 for end in itertools.accumulate(lengths)], False)


def profile_forward(model: CausalLM, backend: AttentionBackend, parallel: ParallelContext, vocab_size: int,
                    cache_dtype: torch.dtype, platform: Platform, num_tokens: int, max_num_seqs: int,
                    max_model_len: int, block_size: int) -> None:
    """Run the largest step once, on a throwaway one-block KV cache, its inputs staged to the
    device as a serving step's are."""
    allocate_kv_caches(model, backend, 1, block_size, cache_dtype, platform.device_type)
    ModelStep(model, backend, block_size, vocab_size, parallel, staging=InputStaging.for_platform(platform)).run(
        profile_step(num_tokens, max_num_seqs, max_model_len, block_size))


def profile_sampling(vocab_size: int, rows: int, max_logprobs: int, platform: Platform) -> None:
    """Sample ``rows`` rows of logits with all the sampler holds at once: penalties,
    temperature, min-p, top-k and top-p (a sort of the whole vocabulary), the draw's noise and
    the largest logprobs a request may ask for."""
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                            presence_penalty=0.1, frequency_penalty=0.1, logprobs=max_logprobs)
    logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=platform.device_type)  # no global RNG draw
    sampler = Sampler(0, noise_generator=platform.noise_generator(0))
    sampler.sample(logits, [SamplingRow(params, [0], [0], None)] * rows)
