"""Triton paged attention (GPU; CPU tests run the kernels with TRITON_INTERPRET=1)."""
