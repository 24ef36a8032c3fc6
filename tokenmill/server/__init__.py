"""The OpenAI-compatible HTTP server over AsyncLLM."""
