"""The LogitsProcessor contract from outside: the built-ins pass the conformance kit, the kit
catches processors that break the contract, and an engine selects processors by registered
name (also one registered only by a test plugin manager) or by ``module:Class`` path."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import yaml

from conftest import make_llm
from tokenmill import LLM, SamplingParams, hookimpl, load_config
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.core.sample.logits_processors import (
    BUILTIN_LOGITS_PROCESSORS,
    AllowedTokenIds,
    BadWords,
    LogitBias,
    MinTokens,
)
from tokenmill.core.sample.logits_processors.bad_words import bad_word_token_ids
from tokenmill.interfaces.errors import ConfigError, InvalidRequest
from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate, LogitsProcessor
from tokenmill.testing.logits_processor_conformance import check_logits_processor, default_context
from tokenmill.testing.tiny_models import train_tokenizer

SP = SamplingParams


def _tokenizer_context():
    tokenizer = train_tokenizer()
    return default_context(vocab_size=len(tokenizer), tokenizer=tokenizer)


#: built-in -> (active params, context factory); "is", "in" are one token in the tiny tokenizer, "the" two
BUILTIN_CASES = {
    AllowedTokenIds: ([SP(allowed_token_ids=[3, 5, 7]), SP(allowed_token_ids=[1])], default_context),
    BadWords: ([SP(bad_words=["is"]), SP(bad_words=["in", "the"])], _tokenizer_context),
    MinTokens: ([SP(min_tokens=6), SP(min_tokens=2, stop_token_ids=[7]), SP(min_tokens=3, ignore_eos=True,
                                                                             stop_token_ids=[9, 1])],
                default_context),
    LogitBias: ([SP(logit_bias={3: 5.0, 9: -100.0}), SP(logit_bias={0: 1.5})], default_context),
}


def test_every_builtin_has_a_conformance_case():
    assert set(BUILTIN_CASES) == set(BUILTIN_LOGITS_PROCESSORS)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cls", BUILTIN_CASES, ids=lambda cls: cls.__name__)
def test_builtin_processors_conform(cls, seed):
    active, context = BUILTIN_CASES[cls]
    check_logits_processor(cls, context=context(), active_params=active, inactive_params=SP(), seed=seed)


# ---------------------------------------------------------------- a processor defined here

class BanToken(LogitsProcessor):
    """``extra_args={"ban": token}``: that token is never generated."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self._rows: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        token = (params.extra_args or {}).get("ban")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
            raise ValueError(f"ban must be a token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, lambda row: (row.params.extra_args or {}).get("ban"))

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self._rows.items():
            logits[row, token] = float("-inf")
        return logits


class NotAProcessor:
    """Has the methods, but is no LogitsProcessor subclass."""

    def __init__(self, context) -> None:
        pass

    def apply(self, logits):
        return logits


class BanTokenPlugin:
    @hookimpl
    def register_logits_processors(self, register):
        register("ban_token", BanToken)
        register("not_a_processor", NotAProcessor)


def test_a_processor_defined_here_conforms():
    check_logits_processor(BanToken, active_params=[SP(extra_args={"ban": 3}), SP(extra_args={"ban": 0})],
                           inactive_params=SP(extra_args={"other": 1}),
                           invalid_params=[SP(extra_args={"ban": -1}), SP(extra_args={"ban": "3"})])


def _plugin_manager():
    pm = make_plugin_manager()
    pm.register_plugin(BanTokenPlugin(), "test-logits-processors")
    return pm


def _greedy(**extra_args):
    return SP(temperature=0, max_tokens=6, ignore_eos=True, extra_args=extra_args or None)


PROMPT = {"prompt_token_ids": [5, 9, 3, 7]}


def _check_bans(llm, baseline):
    """A request with ``ban`` never generates the banned token (its unconstrained first token);
    a request without it in the same batch is unchanged."""
    assert any(isinstance(p, BanToken) for p in llm.llm_engine.runner.sampler.processors)
    banned = baseline[0]
    outputs = llm.generate([PROMPT, PROMPT], [_greedy(ban=banned), _greedy()], use_tqdm=False)
    constrained, plain = (o.outputs[0].token_ids for o in outputs)
    assert banned not in constrained and constrained[0] != banned
    assert plain == baseline


@pytest.fixture(scope="module")
def baseline(model_dir):
    return make_llm(model_dir("llama")).generate([PROMPT], _greedy(), use_tqdm=False)[0].outputs[0].token_ids


def test_a_processor_registered_only_by_a_test_plugin_manager_is_selectable(model_dir, baseline):
    assert "ban_token" not in collect_components(make_plugin_manager()).logits_processors
    llm = LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24,
                                 logits_processors=["ban_token"]), plugin_manager=_plugin_manager())
    _check_bans(llm, baseline)
    with pytest.raises(InvalidRequest, match="BanToken: ban must be a token id") as info:
        llm.generate([PROMPT], _greedy(ban="3"), use_tqdm=False)
    assert info.value.param == "vllm_xargs"


