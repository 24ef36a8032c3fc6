"""Beam search: a search over ordinary one-token engine requests (vLLM's design) whose beams
are those of Hugging Face's ``generate(num_beams=n, do_sample=False, length_penalty=lp)``."""

from __future__ import annotations

import collections
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import make_llm, random_prompts
from tokenmill import BeamSearchParams, Logprob, SamplingParams
from tokenmill.core.engine.beam_search import BeamSearch, BeamSearchOutput
from tokenmill.interfaces.errors import InvalidRequest

MAX_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one torch thread is faster than two on a shared box, where a
    spinning second thread waits on a busy core. Restored for the tests that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

PROMPTS = random_prompts(count=3, seed=7, low=5, high=40)


# --- Hugging Face references -------------------------------------------------------------
_HF_MODELS: dict[str, torch.nn.Module] = {}


def hf_beams(path, prompt, n, length_penalty, max_new_tokens=MAX_TOKENS):
    """HF's n best beams: (generated tokens, cut after the first EOS, score)."""
    from transformers import AutoModelForCausalLM

    if str(path) not in _HF_MODELS:
        _HF_MODELS[str(path)] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _HF_MODELS[str(path)]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=n, num_return_sequences=n, do_sample=False,
                             length_penalty=length_penalty, max_new_tokens=max_new_tokens, early_stopping=False,
                             return_dict_in_generate=True, output_scores=True)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        generated = sequence[len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        beams.append((generated[:end], score))
    return beams


def assert_matches_hf(path, prompts, outputs, n, length_penalty, tokenizer, max_tokens=MAX_TOKENS):
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert isinstance(output, BeamSearchOutput) and len(output.sequences) == n
        expected = hf_beams(path, prompt, n, length_penalty, max_tokens)
        got = [(seq.tokens[len(prompt):], seq.score) for seq in output.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], (
            f"n={n} lp={length_penalty} prompt={prompt}\n got {got}\n hf  {expected}")
        for (_, score), (_, hf_score) in zip(got, expected):
            assert abs(score - hf_score) < 1e-4, (score, hf_score)
        for seq in output.sequences:
            generated = seq.tokens[len(prompt):]
            assert seq.tokens[:len(prompt)] == prompt
            assert len(seq.logprobs) == len(generated)  # include_stop_str_in_output: EOS kept
            cum = sum(entry[t].logprob for entry, t in zip(seq.logprobs, generated))
            assert abs(seq.cum_logprob - cum) < 1e-4
            assert abs(seq.score - seq.cum_logprob / len(generated) ** length_penalty) < 1e-5
            assert seq.text == tokenizer.decode(generated, skip_special_tokens=True)
            assert seq.finish_reason == ("length" if len(generated) == max_tokens
                                         and seq.stop_reason is None else "stop")


# --- the engine against HF ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [2, 4])
def test_beams_equal_hf(arch, n, model_dir):
    """Every returned beam's tokens and score equal HF's, for several prompts searched
    together and three length penalties."""
    path = model_dir(arch)
    llm = make_llm(path)
    for length_penalty in (1.0, 0.5, 2.0):
        params = BeamSearchParams(beam_width=n, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                  include_stop_str_in_output=True)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert_matches_hf(path, PROMPTS, outputs, n, length_penalty, llm.get_tokenizer())


@pytest.fixture(scope="module")
def eos_models(model_dir, tmp_path_factory):
    """Copies of the tiny Llama whose EOS ids are the tokens it gives most probability, so that beams
    do end with EOS: ``{number of EOS ids: path}``."""
    source = model_dir("llama")
    llm = make_llm(source)
    outputs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(8, seed=0, low=5, high=40)],
                           SamplingParams(temperature=0, max_tokens=12, logprobs=8, ignore_eos=True),
                           use_tqdm=False)
    mass: collections.Counter = collections.Counter()  # probability summed over the top-8 lists
    for output in outputs:
        for entry in output.outputs[0].logprobs:
            mass.update({t: math.exp(logprob.logprob) for t, logprob in entry.items()})
    frequent = sorted(mass, key=lambda t: (-mass[t], t))[:2]
    paths = {}
    for count in (1, 2):
        path = tmp_path_factory.mktemp(f"llama-eos{count}")
        shutil.copytree(source, path, dirs_exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = frequent[0] if count == 1 else frequent
            (path / name).write_text(json.dumps(config))
        paths[count] = path
    return paths


EOS_PROMPTS = random_prompts(count=6, seed=0, low=5, high=40)


@pytest.mark.parametrize("num_eos", [1, 2])
def test_beams_ending_in_eos_equal_hf(num_eos, eos_models):
    """With EOS in the beams, the finished set, the length penalty and the early stop decide
    the result: still HF's beams, and the length penalty changes which win."""
    path = eos_models[num_eos]
    llm = make_llm(path)
    assert len(llm.llm_engine.model_config.eos_token_ids) == num_eos
    results = {}
    for n in (2, 4):
        for length_penalty in (0.5, 1.0, 2.0):
            params = BeamSearchParams(beam_width=n, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                                      include_stop_str_in_output=True)
            outputs = llm.beam_search([{"prompt_token_ids": p} for p in EOS_PROMPTS], params)
            assert_matches_hf(path, EOS_PROMPTS, outputs, n, length_penalty, llm.get_tokenizer())
            results[n, length_penalty] = [[s.tokens for s in o.sequences] for o in outputs]
            reasons = [s.finish_reason for o in outputs for s in o.sequences]
            if length_penalty == 0.5:
                assert "stop" in reasons
    # the length penalty matters: some prompt's beams differ between penalties
    for n in (2, 4):
        assert results[n, 0.5] != results[n, 2.0]


def test_eos_excluded_from_tokens_by_default(eos_models):
    """vLLM's shape: a final EOS is in ``logprobs`` and ``cum_logprob`` but not in ``tokens``
    unless include_stop_str_in_output."""
    llm = make_llm(eos_models[2])
    eos = set(llm.llm_engine.model_config.eos_token_ids)
    kept, dropped = (llm.beam_search([{"prompt_token_ids": p} for p in EOS_PROMPTS],
                                     BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, length_penalty=0.5,
                                                      include_stop_str_in_output=include))
                     for include in (True, False))
    stopped = 0
    for prompt, with_eos, without in zip(EOS_PROMPTS, kept, dropped):
        for a, b in zip(with_eos.sequences, without.sequences):
            assert a.cum_logprob == b.cum_logprob and len(a.logprobs) == len(b.logprobs)
            if a.finish_reason == "stop":
                stopped += 1
                assert a.tokens[-1] in eos and a.stop_reason == a.tokens[-1] and b.tokens == a.tokens[:-1]
            else:
                assert a.tokens == b.tokens and len(b.tokens) == len(prompt) + MAX_TOKENS
    assert stopped > 0


