"""The worker side: KV-cache tensors (kv_cache) and running one scheduled step on the model
(model_runner)."""