@pytest.mark.parametrize("path", [f"{__name__}:BanToken", f"{__name__}.BanToken"], ids=["colon", "dotted"])
def test_a_processor_given_by_class_path_in_yaml(model_dir, baseline, tmp_path, path):
    """Not registered anywhere: ``module:Class`` (and vLLM's ``module.Class``) in the YAML config."""
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "logits_processors": [path],
                                      "cache": {"kv_cache_memory": 2**24}}))
    _check_bans(LLM.from_config(config), baseline)


def test_an_unknown_name_names_the_registered_ones(model_dir):
    pm = _plugin_manager()
    registered = collect_components(pm).logits_processors.names()
    with pytest.raises(ConfigError) as info:
        LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24,
                               logits_processors=["no_such_processor"]), plugin_manager=pm)
    assert info.value.key == "logits_processors"
    assert "no_such_processor" in str(info.value) and "ban_token" in registered
    for name in registered:
        assert name in str(info.value)


@pytest.mark.parametrize("selected", ["not_a_processor", f"{__name__}:NotAProcessor", "torch:ones"])
def test_what_is_not_a_logits_processor_is_refused(model_dir, selected):
    """By registered name or path: a class that is not a LogitsProcessor subclass, or no class."""
    with pytest.raises(ConfigError, match="is not a LogitsProcessor subclass") as info:
        LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24,
                               logits_processors=[selected]), plugin_manager=_plugin_manager())
    assert info.value.key == "logits_processors" and selected in str(info.value)


# ---------------------------------------------------------------- the kit catches broken processors

class _IgnoresMoves(LogitBias):
    def update_state(self, update):
        if update is not None:
            update = BatchUpdate(update.batch_size, update.removed, (), update.added)
        super().update_state(update)


class _KeepsRemovedRows(LogitBias):
    def update_state(self, update):
        if update is not None:
            update = BatchUpdate(update.batch_size, (), update.moved, update.added)
        super().update_state(update)


class _ForgetsOnNone(LogitBias):
    def update_state(self, update):
        if update is None:
            self._rows.clear()
            self._flat = None
        super().update_state(update)


class _AlwaysActive(LogitBias):
    def is_active(self):
        return True


class _InactiveButApplies(LogitBias):
    def is_active(self):
        return len(self._rows) > 1


class _TouchesEveryRow(LogitBias):
    def apply(self, logits):
        logits = super().apply(logits)
        if self._rows:
            logits[:, 5] -= 1.0
        return logits


class _ClaimsArgmaxInvariance(LogitBias):
    def is_argmax_invariant(self):
        return True


class _ReturnsFloat64(LogitBias):
    def apply(self, logits):
        return super().apply(logits).double()


class _RefusesGoodParams(LogitBias):
    @classmethod
    def validate_params(cls, params):
        if params.logit_bias:
            raise ValueError("no")


class _DeniesItsRows(LogitBias):
    def applies_to(self, params):
        return False


class _DoesNothing(LogitBias):
    def apply(self, logits):
        return logits


BROKEN = [
    (_IgnoresMoves, "differs from a processor built fresh for this batch"),
    # a stale row past the end of the batch: LogitBias indexes out of range, reported with the step
    (_KeepsRemovedRows, "differs from a processor built fresh for this batch|raised IndexError"),
    (_ForgetsOnNone, r"step 2: is_active\(\) is False, but True for a processor built fresh"),
    (_AlwaysActive, "is_active\\(\\) is True for a processor told about no rows"),
    (_InactiveButApplies, r"is_active\(\) is False, but apply changes the logits"),
    (_TouchesEveryRow, "has inactive_params, but apply changed it: row \\d+ token 5"),
    (_ClaimsArgmaxInvariance, "is_argmax_invariant\\(\\) is True, but apply moved row"),
    (_ReturnsFloat64, "torch.float64 .* must keep shape, dtype and device"),
    (_RefusesGoodParams, r"validate_params refuses active_params\[0\] \(SamplingParams\(logit_bias="),
    (_DeniesItsRows, r"applies_to\(active_params\[0\]\) is False"),
    (_DoesNothing, "this run proved nothing"),
]


