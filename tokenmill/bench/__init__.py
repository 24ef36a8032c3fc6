"""``tokenmill bench throughput | latency | serve``: vLLM's ``vllm bench`` subcommands and
flag names, installed with the package, each comparing tokenmill with a peer on the same
weights in the same run (HF transformers; llama.cpp with ``--llama-cpp DIR``).

The repository's ``benchmarks/`` keeps the recorded results, charts and the project's other
measurements (priority, quantization, LoRA, soak, revision-to-revision comparisons).
"""
