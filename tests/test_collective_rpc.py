"""``collective_rpc`` (vLLM's name): a worker extension's method on every rank, results in
rank order. The extension is ``contrib/tokenmill-worker-probe``, installed as a separate
package (its entry point reaches every rank); the model runs at TP=2 in worker processes."""

from __future__ import annotations

import os

import pytest

from conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.interfaces.errors import RankCallFailed, WorkerFailed

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2(model_dir):
    with make_llm(model_dir("llama"), tensor_parallel_size=2) as llm:
        yield llm


def test_results_come_back_in_rank_order_from_every_process(tp2):
    infos = tp2.collective_rpc("rank_info")
    assert [info["rank"] for info in infos] == [0, 1]
    assert [info["tp_rank"] for info in infos] == [0, 1] and {info["world_size"] for info in infos} == {2}
    assert infos[0]["pid"] == os.getpid() != infos[1]["pid"]
    # the ranks share this machine's cores, as vLLM binds them (none was configured)
    assert {info["torch_threads"] for info in infos} == {max(1, len(os.sched_getaffinity(0)) // 2)}
    assert tp2.collective_rpc("probe.rank_info") == infos  # the extension's name picks it too


def test_each_rank_answers_for_its_own_shard(tp2, model_dir):
    name = "model.layers.0.mlp.down_proj.weight"  # split by input columns at TP=2
    with make_llm(model_dir("llama")) as one:
        [whole] = one.collective_rpc("parameter_sum", args=(name,))
    halves = tp2.collective_rpc("parameter_sum", kwargs={"name": name})
    assert halves[0] != halves[1] and sum(halves) == pytest.approx(whole, rel=1e-6)


def test_a_raising_worker_fails_the_call_naming_its_rank_and_the_engine_serves_on(tp2):
    before = tp2.generate("count", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(RankCallFailed, match="rank 1: RuntimeError: worker one says no") as failed:
        tp2.collective_rpc("fail_on_rank", args=(1, "worker one says no"))
    assert failed.value.rank == 1
    with pytest.raises(RankCallFailed, match="rank 0: RuntimeError: the driver says no"):
        tp2.collective_rpc("fail_on_rank", args=(0, "the driver says no"))
    assert tp2.collective_rpc("rank_info")[1]["rank"] == 1  # the channel is still in step
    assert tp2.generate("count", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("method,error", [
    ("no_such_method", "no worker extension has a method 'no_such_method'"),
    ("_private", "no worker extension has a method '_private'"),
    ("nope.rank_info", "no worker extension has a method 'nope.rank_info'"),
])
def test_unknown_methods_are_refused_by_name(tp2, method, error):
    with pytest.raises(RankCallFailed, match=error):
        tp2.collective_rpc(method)


def test_results_must_be_json(tp2):
    with pytest.raises(RankCallFailed, match="rank 0: TypeError: first_parameter returned Parameter, which is not JSON"):
        tp2.collective_rpc("first_parameter")
    assert tp2.collective_rpc("rank_info")[1]["rank"] == 1


def test_a_one_rank_engine_runs_a_callable_in_process(model_dir):
    with make_llm(model_dir("llama")) as llm:
        [model] = llm.collective_rpc(lambda worker, offset: (worker.model, worker.rank + offset), args=(5,))
        assert model == (llm.llm_engine.runner.model_step.model, 5)


def test_a_callable_cannot_reach_worker_processes(tp2):
    with pytest.raises(TypeError, match="nothing is pickled"):
        tp2.collective_rpc(lambda worker: worker.rank)


def test_a_call_that_times_out_names_the_rank_and_stops_the_engine(model_dir):
    """A rank still busy with the call cannot run a step: the engine stops (its requests
    fail, a server exits for its supervisor to restart) instead of running out of step."""
    with make_llm(model_dir("llama"), tensor_parallel_size=2) as llm:
        with pytest.raises(TimeoutError, match="rank 1 did not finish collective_rpc within 1 s"):
            llm.collective_rpc("sleep_for", timeout=1, args=(3, 1))
        with pytest.raises(WorkerFailed, match="rank 1 did not finish collective_rpc"):
            llm.generate("count", GREEDY, use_tqdm=False)

