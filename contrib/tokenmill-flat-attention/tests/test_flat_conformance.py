"""The third-party backend passes tokenmill's attention conformance kit."""

import pytest

from tokenmill.testing.attention_conformance import check_backend, conformance_cases
from tokenmill_flat_attention import FlatAttention


@pytest.mark.parametrize("case", conformance_cases(200, seed=3), ids=str)
def test_flat_backend_conforms(case):
    """Output and cache equal the torch reference on every randomized case."""
    check_backend(FlatAttention(), case)
