"""vLLM 0.32's weight-transfer cycle (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``): after an update the engine's tokens and
logprobs are transformers' on the new weights (fp32, 1e-4), with the cpu platform's packed
copies, GEMV weights and int8 greedy head rebuilt; a refused update leaves the old weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.core.engine.rollout import WeightsIncomplete
from tokenmill.interfaces.errors import RankCallFailed
from tokenmill.interfaces.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

PROMPTS = [list(range(5, 17)), list(range(40, 47))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
TRANSFER = {"weight_transfer_config": {"backend": "in_process"}}


def perturbed(path, seed: int = 1, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, each moved by noise of ``scale`` times its own spread."""
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + scale * tensor.std().nan_to_num() * torch.randn(tensor.shape, generator=generator)
            for name, tensor in load_file(path / "model.safetensors").items()}


def hf_greedy(path, weights: dict[str, torch.Tensor], prompt: list[int], steps: int):
    """transformers' greedy tokens and their logprobs with ``weights`` loaded."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            ids.append(int(row.argmax()))
            logprobs.append(row[ids[-1]].item())
    return ids[len(prompt):], logprobs


def push(llm, weights: dict[str, torch.Tensor], version: str) -> None:
    llm.start_weight_update()
    llm.update_weights(WeightTransferUpdateRequest(update_info={"weights": weights}))
    llm.finish_weight_update(version)


def assert_matches_hf(llm, path, weights) -> None:
    for prompt in PROMPTS:
        expected_tokens, expected_logprobs = hf_greedy(path, weights, prompt, GREEDY.max_tokens)
        [fast] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs  # greedy head
        [full] = llm.generate([{"prompt_token_ids": prompt}], GREEDY_LOGPROBS, use_tqdm=False)[0].outputs
        assert list(fast.token_ids) == list(full.token_ids) == expected_tokens
        got = [entry[token].logprob for token, entry in zip(full.token_ids, full.logprobs)]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs)) < 1e-4


def test_an_update_serves_the_new_weights_with_every_fast_path_rebuilt(model_dir):
    path = model_dir("llama")
    with make_llm(path, dtype="float32", **TRANSFER) as llm:
        model_step = llm.llm_engine.runner.model_step
        assert model_step.greedy_head is not None  # the int8 screen is on: it must be rebuilt too
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        assert llm.get_weight_version() is None
        for seed in (1, 2):
            weights = perturbed(path, seed)
            push(llm, weights, f"step-{seed}")
            assert llm.get_weight_version() == f"step-{seed}"
            assert_matches_hf(llm, path, weights)
        # a part of the model alone (vLLM's chunked updates): the rest stays as it was
        part = {name: tensor for name, tensor in perturbed(path, 3).items() if ".mlp." in name}
        push(llm, part, "mlp-only")
        assert_matches_hf(llm, path, {**perturbed(path, 2), **part})


@pytest.mark.parametrize("update_info,error", [
    ({"names": ["model.layers.0.mlp.nope.weight"], "dtype_names": ["float32"], "shapes": [[4]]},
     "no such weights in this model: model.layers.0.mlp.nope.weight"),
    ({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[3]]},
     r"model.norm.weight: shape \[3\], the model's is"),
    ({"names": ["model.norm.weight"], "dtype_names": ["int64"], "shapes": [[64]]},
     "model.norm.weight: dtype 'int64' is not a 16- or 32-bit float"),
    ({"names": ["model.norm.weight"], "dtype_names": [], "shapes": [[64]]}, "differ in length"),
    ({"names": [], "dtype_names": [], "shapes": [], "packed": True}, "update_info takes names"),
])
def test_a_refused_update_leaves_the_old_weights(update_info, error, model_dir):
    path = model_dir("llama")
    with make_llm(path, dtype="float32", **TRANSFER) as llm:
        before = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY_LOGPROBS, use_tqdm=False)[0].outputs[0]
        llm.init_weight_transfer_engine({"init_info": {}})
        llm.start_weight_update()
        with pytest.raises(ValueError, match=error):
            llm.update_weights({"update_info": update_info})
        weights = perturbed(path)
        with pytest.raises(ValueError, match="no such weights"):  # one bad name refuses the whole update
            llm.update_weights({"update_info": {"weights": {**weights, "lm_head.bias": weights["model.norm.weight"]}}})
        llm.finish_weight_update()
        after = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY_LOGPROBS, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == before.token_ids
    assert [e[t].logprob for t, e in zip(after.token_ids, after.logprobs)] == \
        [e[t].logprob for t, e in zip(before.token_ids, before.logprobs)]


def test_no_kv_of_the_old_weights_is_a_prefix_hit_after_an_update(model_dir):
    """The prefix cache is emptied by the update even while a request runs (held blocks too),
    and that request, whose KV came from the old weights, registers no block afterwards: a
    repeated prompt is computed afresh on the new weights, and so is the running one's."""
    path = model_dir("llama")
    with make_llm(path, dtype="float32", block_size=8, **TRANSFER) as llm:
        engine = llm.llm_engine
        prompt = list(range(5, 45))  # five full blocks
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)  # old-weight KV, cached
        busy = list(range(60, 90))
        engine.add_request("busy", {"prompt_token_ids": busy}, SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()
        llm.init_weight_transfer_engine({"init_info": {}})
        weights = perturbed(path)
        push(llm, weights, "v1")
        assert engine.scheduler.kv_cache.pool.num_cached_blocks == 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                reply = list(output.outputs[0].token_ids)
        # the busy prompt's 3 full blocks come back, computed on the new weights; the 2 blocks of
        # the reply after them came in part from old-weight KV, so never become hits behind them
        for again, hits in ((prompt, 0), (busy, 0), (busy + reply[:10], 24)):
            [out] = llm.generate([{"prompt_token_ids": again}], GREEDY, use_tqdm=False)
            assert out.num_cached_tokens == hits
            assert list(out.outputs[0].token_ids) == hf_greedy(path, weights, again, GREEDY.max_tokens)[0]


def test_an_update_on_the_device_replays_the_recorded_graphs_and_a_moved_tensor_records_them_again(
        model_dir, monkeypatch):
    """On the cuda platform (the CUDA stand-in, whose graphs hold addresses, not references) an
    update copies into the tensors the decode graphs read, so they replay as recorded: a
    trainer's update records no bucket again, and the tokens and logprobs are transformers' on
    the new weights. A loader that replaces a tensor instead (a new address) gets its graphs
    recorded again; kept, they would read freed memory."""
    from test_device_boundaries import fake_cuda_llm
    from tokenmill.testing.fake_cuda import fake_cuda

    path = model_dir("llama")
    with fake_cuda():
        llm = fake_cuda_llm(path, max_num_seqs=2, **TRANSFER)  # graphs of 2 and 1 rows: decode steps replay
        platform, model = llm.llm_engine.platform, llm.llm_engine.runner.model
        recorded = len(platform.graphs)
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        weights = perturbed(path, 1)
        graphs = llm.llm_engine.runner.model_step.graphs
        push(llm, weights, "in-place")
        assert len(platform.graphs) == recorded and llm.llm_engine.runner.model_step.graphs is graphs
        assert_matches_hf(llm, path, weights)

        load = model.load_weights
        norm = model.get_parameter("model.norm.weight")
        old = []  # kept alive: no later tensor can take their addresses

        def load_into_a_new_tensor(named):
            old.append(norm.data)
            norm.data = norm.data.clone()  # another address, which the update then writes
            return load(named)

        monkeypatch.setattr(model, "load_weights", load_into_a_new_tensor)
        weights = perturbed(path, 2)
        push(llm, weights, "moved")
        assert_matches_hf(llm, path, weights)
        assert len(platform.graphs) == recorded + 2


def test_sleep_at_level_2_forgets_the_update(model_dir):
    """Level 2 frees the weights and wakes with the checkpoint's: the version goes with them."""
    path = model_dir("llama")
    with make_llm(path, dtype="float32", enable_sleep_mode=True, **TRANSFER) as llm:
        original = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.init_weight_transfer_engine({"init_info": {}})
        push(llm, perturbed(path), "v1")
        llm.sleep(level=1)
        llm.wake_up()
        assert llm.get_weight_version() == "v1"
        llm.sleep(level=2)
        llm.wake_up()
        assert llm.get_weight_version() is None
        assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids \
            == original


def test_a_failed_update_stops_serving_until_an_update_succeeds(model_dir, monkeypatch):
    """An update that fails midway may leave part old, part new weights: requests are refused
    (a 503 on the server) until an update goes through and is finished."""
    path = model_dir("llama")
    with make_llm(path, dtype="float32", **TRANSFER) as llm:
        llm.init_weight_transfer_engine({"init_info": {}})
        model, tensors = llm.llm_engine.runner.model, []
        load = model.load_weights

        def failing(weights):
            tensors.append(weights)
            if len(tensors) == 3:
                raise RuntimeError("the trainer went away")
            return load(weights)

        monkeypatch.setattr(model, "load_weights", failing)
        weights = perturbed(path)
        llm.start_weight_update()
        with pytest.raises(RankCallFailed, match="the trainer went away"):
            llm.update_weights({"update_info": {"weights": weights}})
        llm.finish_weight_update("broken")
        with pytest.raises(WeightsIncomplete, match="failed midway"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        monkeypatch.undo()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"weights": weights}})
        with pytest.raises(WeightsIncomplete):  # not finished yet
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        llm.finish_weight_update("v2")
        assert_matches_hf(llm, path, weights)


