"""The built-in speculative proposers: ``ngram`` (prompt lookup) and ``draft_model`` (a smaller
model with the same tokenizer)."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_speculative_proposers(register):
    register("ngram", "tokenmill.plugins.speculative.ngram:NgramProposer")
    register("draft_model", "tokenmill.plugins.speculative.draft_model:DraftModelProposer")
