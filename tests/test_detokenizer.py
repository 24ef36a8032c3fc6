"""Incremental detokenization equals batch decoding, including multi-byte characters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.engine.detokenizer import IncrementalDetokenizer
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.testing.tiny_models import train_tokenizer

TOKENIZER = train_tokenizer()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_streamed_text_equals_decoding_all_tokens(text):
    """Feeding tokens one by one yields exactly tokenizer.decode of them all."""
    token_ids = TOKENIZER.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(TOKENIZER, SamplingParams())
    for token in token_ids:
        detokenizer.update([token])
    assert detokenizer.text == TOKENIZER.decode(token_ids, skip_special_tokens=True)


def test_partial_stop_strings_are_held_back_while_running():
    """Visible text never shows a prefix of a stop string that the final text cuts."""
    token_ids = TOKENIZER.encode("the cat sat on the mat", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(TOKENIZER, SamplingParams(stop=["on the"]))
    seen = []
    for token in token_ids:
        stop = detokenizer.update([token])
        seen.append(detokenizer.visible_text(finished=stop is not None))
        if stop:
            break
    assert seen[-1] == "the cat sat "
    assert all(seen[-1].startswith(partial) for partial in seen)
