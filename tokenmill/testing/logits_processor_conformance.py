"""A conformance kit for logits processors (``tokenmill.interfaces.logits_processor``).

Any processor package can use it::

    from tokenmill.testing.logits_processor_conformance import check_logits_processor

    def test_my_processor():
        check_logits_processor(MyProcessor,
                               active_params=[SamplingParams(extra_args={"my_arg": 2})],
                               inactive_params=SamplingParams(),
                               invalid_params=[SamplingParams(extra_args={"my_arg": -1})])

``active_params`` are requests the processor acts on, ``inactive_params`` one it must
leave alone. The kit drives the processor through a scripted, then random, sequence of
batch updates as the model runner makes them (requests joining, finishing, moving,
swapping places, preempted and resumed at another index with their history, the batch
emptied), growing each row's live output list by the token the processed logits choose.
With real float32 logits at every step it asserts that

* a processor built with no rows, or told only about ``inactive_params`` rows, is
  inactive (``is_active`` False) and its ``apply`` leaves the logits unchanged;
* ``apply`` gives the same logits as a processor built fresh for the current batch in
  one update (its state follows the batch updates), also after ``update_state(None)``;
* ``apply`` returns a tensor of the same shape, dtype and device, never changes a row
  with ``inactive_params``, and changes nothing while ``is_active`` is False (the
  sampler would not apply it then);
* a processor declaring ``is_argmax_invariant()`` never changes any row's argmax;
* ``applies_to`` is True for each of ``active_params`` (the runner does not tell the
  processors of a batch whose rows apply to none of them);
* ``validate_params`` accepts the active and inactive params and refuses (ValueError,
  which ``InvalidRequest`` is) each of ``invalid_params``;
* some active row's logits changed at some step: otherwise the run proved nothing.

Each failure is an AssertionError naming the processor, the step, the batch (requests
as ``r<n>``, their params as ``active[i]``/``inactive``) and the update that led there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import torch

from tokenmill.interfaces.logits_processor import (
    AddedRow,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
)
from tokenmill.interfaces.sampling_params import SamplingParams

#: tokens the kit's logits favour, so that prompts and outputs repeat tokens (what n-gram,
#: bad-word and penalty-like processors need to have something to do)
NUM_HOT_TOKENS = 4
HOT_BONUS = 3.0


def default_context(*, vocab_size: int = 64, eos_token_ids: tuple[int, ...] = (1,), max_num_seqs: int = 8,
                    tokenizer: Any = None, device: str | torch.device = "cpu") -> LogitsProcessorContext:
    """The context the kit builds processors with unless given one."""
    return LogitsProcessorContext(vocab_size=vocab_size, eos_token_ids=tuple(eos_token_ids),
                                  max_num_seqs=max_num_seqs, device=torch.device(device), tokenizer=tokenizer)


def check_logits_processor(cls: type[LogitsProcessor], *, context: Optional[LogitsProcessorContext] = None,
                           active_params: Sequence[SamplingParams], inactive_params: SamplingParams,
                           invalid_params: Sequence[SamplingParams] = (), steps: int = 40, seed: int = 0,
                           atol: float = 0.0) -> None:
    """Assert that ``cls`` keeps the LogitsProcessor contract (see the module's docstring).

    ``context``: what the processor is built with (``default_context()``: vocabulary 64, EOS 1,
    8 rows, no tokenizer; pass one with a tokenizer for processors whose arguments are text).
    ``steps``: random batch updates after the scripted ones. ``atol``: how far ``apply`` may be
    from a freshly built processor's (0: the very same values).
    """
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(f"{cls!r} is not a LogitsProcessor subclass (tokenmill.interfaces.logits_processor)")
    if not active_params:
        raise ValueError("active_params: give at least one SamplingParams that activates the processor")
    context = context or default_context()
    if context.max_num_seqs < 4:
        raise ValueError("context.max_num_seqs: the kit needs batches of at least 4 rows")
    _Walk(cls, context, list(active_params), inactive_params, list(invalid_params), steps, seed, atol).run()


@dataclass(eq=False)
class _Request:
    name: str
    params: SamplingParams
    #: "active[i]" or "inactive"
    label: str
    prompt: list[int]
    #: the live output list the processor is given; the kit appends each step's token
    output: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.name}({self.label}, {len(self.output)} out)"


class _Walk:
    def __init__(self, cls: type[LogitsProcessor], context: LogitsProcessorContext,
                 active: list[SamplingParams], inactive: SamplingParams, invalid: list[SamplingParams],
                 steps: int, seed: int, atol: float) -> None:
        self.cls, self.context, self.name = cls, context, cls.__name__
        self.active, self.inactive, self.invalid = active, inactive, invalid
        self.steps, self.atol = steps, atol
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = context.vocab_size
        self.hot = self.rng.sample(range(self.vocab), min(NUM_HOT_TOKENS, self.vocab))
        self.max_rows = context.max_num_seqs
        self.count = 0
        #: the current batch, in row order
        self.batch: list[_Request] = []
        #: requests that left the batch and may come back with their history
        self.preempted: list[_Request] = []
        self.step = 0
        self.history: list[str] = []
        self.changed_active = False

    # ---------------------------------------------------------------- the run

    def run(self) -> None:
        self.check_validate_params()
        self.check_empty()
        self.check_inactive_only()
        self.processor = self.build()
        self.check_applies_to()
        self.script()
        for _ in range(self.steps):
            self.random_step()
        # the batch emptied, then one request again
        self.go([], "every row removed")
        self.go([self.new_request(active=True)], "one new active row")
        assert self.changed_active, (
            f"{self.name}: no row with active_params had its logits changed in {self.step} steps, so this "
            "run proved nothing: do active_params activate the processor (and does the kit's batch give it "
            "anything to do)?")

    def script(self) -> None:
        """The updates every run covers, before the random ones."""
        a0 = self.new_request(active=True, which=0)
        i1 = self.new_request(active=False)
        a2 = self.new_request(active=True, which=1)
        i3 = self.new_request(active=False)
        self.go([a0, i1, a2, i3], "four new rows, active and inactive")
        self.go(list(self.batch), "no change (update_state(None))")
        b = list(self.batch)
        b[0], b[-1] = b[-1], b[0]
        self.go(b, "the first and last rows swap places")
        gone = self.batch[1]
        b = list(self.batch)
        b[1] = b.pop()  # vLLM condenses: the last row fills the hole
        self.go(b, f"{gone.name} at row 1 preempted, the last row moves into its place")
        self.go([gone] + self.batch[1:] + [self.batch[0]],
                f"{gone.name} resumes at row 0 with its history, row 0 moves to the end")
        # preempted and resumed within one update: removed at its index, added at another
        back, done = self.batch[0], self.batch[1]
        self.go(self.batch[2:] + [self.new_request(active=True), back],
                f"{back.name} removed and re-added at the end in the same update, {done.name} finished, "
                "a new row joins before it", readd={back.name})
        self.processor.update_state(None)
        self.go(list(self.batch), "no change, update_state(None) twice")

    def random_step(self) -> None:
        rng = self.rng
        if self.batch and rng.random() < 0.15:
            self.go(list(self.batch), "no change (update_state(None))")
            return
        batch = list(self.batch)
        notes = []
        for _ in range(rng.randint(0, min(2, len(batch)))):
            request = batch.pop(rng.randrange(len(batch)))
            if rng.random() < 0.5:
                self.preempted.append(request)
                notes.append(f"{request.name} preempted")
            else:
                notes.append(f"{request.name} finished")
        for _ in range(rng.randint(0 if batch else 1, max(0, min(3, self.max_rows - len(batch))))):
            if self.preempted and rng.random() < 0.4:
                request = self.preempted.pop(rng.randrange(len(self.preempted)))
                notes.append(f"{request.name} resumes")
            else:
                request = self.new_request(active=rng.random() < 0.6)
                notes.append(f"{request.name} joins")
            batch.insert(rng.randint(0, len(batch)), request)
        shuffle = rng.random()
        if shuffle < 0.3 and len(batch) >= 2:
            i, j = rng.sample(range(len(batch)), 2)
            batch[i], batch[j] = batch[j], batch[i]
            notes.append(f"rows {i} and {j} swap")
        elif shuffle < 0.5:
            rng.shuffle(batch)
            notes.append("rows shuffled")
        self.go(batch, ", ".join(notes) or "no change in membership")

    # ---------------------------------------------------------------- one step

    def go(self, batch: list[_Request], what: str, readd: frozenset[str] | set[str] = frozenset()) -> None:
        """Make ``batch`` the current one, then check ``apply`` and generate a token per row."""
        update = self.update_to(batch, readd)
        self.step += 1
        self.history.append(f"step {self.step}: {what}: {self.describe(update, batch)}")
        self.history = self.history[-6:]
        self.batch = batch
        try:
            self.check_step(update)
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - a processor's crash is reported with the step that caused it
            self.expect(False, f"raised {type(exc).__name__}: {exc}")

    def check_step(self, update: Optional[BatchUpdate]) -> None:
        batch = self.batch
        self.processor.update_state(update)

        fresh = self.build(batch)
        raw = self.logits(len(batch))
        got = self.apply(self.processor, raw)
        want = self.apply(fresh, raw)
        active, fresh_active = self.processor.is_active(), fresh.is_active()
        self.expect(active == fresh_active,
                    f"is_active() is {active}, but {fresh_active} for a processor built fresh for this batch")
        difference = _difference(got, want, self.atol)
        self.expect(difference is None, f"apply differs from a processor built fresh for this batch in one update "
                                        f"(does its state follow removed/moved/added?): {difference}")
        if not active:
            difference = _difference(got, raw, 0.0)
            self.expect(difference is None, f"is_active() is False, but apply changes the logits (the sampler "
                                            f"would skip it and lose the edit): {difference}")
        for index, request in enumerate(batch):
            difference = _difference(got, raw, 0.0, row=index)
            if request.label == "inactive":
                self.expect(difference is None, f"row {index} ({request}) has inactive_params, but apply "
                                                f"changed it: {difference}")
            elif difference is not None:
                self.changed_active = True
        if self.processor.is_argmax_invariant():
            self.check_argmax(raw, got, "the kit's logits")
            probe = self.build(batch)
            uniform = torch.randn(len(batch), self.vocab, generator=self.gen).to(self.context.device) * 4
            self.check_argmax(uniform, self.apply(probe, uniform), "plain random logits")
        for request, token in zip(batch, got.argmax(dim=-1).tolist() if len(batch) else []):
            request.output.append(int(token))

    def check_argmax(self, raw: torch.Tensor, got: torch.Tensor, which: str) -> None:
        for index in range(raw.shape[0]):
            before, after = int(raw[index].argmax()), int(got[index].argmax())
            self.expect(before == after,
                        f"is_argmax_invariant() is True, but apply moved row {index}'s argmax on {which}: from "
                        f"token {before} ({raw[index, before].item():.4g} -> {got[index, before].item():.4g}) to "
                        f"token {after} ({raw[index, after].item():.4g} -> {got[index, after].item():.4g})")

    # ---------------------------------------------------------------- the fixed checks

    def check_validate_params(self) -> None:
        for label, params in [(f"active_params[{i}]", p) for i, p in enumerate(self.active)] + [
                ("inactive_params", self.inactive)]:
            try:
                self.cls.validate_params(params)
            except Exception as exc:  # noqa: BLE001 - any refusal of good params is the failure
                raise AssertionError(f"{self.name}.validate_params refuses {label} ({_short(params)}): "
                                     f"{type(exc).__name__}: {exc}") from exc
        for i, params in enumerate(self.invalid):
            try:
                self.cls.validate_params(params)
            except ValueError:
                continue
            except Exception as exc:  # noqa: BLE001
                raise AssertionError(f"{self.name}.validate_params refuses invalid_params[{i}] with "
                                     f"{type(exc).__name__}, not ValueError or InvalidRequest (the engine makes "
                                     f"only those a 400): {exc}") from exc
            raise AssertionError(f"{self.name}.validate_params accepts invalid_params[{i}] ({_short(params)}): a bad "
                                 "argument would fail at every step instead of being refused at admission")

    def check_applies_to(self) -> None:
        for i, params in enumerate(self.active):
            assert self.processor.applies_to(params), (
                f"{self.name}.applies_to(active_params[{i}]) is False ({_short(params)}), but the processor acts on "
                "such a request: the model runner tells processors nothing of a batch none of them applies to")

    def check_empty(self) -> None:
        processor = self.build()
        assert not processor.is_active(), (
            f"{self.name}: is_active() is True for a processor told about no rows (the default of "
            "LogitsProcessor.is_active): every greedy batch would lose the argmax fast path. Return whether "
            "any row of the current batch is affected.")
        processor.update_state(None)
        assert not processor.is_active(), f"{self.name}: is_active() is True after update_state(None) with no rows"
        raw = self.logits(2)
        difference = _difference(self.apply(processor, raw, "with no rows"), raw, 0.0)
        assert difference is None, f"{self.name}: apply with no rows changes the logits: {difference}"

    def check_inactive_only(self) -> None:
        batch = [self.new_request(active=False) for _ in range(3)]
        processor = self.build(batch)
        assert not processor.is_active(), (
            f"{self.name}: is_active() is True for a batch whose rows all have inactive_params "
            f"({_short(self.inactive)}); a processor no row asked for must not cost greedy batches their fast path")
        raw = self.logits(3)
        difference = _difference(self.apply(processor, raw, "with only inactive rows"), raw, 0.0)
        assert difference is None, f"{self.name}: apply with only inactive_params rows changes the logits: {difference}"

    # ---------------------------------------------------------------- helpers

    def build(self, batch: Optional[list[_Request]] = None) -> LogitsProcessor:
        processor = self.cls(self.context)
        if batch is not None:
            processor.update_state(BatchUpdate(len(batch), added=tuple(
                AddedRow(i, r.params, r.prompt, r.output) for i, r in enumerate(batch))))
        return processor

    def new_request(self, *, active: bool, which: Optional[int] = None) -> _Request:
        if active:
            which = self.rng.randrange(len(self.active)) if which is None else which % len(self.active)
            params, label = self.active[which], f"active[{which}]"
        else:
            params, label = self.inactive, "inactive"
        prompt = [self.token() for _ in range(self.rng.randint(1, 12))]
        self.count += 1
        return _Request(f"r{self.count}", params, label, prompt)

    def token(self) -> int:
        return self.rng.choice(self.hot) if self.rng.random() < 0.6 else self.rng.randrange(self.vocab)

    def logits(self, rows: int) -> torch.Tensor:
        logits = torch.randn(rows, self.vocab, generator=self.gen)
        logits[:, self.hot] += HOT_BONUS
        return logits.to(self.context.device)

    def apply(self, processor: LogitsProcessor, raw: torch.Tensor, when: str = "") -> torch.Tensor:
        where = when or f"at step {self.step}"
        out = processor.apply(raw.clone())
        assert isinstance(out, torch.Tensor), f"{self.name}: apply {where} returned {type(out).__name__}, not a tensor"
        assert out.shape == raw.shape and out.dtype == raw.dtype and out.device == raw.device, (
            f"{self.name}: apply {where} returned {tuple(out.shape)} {out.dtype} on {out.device} for logits "
            f"{tuple(raw.shape)} {raw.dtype} on {raw.device}: it must keep shape, dtype and device")
        return out

    def update_to(self, batch: list[_Request], readd: frozenset[str] | set[str]) -> Optional[BatchUpdate]:
        """The runner's update from the current batch to ``batch``; ``readd``: requests that leave
        and come back within it."""
        old = {r.name: i for i, r in enumerate(self.batch) if r.name not in readd}
        if [r.name for r in batch] == [r.name for r in self.batch] and not readd:
            return None
        kept = {r.name for r in batch}
        removed = tuple(i for i, r in enumerate(self.batch) if r.name not in kept or r.name in readd)
        moved = tuple((old[r.name], j) for j, r in enumerate(batch) if r.name in old and old[r.name] != j)
        added = tuple(AddedRow(j, r.params, r.prompt, r.output) for j, r in enumerate(batch) if r.name not in old)
        return BatchUpdate(len(batch), removed, moved, added)

    @staticmethod
    def describe(update: Optional[BatchUpdate], batch: list[_Request]) -> str:
        if update is None:
            return "update_state(None)"
        parts = [f"batch_size={update.batch_size}"]
        if update.removed:
            parts.append(f"removed={list(update.removed)}")
        if update.moved:
            parts.append(f"moved={[list(m) for m in update.moved]}")
        if update.added:
            parts.append("added=[" + ", ".join(f"{batch[a.index].name}@{a.index}" for a in update.added) + "]")
        return "BatchUpdate(" + ", ".join(parts) + ")"

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            rows = ", ".join(f"{i}: {r}" for i, r in enumerate(self.batch)) or "empty"
            raise AssertionError(f"{self.name}: step {self.step}: {message}\n  batch: {rows}\n  steps so far:\n    "
                                 + "\n    ".join(self.history))


def _short(params: SamplingParams) -> str:
    """``params`` by the fields that differ from the defaults."""
    default = SamplingParams()
    changed = [f"{f.name}={getattr(params, f.name)!r}" for f in fields(params)
               if getattr(params, f.name) != getattr(default, f.name)]
    return f"SamplingParams({', '.join(changed)})"


def _difference(got: torch.Tensor, want: torch.Tensor, atol: float, row: Optional[int] = None) -> Optional[str]:
    """None when equal (inf equal to inf, NaN to NaN), else the first differing entry and how many differ;
    ``row``: compare only that row."""
    if got.shape != want.shape:
        return f"shapes {tuple(got.shape)} and {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    if atol:
        same |= (got - want).abs() <= atol
    if row is not None:
        same[:row] = True
        same[row + 1:] = True
    if bool(same.all()):
        return None
    wrong = torch.nonzero(~same)
    row, token = wrong[0].tolist()
    return (f"row {row} token {token} is {got[row, token].item():.6g}, expected {want[row, token].item():.6g} "
            f"({len(wrong)} entries differ, in rows {sorted(set(wrong[:, 0].tolist()))})")