def test_updates_need_the_config_and_an_unquantized_model(model_dir, tmp_path):
    from tokenmill.testing.quantize import quantize_model

    with make_llm(model_dir("llama")) as plain:
        with pytest.raises(ValueError, match="build it with weight_transfer_config"):
            plain.init_weight_transfer_engine({"init_info": {}})
    with make_llm(model_dir("llama"), **TRANSFER) as llm:
        with pytest.raises(RuntimeError, match="call init_weight_transfer_engine first"):
            llm.start_weight_update()
    quantized = quantize_model(model_dir("llama"), tmp_path / "q", "gptq", bits=4, group_size=32)
    with make_llm(quantized, **TRANSFER) as llm:
        with pytest.raises(ValueError, match="quantized model"):
            llm.init_weight_transfer_engine({"init_info": {}})


def test_every_rank_applies_its_shard_at_tp2(model_dir):
    """TP=2 in worker processes: rank 0 broadcasts the trainer's tensors over the engine's own
    group; each rank cuts its columns, rows, fused q/k/v and gate/up parts and vocabulary
    range out of the full tensors."""
    path = model_dir("llama")
    name = "model.layers.0.mlp.down_proj.weight"
    with make_llm(path, dtype="float32", tensor_parallel_size=2, **TRANSFER) as llm:
        llm.init_weight_transfer_engine({"init_info": {}})
        before = llm.collective_rpc("parameter_sum", args=(name,))
        weights = perturbed(path)
        push(llm, weights, "tp2")
        after = llm.collective_rpc("parameter_sum", args=(name,))
        assert all(a != b for a, b in zip(after, before))
        assert sum(after) == pytest.approx(weights[name].double().sum().item(), rel=1e-5)
        assert_matches_hf(llm, path, weights)


def test_a_failing_rank_is_named(model_dir):
    with make_llm(model_dir("llama"), tensor_parallel_size=2, weight_transfer_config={"backend": "gloo"}) as llm:
        with pytest.raises(RankCallFailed, match="init_info needs master_address, master_port, world_size"):
            llm.init_weight_transfer_engine({"init_info": {}})
