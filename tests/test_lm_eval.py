"""lm-evaluation-harness's `local-completions` model runs a loglikelihood task against the server.

The task is defined locally (JSON lines + a task YAML), so nothing is downloaded.
Its accuracy must equal the one computed directly from Hugging Face logprobs.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_llm
from server_harness import running_server

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The quick brown", "choices": [" fox", " river", " bread"], "answer": 0},
    {"question": "Rivers run to the", "choices": [" sea", " market", " train"], "answer": 0},
    {"question": "The library opened at", "choices": [" nine", " dragons"], "answer": 0},
    {"question": "Engineers measure throughput in", "choices": [" tokens per second", " poetry"], "answer": 0},
    {"question": "She wrote a letter to her", "choices": [" brother", " garden", " weather"], "answer": 2},
]


def hf_accuracy(path) -> float:
    """Accuracy from summed continuation logprobs computed by HF transformers directly."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    correct = 0
    for doc in DOCS:
        scores = []
        context = tokenizer.encode(doc["question"])
        for choice in doc["choices"]:
            continuation = tokenizer.encode(doc["question"] + choice)[len(context):]
            ids = torch.tensor([context + continuation])
            with torch.inference_mode():
                logprobs = model(ids).logits[0].log_softmax(-1)
            scores.append(sum(logprobs[len(context) - 1 + i, t].item() for i, t in enumerate(continuation)))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    return correct / len(DOCS)


def test_local_completions_loglikelihood_task(model_dir, tmp_path):
    """A multiple-choice task scored through /v1/completions echo+logprobs agrees with HF."""
    from lm_eval.tasks import TaskManager

    path = model_dir("llama")
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "task.yaml").write_text(
        "task: tokenmill_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "target_delimiter: ''\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    engine = make_llm(path).llm_engine
    with running_server(engine, served_model_name=["tiny"]) as (url, _):
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
                       f"tokenizer={path},num_concurrent=2,max_retries=1",
            tasks=["tokenmill_tiny_mc"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            batch_size=2,
        )
    accuracy = results["results"]["tokenmill_tiny_mc"]["acc,none"]
    assert accuracy == pytest.approx(hf_accuracy(path))
