"""How ``tokenmill serve`` answers each flag of ``vllm serve`` (vLLM 0.32), so that a
deployment script that names ``vllm serve`` keeps working when it names ``tokenmill serve``,
or fails at startup saying why and what to use instead.

Every name in ``vllm-0.32-serve-flags.txt`` (beside this file: read from vLLM 0.32's
``--help=all``) is one of:

- **honoured**: a flag of ``tokenmill serve`` itself (``tokenmill/cli/``), with a test that
  observes its effect;
- **already so** (``ALREADY_SO``): accepted, and nothing to do, because tokenmill always
  behaves as the flag asks; the reason says how;
- **refused** (``REFUSED``): exit status 2 at startup, before the model loads, with the
  reason and what to use instead; a value that asks for what tokenmill does anyway
  (``INERT``: ``--load-format safetensors``, ``--data-parallel-size 1``) is accepted.

A flag that only concerns another platform's options (``--gpu-memory-utilization`` on a
CPU) is honoured and logged as ignored there, as vLLM does. ``tests/test_vllm_flags.py``
fails when a listed flag is in none of the three; ``python -m tokenmill.server.vllm_flags``
prints the README's table from the same data. ``--config`` also takes vLLM's flat YAML of
flag names (``expand_vllm_config``).
"""

from __future__ import annotations

import argparse
import json
from importlib.resources import files
from typing import Optional

#: vLLM 0.32's `vllm serve` flags
VLLM_SERVE_FLAGS: tuple[str, ...] = tuple(
    line.strip() for line in files("tokenmill.server").joinpath("vllm-0.32-serve-flags.txt").read_text().splitlines()
    if line.startswith("--"))

_MULTIMODAL = "multimodal inputs are not supported: the served models are text-only"
_DATA_PARALLEL = ("data parallelism is not supported: run one `tokenmill serve` per replica behind a load balancer "
                  "(tensor and pipeline parallelism: --tensor-parallel-size, --pipeline-parallel-size)")
_MULTI_NODE = ("ranks start as local processes or Ray actors: --distributed-executor-backend ray places them on a "
               "Ray cluster's nodes")
_EXPERT_PARALLEL = ("expert parallelism is not supported: mixture-of-experts layers split their experts' weights "
                    "by tensor parallelism (--tensor-parallel-size)")
_CONTEXT_PARALLEL = "context parallelism is not supported: use --tensor-parallel-size or --pipeline-parallel-size"
_HYBRID = "state-space (Mamba, linear attention) models are not supported: the served families are attention-only"
_DISAGGREGATED = "disaggregated serving (KV and encoder-cache transfer, offloading to other tiers) is not supported"
_NO_HUB = "there is no model hub here: pass a local model directory"
_COMPILE = ("torch.compile and its configuration are not used: CUDA graphs are recorded for decode steps "
            "(--cudagraph-capture-sizes, --max-cudagraph-capture-size; --enforce-eager turns them off), and "
            "--compilation-config's custom_ops picks the platform's kernels")
_TRACING = "this tracing and metrics detail is not supported: /metrics serves vLLM's Prometheus metrics"
_POOLING = "pooling runners are chosen by the architecture: BertModel checkpoints serve /v1/embeddings"
_LORA = "this LoRA variant is not supported: --enable-lora serves rank-<= --max-lora-rank adapters on linear layers"
_SCHEDULER = "this scheduler knob is not supported: see --max-num-batched-tokens, --max-num-seqs, --scheduling-policy"
_SERVER = "this server option is not supported"
_KERNELS = "kernels are the platform's and the attention backend's: see --attention-backend and `tokenmill plugins`"
_ROLLOUT = ("this sleep-mode detail is not supported: --enable-sleep-mode frees the KV cache (level 1) and the "
            "weights (level 2) on the platform's own allocator")
_REASONING = "reasoning parsers are plugins registered through entry points: --reasoning-parser NAME"

