"""Run by every Python process of the GPU check (gpu_check.sh puts this folder on PYTHONPATH):
where ``TOKENMILL_TRITON_RECORDS`` names a file, each Triton specialization the process uses is
appended to it (``tokenmill.testing.triton_cache.record``), for ``gpu_prepare.py`` to compile
on the CPU next time."""

import os
import sys

if os.environ.get("TOKENMILL_TRITON_RECORDS"):
    try:
        from tokenmill.testing.triton_cache import record

        record(os.environ["TOKENMILL_TRITON_RECORDS"])
    except Exception as error:  # a process without triton or tokenmill still runs, and says so
        print(f"benchmarks/gpu_site: no Triton records in this process: {error!r}", file=sys.stderr)
