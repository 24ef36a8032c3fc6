"""The engine: building it from config (builder), the step loop (llm_engine), its offline
(llm) and asyncio (async_llm) front ends, requests, and turning sampled tokens into text and
finished outputs (output_processor, detokenizer: all stop logic)."""
