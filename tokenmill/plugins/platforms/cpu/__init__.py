"""The ``cpu`` platform: tokenmill's CPU tuning behind the Platform contract."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "tokenmill.plugins.platforms.cpu.platform:CpuPlatform")
