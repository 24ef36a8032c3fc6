"""The ``cpu`` platform: tokenmill's CPU tuning behind the Platform contract, and the ``cpu``
attention backend on its kernels."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "tokenmill.plugins.platforms.cpu.platform:CpuPlatform")


@hookimpl
def register_attention_backends(register):
    register("cpu", "tokenmill.plugins.platforms.cpu.attention:CpuAttention")


@hookimpl
def select_attention_backend(device, model_config):
    """The kernels' backend on CPU, unless the model soft-caps attention logits (it cannot)."""
    if device == "cpu" and model_config.hf_config.get("attn_logit_softcapping") is None:
        return "cpu"
    return None
