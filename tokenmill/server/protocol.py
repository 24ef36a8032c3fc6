"""OpenAI-shaped request models (with vLLM's sampling extras), published in the OpenAPI schema.

Types and shapes are checked here; the ranges of sampling values are checked
once, by ``SamplingParams``, and values that depend on the model (token ids,
the context window) by the engine at admission, so each rule has one home.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from types import MappingProxyType
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.core.engine.prompt_input import MAX_CACHE_SALT_CHARS
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.interfaces.sampling_params import SEED_RANGE, SamplingParams

#: a logit_bias key: a token id in decimal (bounded, so int() never sees thousands of digits)
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")


class OpenAIModel(BaseModel):
    """Unknown fields are ignored, as OpenAI and vLLM do: clients send vendor extras. Known ones
    are strict: ``true`` is no token id and ``"5"`` no integer, as the schema says."""

    model_config = ConfigDict(extra="ignore", strict=True)


class GenerationModel(OpenAIModel):
    """A generation request keeps its undeclared fields (``model_extra``), so that the server
    can refuse the unsupported ones by name and log the ignored ones (``request_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = Field(False, description="Send a last chunk with the token usage of the request.")
    continuous_usage_stats: bool = Field(False, description="vLLM: with include_usage, every chunk carries "
                                                            "the usage so far.")


#: a vllm_xargs value: what vLLM's extra_args accept on the wire
XArg = Union[str, int, float, bool, list[Union[str, int, float, bool]]]


class JsonSchemaFormat(OpenAIModel):
    name: str = Field("response", max_length=256)
    description: Optional[str] = None
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply must follow.")
    strict: Optional[bool] = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's structured_outputs: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json", description="A JSON schema.")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = Field(None, description="An EBNF grammar (the backend's dialect).")
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = Field(
        None, description="true: JSON with no free whitespace, as every reply is here; false is refused (a weak "
                          "model could fill its budget with spaces).")
    disable_additional_properties: Optional[bool] = Field(
        None, description="true: schema objects that do not say otherwise take no other properties.")
    whitespace_pattern: Optional[str] = Field(None, description="Refused: JSON is compiled with no free whitespace.")
    structural_tag: Optional[str] = Field(None, description="Refused: structural tags are not supported; use "
                                                            "tools, or a JSON schema.")


TokenIds = list[int]
Prompt = Union[str, list[str], TokenIds, list[TokenIds]]