#: flags tokenmill accepts because it always does what they ask
ALREADY_SO: dict[str, str] = {
    "--enable-offline-docs": "/docs and /redoc always serve Swagger UI and ReDoc from the package, with no CDN",
    "--use-tqdm-on-load": "loading shows progress bars on a terminal",
    "--disable-log-stats": "tokenmill logs no periodic throughput lines; /metrics has the figures",
    "--max-log-len": "request log lines carry token counts and timings, never prompt text",
    "--language-model-only": "only language models are served",
}

#: flags refused at startup: the reason, and what to use instead
REFUSED: dict[str, str] = {
    **{flag: _MULTIMODAL for flag in (
        "--allowed-local-media-path", "--allowed-media-domains", "--limit-mm-per-prompt", "--media-io-kwargs",
        "--interleave-mm-strings", "--enable-mm-embeds", "--skip-mm-profiling", "--disable-chunked-mm-input",
        "--video-pruning-method", "--video-pruning-rate", "--trust-request-mm-kwargs", "--default-mm-loras",
        "--io-processor-plugin", "--mm-device-do-normalize", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
        "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path",
        "--mm-encoder-only", "--mm-encoder-tp-mode", "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb",
        "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-processor-device", "--mm-processor-kwargs",
        "--mm-shm-cache-max-object-size-mb", "--mm-tensor-ipc", "--enable-tower-connector-lora",
        "--enable-prompt-embeds")},
    **{flag: _DATA_PARALLEL for flag in (
        "--data-parallel-address", "--data-parallel-backend", "--data-parallel-external-lb",
        "--data-parallel-hybrid-lb", "--data-parallel-multi-port-external-lb", "--data-parallel-rank",
        "--data-parallel-rpc-port", "--data-parallel-size", "--data-parallel-size-local",
        "--data-parallel-start-rank", "--data-parallel-supervisor-port", "--dp-supervisor-probe-failure-threshold",
        "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s", "--dp-sync-interval",
        "--disable-nccl-for-dp-synchronization", "--enable-elastic-ep",
        "--elastic-ep-max-dp-size", "--enable-scale-out")},
    **{flag: _MULTI_NODE for flag in ("--headless", "--nnodes", "--node-rank", "--master-addr", "--master-port")},
    **{flag: _EXPERT_PARALLEL for flag in (
        "--enable-expert-parallel", "--all2all-backend", "--enable-eplb", "--eplb-config",
        "--expert-placement-strategy", "--enable-ep-weight-filter", "--enable-dbo", "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold", "--ubatch-size", "--enable-return-routed-experts", "--moe-backend",
        "--enable-hc-sp")},
    **{flag: _CONTEXT_PARALLEL for flag in (
        "--decode-context-parallel-size", "--prefill-context-parallel-size", "--dcp-comm-backend",
        "--dcp-kv-cache-interleave-size", "--dcp-q-replicate", "--cp-kv-cache-interleave-size")},
    **{flag: _HYBRID for flag in (
        "--mamba-backend", "--mamba-block-size", "--mamba-cache-dtype", "--mamba-cache-mode",
        "--mamba-cache-philox-rounds", "--mamba-ssm-cache-dtype", "--mamba-ssu-algorithm",
        "--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint", "--gdn-prefill-backend",
        "--kda-decode-backend", "--kda-prefill-backend", "--replayssm-buffer-len", "--use-replayssm",
        "--swa-bounded-replay", "--disable-hybrid-kv-cache-manager")},
    **{flag: _DISAGGREGATED for flag in (
        "--kv-transfer-config", "--ec-transfer-config", "--ec-manager-config", "--kv-events-config",
        "--kv-offloading-backend", "--kv-offloading-size", "--offload-backend", "--offload-group-size",
        "--offload-num-in-group", "--offload-params", "--offload-prefetch-step", "--cpu-offload-params")},
    **{flag: _NO_HUB for flag in (
        "--download-dir", "--hf-token", "--revision", "--code-revision", "--tokenizer-revision", "--ignore-patterns")},
    "--hf-config-path": "config.json is read from the model directory (or --tokenizer's for the tokenizer)",
    "--load-format": "tokenmill loads safetensors only (no pickled checkpoints); a directory's *.safetensors "
                     "shards load as they are",
    "--safetensors-load-strategy": "safetensors shards stream tensor by tensor into the parameters",
    "--safetensors-prefetch-block-size": "safetensors shards stream tensor by tensor into the parameters",
    "--safetensors-prefetch-num-threads": "safetensors shards stream tensor by tensor into the parameters",
    "--pt-load-map-location": "tokenmill loads safetensors only (no pickled checkpoints)",
    "--model-loader-extra-config": "model loaders are not configurable",
    "--max-parallel-loading-workers": "ranks load their shards in parallel, each one tensor at a time",
    **{flag: _COMPILE for flag in (
        "--optimization-level",
        "--performance-mode", "--jit-monitor-mode", "--jit-monitor-verbose")},
    **{flag: _TRACING for flag in (
        "--otlp-traces-endpoint", "--collect-detailed-traces", "--enable-layerwise-nvtx-tracing",
        "--cudagraph-metrics", "--kv-cache-metrics", "--kv-cache-metrics-sample", "--enable-mfu-metrics",
        "--enable-per-request-metrics", "--per-request-spec-decode-metrics", "--custom-histogram-buckets",
        "--show-hidden-metrics-for-version", "--enable-logging-iteration-details", "--aggregate-engine-logging",
        "--enable-log-deltas", "--enable-log-outputs", "--enable-server-load-tracking", "--enable-trace-replay",
        "--fingerprint-mode", "--fingerprint-value")},
    "--log-config-file": "logging is structlog's: --log-level and --log-format (json, console)",
    "--logging-config": "logging is structlog's: --log-level and --log-format (json, console)",
    "--log-error-stack": "errors are logged with their stack at error level",
    "--disable-access-log-for-endpoints": "uvicorn's access log is on only at --log-level debug",
    "--disable-uvicorn-access-log": "uvicorn's access log is already off unless --log-level debug",
    **{flag: _POOLING for flag in (
        "--convert", "--runner", "--pooler-config", "--enable-flash-late-interaction", "--max-lora-cls-labels")},
    **{flag: _LORA for flag in (
        "--lora-dtype", "--lora-target-modules", "--fully-sharded-loras", "--enable-mixed-moe-lora-format",
        "--enable-moe-shared-loras", "--specialize-active-lora")},
    **{flag: _SCHEDULER for flag in (
        "--long-prefill-token-threshold-adaptive", "--max-num-scheduled-tokens",
        "--max-num-active-seqs", "--max-num-queued-tokens", "--prefill-schedule-interval",
        "--scheduler-reserve-full-isl", "--prefix-cache-retention-interval", "--prefix-caching-hash-algo",
        "--prefix-match-unit", "--kv-sharing-fast-prefill", "--disable-cascade-attn", "--kv-cache-dtype-skip-layers")},
    "--max-num-queued-reqs": "use --max-queued-requests (requests beyond it get 503)",
    "--scheduler-cls": "scheduling policies are plugins: --scheduling-policy NAME (see `tokenmill plugins`)",
    "--disable-sliding-window": "sliding-window models attend within their window, as trained",
    **{flag: _KERNELS for flag in (
        "--attention-config", "--kernel-config", "--linear-backend", "--ir-op-priority",
        "--sparse-indexer-topk-backend", "--enable-flashinfer-autotune", "--disable-custom-all-reduce",
        "--use-fp64-gumbel", "--enable-batch-sharded-sampling", "--enable-cumem-allocator",
        "--enable-nccl-comm-suspend", "--enable-shm-tensor-arena")},
    "--numa-bind": "the cpu platform binds its threads: --num-threads",
    "--numa-bind-cpus": "the cpu platform binds its threads: --num-threads",
    "--numa-bind-nodes": "the cpu platform binds its threads: --num-threads",
    "--device-ids": "each rank takes GPU `rank` among those visible: set CUDA_VISIBLE_DEVICES",
    "--cpu-distributed-timeout-seconds": "use --distributed-timeout-seconds",
    "--ray-workers-use-nsight": "Nsight profiling of Ray workers is not supported",
    "--worker-cls": "workers are tokenmill's; executors are plugins (--distributed-executor-backend)",
    **{flag: _ROLLOUT for flag in ("--sleep-mode-offload-cudagraph", "--sleep-preserve-parameter-names")},
    "--worker-extension-cls": "worker extensions are plugins registered through entry points "
                              "(register_worker_extensions), so that every rank has them: collective_rpc calls "
                              "their methods by name",
    "--reasoning-parser-plugin": _REASONING,
    "--reasoning-config": "reasoning parsers are not configurable: --reasoning-parser NAME",
    "--model-impl": "models are tokenmill's own implementations (model plugins), checked against transformers",
    "--model-class-overrides": "architectures are model plugins: see `tokenmill plugins`",
    "--quantization-config": "quantization is read from the checkpoint's config (--quantization names the method)",
    "--allow-deprecated-quantization": "GPTQ, AWQ and FP8 are supported (none deprecated); others are refused",
    "--additional-config": "there is no additional configuration: see `tokenmill config explain`",
    "--aux-output-config": "auxiliary outputs are not supported",
    "--diffusion-config": "diffusion models are not supported",
    "--engram-config": "engram memory is not supported",
    "--tokenizer-mode": "the tokenizer is the model directory's fast (tokenizers) one",
    "--skip-tokenizer-init": "the tokenizer is always loaded (stop strings and detokenizing need it)",
    "--tokens-only": "replies always carry text beside token ids",
    "--return-sampling-mask": "sampling masks are not returned",
    "--enable-force-include-usage": "streams report usage when a request asks (stream_options.include_usage)",
    "--default-chat-template-kwargs": "chat_template_kwargs are per request",
    "--tool-server": "built-in tool servers are not supported: the client runs its tools",
    "--tool-parser-plugin": "tool parsers are plugins registered through entry points: --tool-call-parser NAME",
    "--tool-strict-level": "strict tool schemas are not enforced",
    "--exclude-tools-when-tool-choice-none": "tools stay in the prompt with tool_choice none, as OpenAI's API does",
    "--anthropic-disabled-thinking-effort": "the Anthropic API is not served",
    "--cohere-format": "the Cohere API is not served",
    "--cohere-is-reasoning-model": "the Cohere API is not served",
    "--uds": "serve on TCP (--host, --port); a reverse proxy can bridge a Unix socket",
    "--grpc": "the gRPC API is not served: the OpenAI-compatible HTTP API is",
    "--grpc-port": "the gRPC API is not served: the OpenAI-compatible HTTP API is",
    "--h11-max-header-count": _SERVER, "--h11-max-incomplete-event-size": _SERVER,
    "--ssl-ciphers": "TLS uses Python's default ciphers", "--enable-ssl-refresh": "TLS files are read at startup",
    "--sse-keep-alive-interval": "streams send tokens as they come; no keep-alive comments are sent",
    "--enable-tokenizer-info-endpoint": "/tokenizer_info is not served: /tokenize and /detokenize are",
    "--shutdown-timeout": "in-flight requests get --drain-timeout seconds on shutdown (a YAML setting)",
    "--renderer-num-workers": "chat templates render on the server's event loop thread",
    "--config-format": "--config reads YAML",
    "--json-arg": "pass JSON values to the flags that take them (--speculative-config)",
    "--spec-method": "use --speculative-config '{\"method\": \"ngram\", ...}'",
    "--spec-model": "use --speculative-config '{\"model\": \"DIR\", ...}'",
    "--spec-tokens": "use --speculative-config '{\"num_speculative_tokens\": N, ...}'",
    "--watermark": "watermarking is not supported", "--watermark-config": "watermarking is not supported",
    "--fail-on-environ-validation": "TOKENMILL_* environment variables are validated at startup already",
    "--enable-fault-tolerance": "a failed worker or device stops the engine; tokenmill serve then exits",
    "--fault-tolerance-config": "a failed worker or device stops the engine; tokenmill serve then exits",
}


