"""The ``cuda`` platform: NVIDIA GPUs through PyTorch, with the Triton attention backend."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    register("cuda", "tokenmill.plugins.platforms.cuda.platform:CudaPlatform")


@hookimpl
def select_attention_backend(device, model_config):
    """The Triton paged-attention backend on CUDA (decode and tiled prefill kernels)."""
    if device == "cuda":
        return "triton"
    return None
