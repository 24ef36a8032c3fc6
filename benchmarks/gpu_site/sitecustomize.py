"""Run by every Python process of the GPU check (gpu_check.sh puts this folder on PYTHONPATH):
where ``TOKENMILL_TRITON_RECORDS`` names a file, each Triton specialization the process uses,
and each compile with its disk-cache hit or miss, is appended to it
(``tokenmill.testing.triton_cache.record``): the check's summary counts the hits, and
``gpu_prepare.py`` compiles the specializations on the CPU next time. It shadows any
``sitecustomize`` of the image's Python."""

import os
import sys

if os.environ.get("TOKENMILL_TRITON_RECORDS"):
    try:
        from tokenmill.testing.triton_cache import record

        record(os.environ["TOKENMILL_TRITON_RECORDS"])
    except Exception as error:  # a process without triton or tokenmill still runs, and says so
        print(f"benchmarks/gpu_site: no Triton records in this process: {error!r}", file=sys.stderr)
