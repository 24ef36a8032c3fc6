"""Helpers shipped for tests, benchmarks and docs: tiny models, HF reference runs."""
