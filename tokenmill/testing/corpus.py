"""A small fixed English corpus: the tiny tokenizer is trained on it, so it is
deterministic and needs no download."""

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
A language model predicts the next token from the tokens that came before it.
Paged attention stores keys and values in fixed-size blocks, like virtual memory pages.
Continuous batching lets new requests join a running batch at every step.
The scheduler decides which requests run, how many tokens each computes, and who waits.
Prefix caching reuses the blocks of a shared prompt prefix across requests.
When memory runs out, a request is preempted and recomputed later.
Sampling with a temperature makes the output more or less random.
Top-k keeps the k most likely tokens; top-p keeps the smallest set whose probability exceeds p.
Rivers run to the sea, and the sea returns to the clouds as rain over the mountains.
In the morning the market opens, traders shout prices, and the bread is still warm.
She wrote a letter to her brother about the garden, the weather and the new school.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text as often as words do.
Questions end with a question mark? Exclamations end with an exclamation mark!
Code has its own shape: def main(): return 0; for i in range(10): print(i).
The library opened at nine, and the children read stories about dragons and ships.
Engineers measure throughput in tokens per second and latency in milliseconds.
Every good test asserts behaviour that could fail if the code were wrong.
Music, painting and poetry are ways people describe what they feel and see.
The train left the station at noon and arrived in the city before the evening rain.
"""
