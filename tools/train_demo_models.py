"""Trains the demo model pair that ships with tokenmill: a small Llama and its draft model.

Both read Python's own documentation (tokenmill.testing.demo_corpus: the Language
Reference topics and standard-library docstrings, PSF License) with one byte-level BPE
tokenizer trained on the same text, and both learn the demo chat template from a
question and answer per Language Reference topic. Deterministic: one thread, fixed seeds,
fixed data order and deterministic algorithms give the same bytes on every run on the same
Python and torch. Run by hand (about 25 minutes on one core), not by CI:

    taskset -c 0 python tools/train_demo_models.py --out tokenmill/demo_models
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tokenmill.testing.demo_corpus import chat_examples, corpus_paragraphs, held_out_perplexity, held_out_tokens
from tokenmill.testing.tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, SPECIAL_TOKENS

VOCAB_SIZE = 4096
SHAPES = {
    "demo-llama": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4),
    "demo-llama-draft": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2),
}


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def documents(tokenizer: PreTrainedTokenizerFast, paragraphs: Sequence[str], chats: list[tuple[str, str]],
              seed: int) -> list[int]:
    """One token stream: paragraphs, and each chat example three times, shuffled, BOS-led."""
    docs = [tokenizer.encode(p, add_special_tokens=False) + [EOS_ID] for p in paragraphs]
    for question, answer in chats * 3:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        docs.append(tokenizer.encode(text, add_special_tokens=False))
    random.Random(seed).shuffle(docs)
    return [token for doc in docs for token in [BOS_ID, *doc]]


def batches(stream: torch.Tensor, steps: int, batch: int, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=generator)
        yield torch.stack([stream[s:s + length + 1] for s in starts.tolist()])


def train(name: str, tokenizer: PreTrainedTokenizerFast, train_stream: torch.Tensor, args: argparse.Namespace,
          steps: int) -> dict:
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         initializer_range=0.02, **SHAPES[name])
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup,
                                                 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))) + 0.02)
    started, losses = time.monotonic(), []
    for step, window in enumerate(batches(train_stream, steps, args.batch, args.length, args.seed + 1)):
        loss = model(input_ids=window, labels=window.clone()).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step % 50 == 0 or step == steps - 1:
            print(f"{name} step {step}/{steps} loss {statistics.mean(losses[-50:]):.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    model.eval()
    ppl = held_out_perplexity(model, tokenizer)
    out = args.out / name
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {"model": name, "parameters": sum(p.numel() for p in model.parameters()), "steps": steps,
              "batch": args.batch, "length": args.length, "seed": args.seed, "final_loss": losses[-1],
              "held_out_perplexity": round(ppl, 2), "train_seconds": round(time.monotonic() - started),
              "corpus": "pydoc_data.topics + stdlib docstrings (tokenmill.testing.demo_corpus), PSF License",
              "torch": torch.__version__}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=650)
    parser.add_argument("--draft-steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    paragraphs, _ = corpus_paragraphs()
    chats = chat_examples()
    tokenizer = train_tokenizer([*paragraphs, *(f"{q} {a}" for q, a in chats)])
    train_stream = torch.tensor(documents(tokenizer, paragraphs, chats, args.seed))
    print(f"{len(train_stream)} training tokens, {len(held_out_tokens(tokenizer))} held out, "
          f"vocabulary {len(tokenizer)}", flush=True)
    for name, steps in (("demo-llama-draft", args.draft_steps), ("demo-llama", args.target_steps)):
        if steps:
            train(name, tokenizer, train_stream, args, steps)


if __name__ == "__main__":
    main()
