"""The third-party backend passes tokenmill's attention conformance kit."""

import pytest

from tokenmill.testing.attention_conformance import check_backend, conformance_cases
from tokenmill_flat_attention import FlatAttention


@pytest.mark.parametrize("case", conformance_cases(200, seed=3), ids=str)
def test_flat_backend_conforms(case):
    """Output and cache equal the torch reference on every randomized case."""
    check_backend(FlatAttention(), case)


def test_a_bf16_kv_cache_is_refused_with_the_reason(tmp_path):
    """flat declares no kv_cache_dtypes (it stores K/V in the compute dtype only), so asking
    for a bf16 cache under fp32 fails at startup, naming the backend and the setting."""
    from tokenmill import LLM
    from tokenmill.interfaces.errors import ConfigError
    from tokenmill.testing.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ConfigError, match="backend 'flat' cannot run this model: cache.kv_cache_dtype bfloat16"):
        LLM(str(path), attention_backend="flat", kv_cache_dtype="bfloat16", kv_cache_memory_bytes=32 * 2**20)