def test_ignore_eos_runs_to_max_tokens(eos_models):
    """ignore_eos makes EOS an ordinary token: every beam has max_tokens tokens; K = 2 * n."""
    llm = make_llm(eos_models[2])
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in EOS_PROMPTS],
                              BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               length_penalty=0.5))
    assert all(s.finish_reason == "length" and len(s.tokens) == len(p) + MAX_TOKENS
               for p, o in zip(EOS_PROMPTS, outputs) for s in o.sequences)
    assert BeamSearch([5], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True), (1, 2)).num_candidates == 8


# --- prefix sharing ----------------------------------------------------------------------
def test_beams_run_as_batched_requests_sharing_prefix_blocks(model_dir):
    """Each round is one generate() call holding every prompt's live beams; from the second
    round on, each beam's request is served the prompt's blocks from the prefix cache."""
    block_size = 8
    llm = make_llm(model_dir("llama"), block_size=block_size)
    prompts = [p[:30] for p in random_prompts(count=2, seed=11, low=30, high=40)]
    rounds = []
    generate = llm.generate

    def spy(prompt_list, params, **kwargs):
        outputs = generate(prompt_list, params, **kwargs)
        rounds.append((params, [p["prompt_token_ids"] for p in prompt_list], outputs))
        return outputs

    llm.generate = spy
    hits_before = llm.llm_engine.scheduler.kv_cache.prefix_hits
    llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=5))
    assert len(rounds) == 5
    params, first, _ = rounds[0]
    assert params.max_tokens == 1 and params.greedy and params.logprobs == 6 and params.ignore_eos
    assert first == prompts  # the first round expands each prompt once
    for _, beams, outputs in rounds[1:]:
        assert len(beams) == 3 * len(prompts)  # all prompts' beams batched together
        for tokens, output in zip(beams, outputs):
            full_prompt_blocks = (len(tokens) - 1) // block_size * block_size
            assert output.num_cached_tokens == full_prompt_blocks > 0
    assert llm.llm_engine.scheduler.kv_cache.prefix_hits > hits_before


def test_beam_search_needs_prefix_caching(model_dir):
    """Without the prefix cache every round would prefill every beam's whole sequence again."""
    llm = make_llm(model_dir("llama"), enable_prefix_caching=False)
    with pytest.raises(InvalidRequest) as info:
        llm.beam_search(["a prompt"], BeamSearchParams(beam_width=2, max_tokens=3))
    assert info.value.param == "use_beam_search"


