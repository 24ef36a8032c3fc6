"""The ``ray`` executor on a real local Ray cluster: worker ranks as actors in a placement group."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import make_llm
from test_distributed import generate
from tokenmill.interfaces.errors import ComponentUnavailable
from tokenmill.testing.hf_reference import assert_matches_reference

ray = pytest.importorskip("ray", reason="the ray executor's tests need ray (pip install 'tokenmill[ray]')")


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on 127.0.0.1 with two worker slots and a bounded object store, for this module only."""
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("arch,parallel", [("llama-mqa-bias", dict(tensor_parallel_size=2)),
                                           ("mixtral", dict(tensor_parallel_size=2)),
                                           ("qwen2-tied", dict(pipeline_parallel_size=2))])
def test_parallel_under_ray_matches_hf(arch, parallel, ray_cluster, model_dir, hf_reference):
    with make_llm(model_dir(arch), distributed_executor_backend="ray", **parallel) as llm:
        assert type(llm.llm_engine.workers.executor).__name__ == "RayExecutor"
        _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)
    deadline = time.monotonic() + 15  # Ray returns a removed placement group's CPUs asynchronously
    while ray.available_resources().get("CPU") != 2:
        assert time.monotonic() < deadline, f"Ray still holds resources: {ray.available_resources()}"
        time.sleep(0.2)


def test_ray_executor_without_ray_says_how_to_install_it(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    with pytest.raises(ComponentUnavailable, match=r"pip install 'tokenmill\[ray\]'"):
        make_llm(model_dir("llama"), tensor_parallel_size=2, distributed_executor_backend="ray")
