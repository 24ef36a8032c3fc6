"""Host-side swap space for preempted requests' KV blocks (preemption_mode: swap).

Only ids live here; the tensors are the model runner's. On a GPU the host pool
would be pinned CPU memory; on a CPU device it is simply a second tensor pool,
so the mechanism is the same and testable.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._held: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_requests(self) -> int:
        """Requests whose KV is here: the swapped ones (released at swap-in or when they end)."""
        return len(self._held)

    def allocate(self, request_id: str, count: int) -> list[int] | None:
        """Host blocks for a request's KV, or None when the space cannot hold them."""
        if count > len(self._free) or request_id in self._held:
            return None
        blocks = [self._free.pop() for _ in range(count)]
        self._held[request_id] = blocks
        return blocks

    def release(self, request_id: str) -> list[int]:
        """Give a request's host blocks back (after swap-in, or when it finishes)."""
        blocks = self._held.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._held.get(request_id, [])