def test_string_prompts_and_text(model_dir):
    """Text prompts are tokenized as generate() does; ``text`` is the generated part."""
    llm = make_llm(model_dir("llama"))
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    by_text, by_ids = llm.beam_search(text, params), llm.beam_search([ids], params)
    assert len(by_text) == 1 and len(by_ids) == 1
    assert [s.tokens for s in by_text[0].sequences] == [s.tokens for s in by_ids[0].sequences]
    for seq in by_text[0].sequences:
        assert seq.tokens[:len(ids)] == ids
        assert seq.text == tokenizer.decode(seq.tokens[len(ids):], skip_special_tokens=True)


# --- the state machine on hand-made logprobs (a 5-token vocabulary; EOS is 4) -------------
def lp(**values: float) -> dict[int, Logprob]:
    """``lp(t0=-1.0, t4=-2.0)`` -> {0: Logprob(-1.0), 4: Logprob(-2.0)}."""
    return {int(k[1:]): Logprob(v) for k, v in values.items()}


FULL = dict(t0=-2.0, t1=-2.1, t2=-2.2, t3=-2.3, t4=-2.4)


def test_candidates_are_ranked_over_all_beams_by_accumulated_logprob():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=10), eos_token_ids=(4,))
    assert search.num_candidates == 4  # max(2, 1 + 1 EOS id) * 2
    assert search.pending() == [[7]]  # the first step expands the prompt alone
    search.advance([lp(t0=-1.0, t1=-0.5, t2=-2.0, t3=-3.0, t4=-2.5)])
    assert search.pending() == [[7, 1], [7, 0]]  # best first
    assert search.result() == []  # EOS ranked 4th of the K = 4: a spare, not finished
    # the second beam's continuations beat the first's: both new beams descend from it
    search.advance([lp(t0=-3.0, t1=-2.5, t2=-2.0, t3=-4.0, t4=-5.0),
                    lp(t0=-0.2, t1=-1.2, t2=-3.0, t3=-3.1, t4=-6.0)])
    assert search.pending() == [[7, 0, 0], [7, 0, 1]]
    assert not search.done and search.result() == []


def run(search, steps):
    for step in steps:
        search.advance(step)


STEPS = [
    # [7,4] -0.1 finishes (EOS ranked 1st); running [7,0] -0.5, [7,1] -0.7
    [lp(t4=-0.1, t0=-0.5, t1=-0.7, t2=-3.0, t3=-4.0)],
    # top-4: [7,0,0] -0.6, [7,0,4] -0.7 (EOS 2nd: finishes), [7,1,1] -0.75, [7,1,4] -1.0 (EOS 4th: not)
    [lp(t0=-0.1, t4=-0.2, t1=-2.0, t2=-3.0, t3=-3.5),
     lp(t1=-0.05, t4=-0.3, t2=-1.0, t0=-2.0, t3=-3.0)],
    # running [7,0,0,3] -0.7, [7,1,1,2] -1.05
    [lp(t3=-0.1, t0=-1.0, t1=-1.1, t2=-1.2, t4=-5.0),
     lp(t2=-0.3, t0=-2.0, t1=-2.0, t3=-2.0, t4=-4.0)],
    # every continuation costs ~2: the best running beam, -2.7 / 4, cannot beat -0.35 any more
    [lp(**FULL), lp(**FULL)],
]


def test_only_eos_within_the_best_beam_width_finish_and_the_search_stops_early():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=1.0), (4,))
    run(search, STEPS[:2])
    assert [(s.tokens, s.score) for s in search.result()] == [([7], pytest.approx(-0.1)),
                                                              ([7, 0], pytest.approx(-0.7 / 2))]
    assert search.pending() == [[7, 0, 0], [7, 1, 1]]  # [7,1,4] was neither kept nor finished
    run(search, STEPS[2:3])
    assert not search.done  # -0.7 / 3 > -0.35: a running beam may still win
    run(search, STEPS[3:])
    assert search.done and search.pending() == []  # at 4 of 10 tokens
    result = search.result()
    assert [s.finish_reason for s in result] == ["stop", "stop"]
    assert [s.stop_reason for s in result] == [4, 4]
    assert [len(s.logprobs) for s in result] == [1, 2]
    assert result[1].cum_logprob == pytest.approx(-0.7)
    with pytest.raises(RuntimeError):
        search.advance([lp(**FULL)])


def test_length_penalty_divides_by_generated_length_including_eos():
    """With length_penalty=0 scores are raw sums: [7,0,4] (-0.7) ranks below, and the
    heuristic (-0.6 > -0.7 after step 2, then -0.7 > -0.7 fails) stops one step earlier."""
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=0.0,
                                              include_stop_str_in_output=True), (4,))
    run(search, STEPS[:2])
    assert not search.done
    run(search, STEPS[2:3])
    assert search.done
    assert [(s.tokens, s.score) for s in search.result()] == [([7, 4], pytest.approx(-0.1)),
                                                              ([7, 0, 4], pytest.approx(-0.7))]
    # a length penalty of 3 favours the longer one: -0.7 / 2**3 > -0.1 / 1
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=3.0), (4,))
    run(search, STEPS[:2])
    assert [s.tokens for s in search.result()] == [[7, 0], [7]]


