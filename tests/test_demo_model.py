"""The demo models that ship with tokenmill write English from their corpus.

``demo-llama`` and its draft were trained by tools/train_demo_models.py on Python's own
documentation (tokenmill.testing.demo_corpus). The bounds below sit a little above the
held-out perplexities their training.json records, so a damaged file or a changed loader
fails here.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.demo_models import DEMO_DRAFT_MODEL, DEMO_MODEL
from tokenmill.testing.demo_corpus import corpus_paragraphs, held_out_perplexity, vocabulary

PROMPTS = ["The for statement", "A list comprehension", "Exceptions are raised when", "A dictionary maps",
           "To open a file"]
#: held-out perplexity bounds (training.json records the measured values)
PERPLEXITY_BOUNDS = {DEMO_MODEL: 72.0, DEMO_DRAFT_MODEL: 58.0}


def words(text: str) -> list[str]:
    return [word.lower() for word in re.findall(r"[A-Za-z]+", text)]


@pytest.fixture(scope="module")
def demo():
    return LLM(str(DEMO_MODEL), kv_cache_memory_bytes=2**25)


@pytest.fixture(scope="module")
def corpus_vocabulary():
    return vocabulary(corpus_paragraphs()[0])


def test_completions_are_words_of_the_corpus(demo, corpus_vocabulary):
    outputs = demo.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    generated = [w for output in outputs for w in words(output.outputs[0].text)]
    assert len(generated) >= 60
    known = sum(word in corpus_vocabulary for word in generated) / len(generated)
    assert known >= 0.8, (known, [o.outputs[0].text for o in outputs])


def test_chat_answers_a_question_about_python_in_its_words(demo, corpus_vocabulary):
    [output] = demo.chat([{"role": "user", "content": "What is the for statement?"}],
                         SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    answer = words(output.outputs[0].text)
    assert len(answer) >= 10
    assert sum(word in corpus_vocabulary for word in answer) / len(answer) >= 0.8, output.outputs[0].text


@pytest.mark.parametrize("model_dir", [DEMO_MODEL, DEMO_DRAFT_MODEL], ids=lambda p: p.name)
def test_held_out_perplexity_is_within_its_bound(model_dir):
    recorded = json.loads((model_dir / "training.json").read_text())["held_out_perplexity"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    measured = held_out_perplexity(model, AutoTokenizer.from_pretrained(model_dir))
    assert measured == pytest.approx(recorded, rel=1e-3)
    assert measured < PERPLEXITY_BOUNDS[model_dir]


def test_the_pair_shares_a_tokenizer_and_fits_the_package():
    assert (DEMO_MODEL / "tokenizer.json").read_bytes() == (DEMO_DRAFT_MODEL / "tokenizer.json").read_bytes()
    size = sum(p.stat().st_size for d in (DEMO_MODEL, DEMO_DRAFT_MODEL) for p in d.iterdir())
    assert size <= 25 * 2**20
