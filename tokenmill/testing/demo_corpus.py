"""The demo models' training text: Python's own documentation, as shipped with Python.

Two sources, both under the PSF License Agreement (Python's licence), both in every
CPython install, so the corpus is the same wherever Python 3.11 is:
- ``pydoc_data.topics``: the Language Reference sections ``help()`` shows (statements,
  operators, data model), about 465,000 characters;
- the docstrings of a fixed list of standard-library modules and their public members.

Paragraphs are split off deterministically: every ``HELD_OUT_EVERY``-th one is held out for
perplexity and never trained on. ``chat_examples`` turns each Language Reference topic into a
short question and answer in the demo chat template, so the chat endpoint answers in kind.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import re
import subprocess
import sys
from typing import Iterable

import pydoc_data.topics
import torch

#: standard-library modules whose docstrings join the corpus (sorted, fixed)
DOCSTRING_MODULES = (
    "abc", "argparse", "array", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools",
    "glob", "gzip", "hashlib", "heapq", "html", "http.client", "inspect", "io", "itertools", "json",
    "logging", "math", "operator", "os", "os.path", "pathlib", "pickle", "pprint", "queue", "random",
    "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tempfile", "textwrap",
    "threading", "time", "typing", "unittest", "urllib.parse", "uuid", "weakref", "zipfile",
    "ast", "codecs", "concurrent.futures", "configparser", "ctypes", "email.message", "ftplib", "getopt",
    "gettext", "imaplib", "ipaddress", "locale", "mailbox", "mimetypes", "multiprocessing", "numbers",
    "optparse", "pdb", "platform", "plistlib", "poplib", "profile", "pydoc", "selectors", "shelve", "shlex",
    "smtplib", "ssl", "struct", "symtable", "tarfile", "timeit", "tokenize", "trace", "traceback",
    "tracemalloc", "turtle", "types", "unittest.mock", "urllib.request", "warnings", "wave", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipimport", "zoneinfo", "builtins",
)
HELD_OUT_EVERY = 20
_MIN_PARAGRAPH = 40
#: the held-out stream perplexity is measured on: its first tokens, in windows of this length
HELD_OUT_TOKENS, WINDOW = 40_000, 256


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace folded, printable ASCII only."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        line = " ".join(block.split())
        line = "".join(ch for ch in line if " " <= ch <= "~")
        if len(line) >= _MIN_PARAGRAPH and not set(line) <= set("*=-~^ "):
            out.append(line)
    return out


def _docstrings() -> list[str]:
    """The modules' docstrings as a fresh interpreter with transformers loaded sees them.

    Libraries patch standard modules when imported (Ray replaces some of ``logging``'s
    functions; transformers adds ``warning_once`` and friends to ``logging.Logger``), so the
    text depends on what a process loaded. The demo models were trained in a process that
    had imported transformers and nothing that patches more; a fresh interpreter doing the
    same gives the same corpus whatever the calling process holds."""
    result = subprocess.run([sys.executable, "-c", "import json, transformers, tokenmill.testing.demo_corpus as c; "
                             "print(json.dumps(c._docstrings_in_this_process()))"],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def _docstrings_in_this_process() -> list[str]:
    texts = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or not callable(member) \
                    or getattr(member, "__module__", None) != module.__name__:
                continue
            texts.append(inspect.getdoc(member) or "")
            if inspect.isclass(member):  # and its methods' own docstrings
                texts += [inspect.getdoc(attr) or "" for attr_name, attr in sorted(vars(member).items())
                          if not attr_name.startswith("_") and callable(attr)]
    return texts


@functools.cache
def corpus_paragraphs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(training paragraphs, held-out paragraphs), the same on every run (built once per process)."""
    paragraphs = []
    for key in sorted(pydoc_data.topics.topics):
        paragraphs += _paragraphs(pydoc_data.topics.topics[key])
    for text in _docstrings():
        paragraphs += _paragraphs(text)
    paragraphs = list(dict.fromkeys(paragraphs))  # inherited docstrings repeat
    train = tuple(p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1)
    held_out = tuple(p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    return train, held_out


def chat_examples() -> list[tuple[str, str]]:
    """(question, answer) per Language Reference topic: its title, and its first paragraphs."""
    examples = []
    for key in sorted(pydoc_data.topics.topics):
        paragraphs = _paragraphs(pydoc_data.topics.topics[key])
        title = pydoc_data.topics.topics[key].strip().splitlines()[0].strip()
        if len(paragraphs) < 2 or not title:
            continue
        answer = " ".join(paragraphs[1:3])[:600]
        examples.append((f"What is {title[0].lower() + title[1:]}?", answer))
        examples.append((f"Tell me about {key.replace('-', ' ')}.", answer))
    return examples


def vocabulary(paragraphs: Iterable[str]) -> set[str]:
    """The lower-cased words of ``paragraphs`` (letters only)."""
    return {word.lower() for paragraph in paragraphs for word in re.findall(r"[A-Za-z]+", paragraph)}


def held_out_tokens(tokenizer) -> list[int]:
    """The held-out paragraphs as one stream, each ``<|bos|> text <|eos|>``, cut to HELD_OUT_TOKENS."""
    _, held_out = corpus_paragraphs()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [t for p in held_out for t in [bos, *tokenizer.encode(p, add_special_tokens=False), eos]][:HELD_OUT_TOKENS]


@torch.no_grad()
def held_out_perplexity(model, tokenizer) -> float:
    """Perplexity of a transformers causal LM on the held-out stream, window by window."""
    stream = torch.tensor(held_out_tokens(tokenizer))
    total, count = 0.0, 0
    for start in range(0, len(stream) - WINDOW - 1, WINDOW):
        window = stream[start:start + WINDOW + 1][None]
        loss = model(input_ids=window, labels=window.clone()).loss  # transformers shifts the labels itself
        total, count = total + float(loss) * WINDOW, count + WINDOW
    return math.exp(total / count)