class SamplingFields(GenerationModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = Field(None, description="A served model name or a loaded LoRA adapter; "
                                                   "omitted means the first served name.")
    n: int = Field(1, description="Sequences to generate per prompt (at least 1).")
    temperature: Optional[float] = Field(None, description="Sampling temperature, >= 0; below 1e-5 is greedy. "
                                                           "Default 1.")
    top_p: Optional[float] = Field(None, description="Nucleus sampling mass in (0, 1]. Default 1.")
    presence_penalty: float = Field(0.0, description="In [-2, 2]: subtracted once from every generated token's logit.")
    frequency_penalty: float = Field(0.0, description="In [-2, 2]: subtracted per occurrence of a generated token.")
    seed: Optional[int] = Field(None, description=f"A 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]: makes "
                                                  "this request's samples reproducible, whatever else is batched.")
    stop: Union[str, list[str], None] = Field(None, description="Strings that end a sequence (not included).")
    stream: bool = Field(False, description="Stream server-sent events, ending with `data: [DONE]`.")
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="An end-user id, for logs.")
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to its logit before sampling.")
    # vLLM extras
    stream_interval: Optional[int] = Field(
        None, ge=1, description="vLLM: a stream's first token goes out at once, the next ones once this many have "
                                "come, and the rest at the end (default: the server's --stream-interval, 1).")
    top_k: Optional[int] = Field(None, description="vLLM: sample among the k most likely tokens; -1 = all.")
    min_p: Optional[float] = Field(None, description="vLLM: drop tokens below min_p x the top probability, "
                                                     "in [0, 1].")
    repetition_penalty: Optional[float] = Field(None, description="vLLM: > 0; divides the logits of tokens "
                                                                  "seen in the prompt or output (1 = off).")
    min_tokens: int = Field(0, description="vLLM: EOS and stop_token_ids are masked until this many tokens.")
    ignore_eos: bool = Field(False, description="vLLM: keep generating past the EOS token.")
    stop_token_ids: Optional[list[int]] = Field(None, description="vLLM: token ids that end a sequence.")
    priority: int = Field(0, description="vLLM: lower runs first under the priority scheduling policy.")
    include_stop_str_in_output: bool = Field(False, description="vLLM: keep the matched stop string in the text.")
    skip_special_tokens: bool = Field(True, description="vLLM: leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM: only true is supported (the fast tokenizers' decoding); false is refused.")
    request_id: Optional[str] = Field(None, max_length=256, description="vLLM: the id to report in the response; "
                                                                        "the engine keeps its own internal ids.")
    allowed_token_ids: Optional[list[int]] = Field(None, description="vLLM: only these token ids may be generated.")
    bad_words: Optional[list[str]] = Field(None, description="vLLM: words that must not be generated.")
    truncate_prompt_tokens: Optional[int] = Field(
        None, description="vLLM: keep only this many prompt tokens (-1: as many as fit beside max_tokens).")
    truncation_side: Literal["left", "right"] = Field("left", description="vLLM: which end of the prompt "
                                                                          "truncate_prompt_tokens cuts.")
    prompt_logprobs: Optional[int] = Field(None, description="vLLM: report each prompt token's logprob and the "
                                                             "top-k (0-20) alternatives.")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM: name tokens in logprobs as "
                                                                "'token_id:{id}'.")
    return_token_ids: bool = Field(False, description="vLLM: include prompt_token_ids and each choice's "
                                                      "token_ids.")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                      description="vLLM: requests share prefix-cache blocks only with requests "
                                                  "of the same salt.")
    vllm_xargs: Optional[dict[str, XArg]] = Field(None, description="vLLM: arguments for the server's logits "
                                                                    "processors (SamplingParams.extra_args).")
    response_format: Optional[ResponseFormat] = Field(None, description="OpenAI's: json_object or json_schema "
                                                                        "constrains the reply; text does nothing.")
    structured_outputs: Optional[StructuredOutputsField] = Field(
        None, description="vLLM: a JSON schema, regex, choice or grammar the reply must follow.")
    guided_json: Union[dict[str, Any], str, None] = Field(None, description="vLLM's older spelling of "
                                                                            "structured_outputs.json.")
    guided_regex: Optional[str] = Field(None, description="vLLM's older spelling of structured_outputs.regex.")
    guided_choice: Optional[list[str]] = Field(None, description="vLLM's older spelling of "
                                                                 "structured_outputs.choice.")
    guided_grammar: Optional[str] = Field(None, description="vLLM's older spelling of structured_outputs.grammar.")
    use_beam_search: bool = Field(False, description="vLLM: beam search with n beams; returns the n best.")
    length_penalty: float = Field(1.0, description="vLLM: with use_beam_search, scores are divided by "
                                                   "length ** length_penalty.")

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int] = None,
                        defaults: Mapping[str, Any] = MappingProxyType({}), stream_interval: int = 1
                        ) -> SamplingParams:
        """The engine's parameters; a sampling field the request leaves unset takes the model's
        default (``defaults``, from --generation-config), then OpenAI's. ``stream_interval``: the
        server's, for a request that sets none."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=tuple(self.bad_words or ()),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side,
            extra_args=self.vllm_xargs,
            structured_outputs=self.constraint(),
            stream_interval=self.stream_interval or stream_interval,
        )

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The one constraint the request asks for, from whichever field it used."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                given.append(StructuredOutputsParams(json_object=True, param="response_format"))
            elif fmt.json_schema is None:
                raise InvalidRequest("response_format", "type json_schema needs json_schema")
            else:
                given.append(StructuredOutputsParams(json=fmt.json_schema.json_schema, param="response_format"))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            refusals = {"disable_any_whitespace": (so.disable_any_whitespace is False, "JSON is compiled with no free "
                                                   "whitespace (a weak model could fill its budget with spaces): "
                                                   "send true, or leave it out"),
                        "whitespace_pattern": (so.whitespace_pattern is not None, "JSON is compiled with no free "
                                               "whitespace, so there is no whitespace to pattern"),
                        "structural_tag": (so.structural_tag is not None, "structural tags are not supported: use "
                                           "tools with tool_choice, or a JSON schema")}
            for name, (refused, reason) in refusals.items():
                if refused:
                    raise InvalidRequest(f"structured_outputs.{name}", reason)
            given.append(StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object), param="structured_outputs",
                disable_additional_properties=bool(so.disable_additional_properties)))
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                given.append(StructuredOutputsParams(**{kind: getattr(self, field)}, param=field))
        if len(given) > 1:
            raise InvalidRequest(given[1].param, f"one constraint per request: {given[0].param} is given too")
        return given[0] if given else None

    def prompt_logprobs_wanted(self, echoed: Optional[int] = None) -> Optional[int]:
        """How many prompt alternatives to compute: prompt_logprobs, or what echo needs."""
        wanted = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(wanted) if wanted else None

    def _logit_bias(self) -> Optional[dict[int, float]]:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise InvalidRequest("logit_bias", f"keys must be token ids, got {key[:32]!r}")
            bias[int(key)] = value
        return bias


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="Text, a list of texts, token ids, or a list of token-id lists.")
    max_tokens: Optional[int] = Field(16, description="Tokens to generate at most; null = the rest of the context.")
    logprobs: Optional[int] = Field(None, description="Report the sampled token's logprob and the top-k "
                                                      "(0-20) alternatives.")
    echo: bool = Field(False, description="Prepend the prompt (and its logprobs) to the completion.")
    best_of: Optional[int] = Field(None, description="Only equal to n is supported.")
    add_special_tokens: bool = Field(True, description="vLLM: tokenize text prompts with the tokenizer's "
                                                       "special tokens (BOS).")


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    #: an assistant turn's earlier tool calls, and a tool turn's answer to one: for the template
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None

    def for_template(self, content_parts: bool = False) -> dict[str, Any]:
        """The message as chat templates read it: its content as one text, or (``content_parts``,
        vLLM's "openai" content format) as a list of ``{"type": "text", "text": ...}`` parts."""
        content: Any = self.text()
        if content_parts:
            texts = [] if self.content is None else [self.content] if isinstance(self.content, str) \
                else [part.text for part in self.content]
            content = [{"type": "text", "text": text} for text in texts]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            # templates (Llama 3's `arguments | tojson`) expect the arguments as an object, as vLLM gives them
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="A JSON schema of the arguments.")
    strict: Optional[bool] = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequest("messages", f"a tool call's arguments are not JSON: {text[:64]!r}") from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, rendered by the "
                                                                  "model's chat template.")
    max_tokens: Optional[int] = Field(None, description="Deprecated by OpenAI for max_completion_tokens.")
    max_completion_tokens: Optional[int] = Field(None, description="Tokens to generate at most; "
                                                                   "null = the rest of the context.")
    logprobs: bool = Field(False, description="Report each generated token's logprob.")
    top_logprobs: Optional[int] = Field(None, description="With logprobs: the 0-20 most likely alternatives.")
    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the assistant's turn header.")
    chat_template: Optional[str] = Field(None, description="vLLM: a Jinja chat template to use instead of the "
                                                           "model's; refused unless the server trusts them.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="vLLM: extra variables for the "
                                                                             "chat template.")
    continue_final_message: bool = Field(False, description="vLLM: leave the last (assistant) message open, "
                                                            "for the model to continue; needs "
                                                            "add_generation_prompt=false.")
    echo: bool = Field(False, description="vLLM: start the reply with the last message's content when it is "
                                          "the assistant's.")
    add_special_tokens: bool = Field(False, description="vLLM: also add the tokenizer's special tokens to the "
                                                        "rendered template (which usually has them).")
    tools: Optional[list[ChatTool]] = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="none; auto (the server's --tool-call-parser reads calls from the text); required or "
                          "a named function (the reply is constrained to the arguments' schema).")
    parallel_tool_calls: bool = Field(True, description="With tool_choice required: more than one call allowed.")
    include_reasoning: bool = Field(True, description="vLLM: with --reasoning-parser, return the model's thinking "
                                                      "as reasoning_content (false drops it).")
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = Field(
        None, description="OpenAI's: handed to the chat template as the variable reasoning_effort (templates "
                          "that know it use it).")


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="Text to tokenize (or give messages).")
    messages: Optional[list[ChatMessage]] = Field(None, description="A conversation, rendered by the chat "
                                                                    "template, then tokenized.")
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: TokenIds = Field(description="Token ids inside the vocabulary.")


class EmbeddingRequest(OpenAIModel):
    model: Optional[str] = None
    input: Prompt = Field(description="Text, a list of texts, token ids, or a list of token-id lists.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, description="Only the model's own dimension is supported.")
    user: Optional[str] = None


class LoadAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256, description="The name clients put in `model`.")
    lora_path: str = Field(min_length=1, max_length=4096, description="A directory inside allowed_lora_dirs.")


class UnloadAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, request: Any, given: Optional[str]) -> tuple[str, str]:
    """(the engine's id, the id the response reports) for one API request.

    The engine's id is always the server's own, so no client can collide with another's
    request; it carries the X-Request-Id (``--enable-request-id-headers``) so log lines can
    be found by it. The response reports the body's ``request_id`` (vLLM's field), else
    ``{prefix}-{X-Request-Id}`` (vLLM's form), else the engine's id.
    """
    header = getattr(request.state, "request_id", None)
    internal = new_id(f"{prefix}-{header}" if header else prefix)
    return internal, given or (f"{prefix}-{header}" if header else internal)


def now() -> int:
    return int(time.time())