#: what an honoured flag's row in the README adds, where "honoured" alone would say too much
HONOURED_NOTES: dict[str, str] = {
    "--gpu-memory-utilization": "a cuda platform option: ignored with a warning on the cpu platform",
    "--cpu-offload-gb": "a cuda platform option: ignored with a warning on the cpu platform; on cuda only 0 "
                        "(offloading weights to host memory is not supported)",
}

#: values of refused flags that ask for what tokenmill does anyway: accepted
INERT: dict[str, tuple[str, ...]] = {
    "--load-format": ("auto", "safetensors"),
    "--tokenizer-mode": ("auto", "hf"),
    "--data-parallel-size": ("1",),
    "--decode-context-parallel-size": ("1",),
    "--prefill-context-parallel-size": ("1",),
}


def expand_vllm_config(argv: list[str]) -> list[str]:
    """``--config FILE`` holding vLLM's flat YAML of flag names (``max-model-len: 256``, as
    ``vllm serve --config`` reads) becomes those flags, placed before the command line's own
    so that these win (vLLM's rule). A YAML of tokenmill's config tree stays a ``--config``."""
    from tokenmill.core.config.engine_config import EngineConfig, read_yaml

    if not argv or argv[0] not in ("serve", "generate"):
        return argv
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        elif arg.startswith("--config="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
        else:
            continue
        data = read_yaml(path)
        if set(data) <= set(EngineConfig.model_fields):
            return argv  # tokenmill's own tree
        flags: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is False or value is None:
                continue  # vLLM's flags are off unless given
            elif isinstance(value, list):
                flags += [flag, *(str(item) for item in value)]
            elif isinstance(value, dict):
                flags += [flag, json.dumps(value)]
            else:
                flags += [flag, str(value)]
        return [rest[0], *flags, *rest[1:]]
    return argv


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Let ``parser`` take the vLLM flags tokenmill does not implement (values and all), so
    that ``refusal`` can name them instead of argparse's "unrecognized arguments"."""
    group = parser.add_argument_group("vLLM flags without a tokenmill equivalent (refused by name; see the README)")
    taken = {option for action in parser._actions for option in action.option_strings}
    for flag in (*ALREADY_SO, *REFUSED):
        if flag not in taken:
            group.add_argument(flag, dest=_dest(flag), nargs="?", const=True, default=None, help=argparse.SUPPRESS)


def refusal(args: argparse.Namespace) -> Optional[str]:
    """The startup error for the first refused flag given, or None."""
    for flag, reason in REFUSED.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and str(value) not in INERT.get(flag, ()):
            return f"{flag} is refused: {reason}"
    return None


def already_so(args: argparse.Namespace) -> list[str]:
    """The given flags that need nothing done, each with why (for one log line)."""
    return [f"{flag}: {why}" for flag, why in ALREADY_SO.items() if getattr(args, _dest(flag), None) is not None]


def _dest(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def markdown_table(honoured: set[str]) -> str:
    """The README's table: every vLLM 0.32 flag and what tokenmill does with it."""
    rows = ["| vLLM flag | tokenmill |", "|---|---|"]
    for flag in VLLM_SERVE_FLAGS:
        if flag in honoured:
            note = HONOURED_NOTES.get(flag)
            rows.append(f"| `{flag}` | honoured{': ' + note if note else ''} |")
        elif flag in ALREADY_SO:
            rows.append(f"| `{flag}` | accepted: {ALREADY_SO[flag]} |")
        else:
            inert = INERT.get(flag)
            accepted = f" ({', '.join(inert)} accepted)" if inert else ""
            rows.append(f"| `{flag}` | refused{accepted}: {REFUSED.get(flag, 'NOT CLASSIFIED')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from tokenmill.cli.command import serve_flags

    print(markdown_table(serve_flags()))