def test_no_improvement_possible_is_a_strict_comparison():
    """HF goes on only while the best live beam's score is *above* the worst finished one:
    here -1.5 / 3 ** 1 ties with -1.0 / 2 ** 1, so the search ends."""
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=10), (4,))
    others = dict(t0=-3.99, t1=-3.99, t2=-3.99, t3=-3.99)
    # [7,0] -0.25 runs, [7,4] -0.5 finishes (EOS 2nd), [7,1] -0.75 runs
    search.advance([lp(t0=-0.25, t4=-0.5, t1=-0.75, t2=-3.0, t3=-3.0)])
    # [7,1,2] -0.875 runs, [7,0,4] -1.0 finishes (score -0.5); finished: -0.5, -0.5
    search.advance([lp(t4=-0.75, **{k: -2.25 for k in ("t0", "t1", "t2", "t3")}),
                    lp(t2=-0.125, t0=-2.0, t1=-2.0, t3=-2.0, t4=-2.0)])
    assert [s.score for s in search.result()] == [-0.5, -0.5]
    assert not search.done  # -0.875 / 2 > -0.5
    # the best live beam: [7,1,2,3] -1.5, scored -0.5 at 3 tokens: no better than -0.5
    search.advance([lp(t3=-0.625, t4=-4.0, t0=-3.0, t1=-3.0, t2=-3.0), lp(**others)])
    assert search.done
    assert [s.tokens for s in search.result()] == [[7], [7, 0]]


def test_candidate_count_follows_the_eos_ids():
    """HF's beams_to_keep: max(2, 1 + EOS ids) * beam_width; the engine is asked for that many."""
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    assert [BeamSearch([5], params, eos).num_candidates for eos in [(), (1,), (1, 2), (1, 2, 3)]] == [6, 6, 9, 12]


def test_max_tokens_finishes_the_best_beam_width_candidates():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=2), (4,))
    run(search, [[lp(t0=-0.5, t1=-0.7, t2=-3.0, t3=-4.0, t4=-5.0)],
                 [lp(t2=-0.1, t3=-0.2, t0=-3.0, t1=-3.0, t4=-0.15),
                  lp(t1=-0.01, t0=-9.0, t2=-9.0, t3=-9.0, t4=-9.0)]])
    assert search.done
    result = search.result()
    # candidates: [7,0,2] -0.6, [7,0,4] -0.65 (EOS), [7,0,3] -0.7, [7,1,1] -0.71: the best two finish
    assert [(s.tokens, s.finish_reason) for s in result] == [([7, 0, 2], "length"), ([7, 0], "stop")]
    assert [s.score for s in result] == pytest.approx([-0.6 / 2, -0.65 / 2])


def test_scores_are_float32_like_hf():
    """HF accumulates and divides in float32; so does the search."""
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=1.0), ())
    search.advance([lp(t0=-0.1, t1=-3.0)])
    value = search.result()[0].cum_logprob
    assert value == float(torch.tensor(-0.1, dtype=torch.float32))
    assert search.num_candidates == 2


# --- bad parameters ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=1.5, max_tokens=4), "beam_width"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),  # 2 * 11 logprobs > 20
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=None), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
])
def test_bad_params_are_refused(kwargs, param):
    with pytest.raises(InvalidRequest) as info:
        BeamSearchParams(**kwargs)
    assert info.value.param == param


def test_too_many_candidates_and_bad_calls_are_refused(eos_models, model_dir):
    # 7 beams with 2 EOS ids need max(2, 3) * 7 = 21 logprobs per step, past the cap of 20
    with pytest.raises(InvalidRequest) as info:
        BeamSearch([5], BeamSearchParams(beam_width=7, max_tokens=4), (1, 2))
    assert info.value.param == "beam_width" and "21" in str(info.value)
    BeamSearch([5], BeamSearchParams(beam_width=7, max_tokens=4, ignore_eos=True), (1, 2))  # 14: fine
    llm = make_llm(eos_models[2])
    with pytest.raises(InvalidRequest, match="beam_width"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=7, max_tokens=4))
    with pytest.raises(InvalidRequest) as info:
        llm.beam_search([[5, 6, 7]], SamplingParams(n=2))
    assert info.value.param == "params"
    with pytest.raises(InvalidRequest) as info:
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=llm.llm_engine.max_model_len))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=4))


def test_exported_without_importing_torch():
    code = ("import sys, tokenmill; assert 'torch' not in sys.modules; "
            "tokenmill.BeamSearchParams(beam_width=2, max_tokens=3); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
