"""A built engine freezes the heap of imports, so the collector's full collections walk only
what the build imported and made and what requests allocate, not the ~10^5 objects of torch
and transformers imported before it; the engines stay collectable."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from conftest import make_llm


def test_an_engine_build_freezes_what_the_process_held_before_it(model_dir):
    """In a process of its own, as a user's: everything alive before the first engine (torch,
    transformers, tokenmill) is frozen, so full collections walk what the build imported and
    made and not that; a second build freezes nothing more (its engine stays collectable)."""
    script = ("import gc, sys\nfrom tokenmill import LLM\ngc.collect()\nbefore = len(gc.get_objects())\n"
              "first = LLM(sys.argv[1], kv_cache_memory_bytes=2**24)\nfrozen = gc.get_freeze_count()\n"
              "second = LLM(sys.argv[1], kv_cache_memory_bytes=2**24)\n"
              "print(before, frozen, gc.get_freeze_count())")
    result = subprocess.run([sys.executable, "-c", script, str(model_dir("llama"))], capture_output=True, text=True,
                            timeout=300, check=True)
    before, frozen, after_second = map(int, result.stdout.split()[-3:])
    assert before > 10**5 and frozen >= before and after_second <= frozen, (before, frozen, after_second)


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
