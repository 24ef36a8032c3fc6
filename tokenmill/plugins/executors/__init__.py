"""The built-in executors: ``uni`` (one process), ``mp`` (worker processes on this machine)
and ``ray`` (Ray actors, on one machine or a cluster; needs ``pip install tokenmill[ray]``)."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_executors(register):
    register("uni", "tokenmill.plugins.executors.uni:UniExecutor")
    register("mp", "tokenmill.plugins.executors.mp:MultiprocessExecutor")
    register("ray", "tokenmill.plugins.executors.ray:RayExecutor")
