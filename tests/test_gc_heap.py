"""A built engine freezes the startup heap, so the collector's full collections walk only
what requests allocate, not the ~10^5 objects of torch, transformers and the model."""

from __future__ import annotations

import gc

from conftest import make_llm


def test_a_built_engine_leaves_full_collections_little_to_walk(model_dir):
    gc.unfreeze()  # whatever an earlier engine of this process froze
    make_llm(model_dir("llama"))
    frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
    assert frozen > 10 * tracked, (frozen, tracked)
