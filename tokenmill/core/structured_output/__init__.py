"""Structured outputs in the engine: constraints compiled off the step loop (manager.py) and
the batch's token bitmask applied to the logits in one operation (bitmask.py); the per-row
matchers run as a logits processor (core/sample/logits_processors/structured_output.py)."""
