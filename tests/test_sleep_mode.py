"""Sleep and wake (vLLM's ``enable_sleep_mode``, ``sleep(level)``, ``wake_up(tags)``): level 1
frees the KV cache (the cpu platform's weights are host memory already), level 2 the
weights too, which come back from the checkpoint. Measured as the process's resident
memory; the outputs after waking are those before sleeping; asleep, requests are refused."""

from __future__ import annotations

import pytest

from conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.core.engine.rollout import EngineAsleep
from tokenmill.interfaces.errors import ConfigError
from tokenmill.testing.tiny_models import make_tiny_model

KV_BYTES = 256 * 2**20
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def reply(llm):
    [out] = llm.generate(["the same prompt"], PARAMS, use_tqdm=False)[0].outputs
    return list(out.token_ids), [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """54 MB of fp32 weights: enough to see them go."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=512, intermediate_size=1536,
                           num_hidden_layers=4)


def test_memory_drops_asleep_and_outputs_survive_waking(wide_model):
    with make_llm(wide_model, enable_sleep_mode=True, kv_cache_memory_bytes=KV_BYTES) as llm:
        weight_mib = sum(p.numel() * p.element_size() for p in llm.llm_engine.runner.model_step.model.parameters()) \
            / 2**20
        before = reply(llm)
        assert llm.llm_engine.runner.greedy_head is not None  # the platform's fast path for greedy rows
        awake = rss_mib()
        llm.sleep(level=1)
        level1 = rss_mib()
        assert llm.is_sleeping()
        llm.wake_up()
        woken = rss_mib()
        assert reply(llm) == before and llm.llm_engine.runner.greedy_head is not None
        llm.sleep(level=2)
        level2 = rss_mib()
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache still sleeps
        with pytest.raises(EngineAsleep, match="asleep"):
            reply(llm)
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping() and reply(llm) == before
        assert llm.llm_engine.runner.greedy_head is not None  # rebuilt over the reloaded weights
    print(f"RSS MiB: awake {awake:.0f}, level 1 {level1:.0f}, woken {woken:.0f}, level 2 {level2:.0f}")
    kv_mib = KV_BYTES / 2**20
    assert awake - level1 > 0.9 * kv_mib
    assert woken - level1 > 0.9 * kv_mib
    assert woken - level2 > 0.9 * (kv_mib + weight_mib)


def test_requests_while_asleep_are_refused_clearly(model_dir):
    with make_llm(model_dir("llama"), enable_sleep_mode=True) as llm:
        llm.sleep()
        with pytest.raises(EngineAsleep, match=r"the engine is asleep \(level 1\): wake_up first"):
            llm.generate("hi", PARAMS, use_tqdm=False)
        llm.wake_up()
        assert reply(llm)


def test_sleep_needs_the_mode_a_level_and_known_tags(model_dir):
    with make_llm(model_dir("llama")) as plain:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            plain.sleep()
    with make_llm(model_dir("llama"), enable_sleep_mode=True) as llm:
        with pytest.raises(ValueError, match="sleep level 3"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match="unknown wake_up tags"):
            llm.wake_up(tags=["everything"])
        llm.wake_up()  # awake already: nothing to do
        assert not llm.is_sleeping()
    with pytest.raises(ConfigError, match="the speculative proposer's model would keep its own"):
        make_llm(model_dir("llama"), enable_sleep_mode=True,
                 speculative_config={"model": str(model_dir("llama")), "num_speculative_tokens": 2})


def test_every_rank_sleeps_and_wakes_at_tp2(model_dir):
    with make_llm(model_dir("llama"), enable_sleep_mode=True, tensor_parallel_size=2) as llm:
        before = reply(llm)
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            assert reply(llm) == before


def test_sleep_and_reset_prefix_cache_wait_for_running_requests(model_dir):
    """With a request holding blocks, the prefix cache is not reset (False, as vLLM answers)
    and sleep is refused; once it finishes, both go through."""
    with make_llm(model_dir("llama"), enable_sleep_mode=True) as llm:
        engine = llm.llm_engine
        engine.add_request("busy", "a prompt that holds blocks", SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        assert llm.reset_prefix_cache() is False
        with pytest.raises(RuntimeError, match="requests are running"):
            llm.sleep()
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.reset_prefix_cache() is True
        llm.sleep()
        assert llm.is_sleeping()
