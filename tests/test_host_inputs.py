"""A step's flat host inputs (``HostInputs.of``) against their definition row by row: each
row's block ids in the leading columns of its table row and zeros after them, positions
that continue each row's computed tokens, and each new token's KV slot in its block. Both
ways of working them out (Python for a few rows, numpy for many) are held to it, with the
dtypes the attention backends and the graphs' buffers take."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.distributed.messages import Row
from tokenmill.core.worker.model_step import HostInputs

BLOCK_SIZE = 4


@st.composite
def rows(draw) -> list[Row]:
    made = []
    for _ in range(draw(st.integers(1, 12))):
        computed = draw(st.integers(0, 40))
        new = draw(st.integers(1, 6))
        blocks = -(-(computed + new) // BLOCK_SIZE) + draw(st.integers(0, 3))  # at least the tokens' blocks
        ids = draw(st.lists(st.integers(1, 10_000), min_size=blocks, max_size=blocks))
        made.append(Row(draw(st.lists(st.integers(0, 99), min_size=new, max_size=new)), computed, ids))
    return made


@pytest.mark.parametrize("make", [HostInputs.of_few, HostInputs.of_many], ids=["few", "many"])
@settings(max_examples=200, deadline=None)
@given(step_rows=rows())
def test_host_inputs_follow_each_row(make, step_rows):
    host = make(step_rows, BLOCK_SIZE)
    assert [a.dtype for a in (host.token_ids, host.positions, host.query_lens, host.query_start, host.seq_lens,
                              host.block_table, host.slots)] == [np.int64] * 5 + [np.int32, np.int64]
    width = max(len(row.block_ids) for row in step_rows)
    assert host.block_table.shape == (len(step_rows), width)
    flat = 0
    for i, row in enumerate(step_rows):
        assert host.block_table[i].tolist() == row.block_ids + [0] * (width - len(row.block_ids))
        assert host.seq_lens[i] == row.num_computed_tokens + len(row.token_ids)
        for j, token in enumerate(row.token_ids):
            position = row.num_computed_tokens + j
            assert host.token_ids[flat] == token and host.positions[flat] == position
            assert host.slots[flat] == row.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            flat += 1
    assert host.query_start.tolist() == [0, *(sum(len(r.token_ids) for r in step_rows[:i + 1])
                                              for i in range(len(step_rows)))]
