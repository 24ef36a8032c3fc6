"""The demo models that ship with tokenmill: ``tokenmill serve`` with no model serves
``demo-llama``, with no download and no training at start.

``demo-llama`` (4.3M parameters) and its draft model ``demo-llama-draft`` (0.9M, the same
tokenizer, for speculative decoding) are Llama-architecture models trained by
``tools/train_demo_models.py`` on Python's own documentation (``tokenmill.testing.demo_corpus``:
the Language Reference topics and standard-library docstrings, PSF License). They write
English about Python; their held-out perplexities are in each directory's training.json.
"""

from pathlib import Path

_HERE = Path(__file__).parent
#: the model ``tokenmill serve`` serves when given none
DEMO_MODEL = _HERE / "demo-llama"
#: the draft model for DEMO_MODEL (same tokenizer)
DEMO_DRAFT_MODEL = _HERE / "demo-llama-draft"
