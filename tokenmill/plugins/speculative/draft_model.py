"""A smaller model with the same tokenizer proposes by greedy decoding (vLLM's
``draft_model`` method: ``speculative: {model: ./draft, num_speculative_tokens: 3}``).

Each round first feeds the draft the request's tokens it has not seen (the prompt, the first
time; afterwards the tokens the last step verified, which overwrite its guesses' KV), then
decodes one token per forward pass, all requests together, until each has its
``max_draft_tokens`` (``ProposerModel.greedy_decode``: the passes chain on the device, and
the drafts are read back once). Greedy drafts are deterministic, so the rejection sampler treats them
as one-hot proposals: exact for sampled requests too.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.speculative import DraftRequest, ForwardRow, ProposerContext, SpeculativeProposer


class DraftModelProposer(SpeculativeProposer):
    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        path = context.options["model"]
        self.model = context.load_model(path)
        if self.model.vocab_size != context.vocab_size:
            raise ConfigError("speculative.model", f"the draft model's vocabulary has {self.model.vocab_size} "
                                                   f"tokens, the target's {context.vocab_size}: a draft must share "
                                                   "the target's tokenizer")
        #: per request: leading tokens whose draft KV is the real tokens'
        self._computed: dict[str, int] = {}

    @property
    def num_lookahead_slots(self) -> int:
        # the guesses' KV: d_1 .. d_{k-1} are fed back, at positions after the request's tokens
        return self.context.num_speculative_tokens

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        rows = []
        for request in requests:
            # a request not scheduled since its last proposal re-feeds its last token
            computed = min(self._computed.get(request.request_id, 0), len(request.token_ids) - 1)
            rows.append(ForwardRow(request.token_ids[computed:], computed, request.block_ids))
            self._computed[request.request_id] = len(request.token_ids)
        return self.model.greedy_decode(rows, [request.max_draft_tokens for request in requests])

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._computed.pop(request_id, None)

    def describe(self) -> dict[str, str]:
        return {"draft_model": str(self.context.options["model"])}
