"""Sampling: logits to tokens and logprobs, per request's parameters."""
