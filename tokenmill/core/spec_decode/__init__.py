"""Speculative decoding on the engine's side: asking the proposer for drafts between steps,
and the models proposers load. Verification is the runner's (core/sample/rejection_sampler)."""
