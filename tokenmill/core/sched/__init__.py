"""Scheduling: which requests run each step (scheduler) and the paged KV blocks they hold
(kv_cache_manager, block_pool, swap_space)."""
