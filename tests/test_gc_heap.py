"""A built engine freezes the heap of imports, so the collector's full collections walk only
the engines and what requests allocate, not the ~10^5 objects of torch and transformers; the
engines stay collectable."""

from __future__ import annotations

import gc
import weakref

from conftest import make_llm


def test_a_built_engine_leaves_full_collections_little_to_walk(model_dir):
    llm = make_llm(model_dir("llama"))
    gc.collect()  # the engines earlier tests of this process dropped
    frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
    assert llm.llm_engine is not None
    assert frozen > 10 * tracked, (frozen, tracked)


def test_a_dropped_engine_is_collected(model_dir):
    """Frozen, a dropped engine (its reference cycles, its weights and KV cache) lived as long
    as the process: on an H200, four GPU test workers' earlier engines held 127 of its 140
    GiB. An engine dropped, a second built beside it too, is collected."""
    first = make_llm(model_dir("llama"))
    second = make_llm(model_dir("llama"))
    engines = [weakref.ref(first.llm_engine), weakref.ref(second.llm_engine)]
    del first, second
    gc.collect()
    assert [engine() for engine in engines] == [None, None]
