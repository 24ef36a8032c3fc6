"""First-party structured output backends: xgrammar (the default, as in vLLM and SGLang) and
llguidance. Each library is imported only when its backend is built."""

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_structured_output_backends(register) -> None:
    register("xgrammar", "tokenmill.plugins.structured_output.xgrammar_backend:XGrammarBackend")
    register("guidance", "tokenmill.plugins.structured_output.guidance_backend:GuidanceBackend")