@pytest.mark.parametrize("cls,message", BROKEN, ids=[cls.__name__.strip("_") for cls, _ in BROKEN])
def test_the_kit_catches_a_broken_processor(cls, message):
    with pytest.raises(AssertionError, match=message) as info:
        check_logits_processor(cls, active_params=[SP(logit_bias={3: 5.0})], inactive_params=SP())
    assert str(info.value).startswith(cls.__name__)


def test_the_kit_catches_a_bad_argument_that_validate_params_accepts():
    with pytest.raises(AssertionError, match=r"accepts invalid_params\[0\]"):
        check_logits_processor(BanToken, active_params=[SP(extra_args={"ban": 3})], inactive_params=SP(),
                               invalid_params=[SP(extra_args={"ban": 3})])


def test_a_reused_request_id_starts_with_fresh_processor_state(model_dir):
    """A request id used again right after its request finished is a new request: it must not
    inherit the old one's processor state (here, its allowed_token_ids)."""
    from conftest import make_llm

    engine = make_llm(model_dir("llama")).llm_engine

    def run(params):
        engine.add_request("same-id", {"prompt_token_ids": [5, 9, 3]}, params)
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        return finals[0].outputs[0].token_ids

    free = run(SP(temperature=0, max_tokens=6, ignore_eos=True))
    assert set(run(SP(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[7, 8]))) <= {7, 8}
    assert run(SP(temperature=0, max_tokens=6, ignore_eos=True)) == free


def test_bad_words_with_tokens_past_the_models_vocabulary_are_never_completed():
    """A tokenizer may hold ids the model's vocabulary lacks (added tokens): the model never
    writes them, so a word with one can never be completed. Indexing the logits with such an
    id would be a device-side assert on a GPU (the engine stops), an IndexError here."""
    tokenizer = train_tokenizer()
    vocab = len(tokenizer)
    tokenizer.add_tokens(["zebraquux"])
    assert tokenizer.encode("zebraquux", add_special_tokens=False) == [vocab]
    processor = BadWords(default_context(vocab_size=vocab, tokenizer=tokenizer))
    processor.update_state(BatchUpdate(2, added=(AddedRow(0, SP(bad_words=["zebraquux", "is"]), [4], []),
                                                 AddedRow(1, SP(bad_words=["zebraquux"]), [4], []))))
    logits = processor.apply(torch.zeros(2, vocab))
    banned = {ids[-1] for ids in bad_word_token_ids(["is"], tokenizer)}  # one token, spaced or not
    assert set(torch.isinf(logits[0]).nonzero().flatten().tolist()) == banned and not torch.isinf(logits[1]).any()


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                "prompt_lookup_max": 2, "disable_by_batch_size": None}],
                         ids=["plain", "ngram"])
def test_processors_hear_of_a_batch_only_while_a_row_applies_to_one(model_dir, speculative):
    """While no row applies to a processor (``applies_to``) the processors are told nothing,
    draft rows included. That is right only once they were told the last processed row left:
    else its state would reach the row that takes its index. A processed request that joins
    later is told in full."""
    from conftest import make_llm

    llm = make_llm(model_dir("llama"), **({"speculative_config": speculative} if speculative else {}))
    engine = llm.llm_engine
    plain = SP(temperature=0, max_tokens=40, ignore_eos=True)  # at most 1 + 7 x 4 tokens by step 8
    forced = SP(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={7: 100.0})
    prompt = {"prompt_token_ids": [5, 9, 3, 5, 9, 3]}
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert alone.count(7) < len(alone)
    drafts_before = engine.scheduler.spec_stats.snapshot().num_drafts if speculative else 0
    engine.add_request("forced-first", {"prompt_token_ids": [4, 4, 2]}, forced)
    engine.add_request("plain", prompt, plain)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 8:  # "forced-first" finished: "plain" has been alone, untold, for a few steps
            assert "forced-first" in finals and "plain" not in finals
            engine.add_request("forced-later", {"prompt_token_ids": [4, 2]}, forced)
        finals.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert finals["forced-first"] == finals["forced-later"] == [7, 7, 7]
    assert finals["plain"] == alone
    if speculative:
        assert engine.scheduler.spec_stats.snapshot().num_drafts > drafts_before
