"""Short full collections of the cyclic garbage collector once an engine is built.

By then the process holds ~370k objects the collector tracks (torch, transformers, the
tokenizer, the model's modules), alive for good. A full (oldest-generation) collection
walks every one of them: ~200 ms on a 2-vCPU host, with every running request stalled
meanwhile, about once per thousand decode steps of 256 requests. Freezing them takes
them out of the collector's view (reference counting still frees them), so later
collections walk only what requests made since: 2-5 ms. vLLM's engine core does the same
after its startup.

Frozen objects are never collected, though, and an offline engine shares its caller's
process: a frozen engine that is dropped (a test's, one a training loop replaces) would keep
its reference cycles, and with them its weights and KV cache (on a GPU, its share of the
device), for the life of the process. So an offline build freezes only what the process held
before its first engine (``freeze_import_heap``: ~2.4 * 10^5 objects after ``from tokenmill
import LLM``); what the build imports (sympy through torch, triton, the model's modules) and
makes stays in view (~9 * 10^4 objects, a full collection ~60 ms on a Zen 3 core against
~4 ms with everything frozen), and a dropped engine is collected. A server or worker
process, whose engine lives as long as it does, freezes the engine too
(``freeze_startup_heap``).
"""

from __future__ import annotations

import atexit
import functools
import gc


def freeze_startup_heap() -> None:
    """Collect what startup left behind, then freeze everything alive."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def freeze_import_heap() -> None:
    """``freeze_startup_heap`` once per process, before its first engine is built."""
    freeze_startup_heap()


@functools.cache
def _unfreeze_at_exit() -> None:
    """The interpreter's last collection then sees these objects again: extension types
    that check at exit that their instances were freed (nanobind's, in triton) stay quiet."""
    atexit.register(gc.unfreeze)
