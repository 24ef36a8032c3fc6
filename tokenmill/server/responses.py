"""Response models of every route, so the OpenAPI schema is the contract clients and tests read.

Handlers build plain dicts; FastAPI validates each non-streaming response
against its model. Streaming routes send one chunk model per SSE ``data:`` line.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

#: the floor of a reported logprob: JSON has no -Infinity (vLLM reports the same floor)
LOGPROB_FLOOR = -9999.0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served by the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = Field(
        None, description="With --enable-prompt-tokens-details.")


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's Logprob: one candidate at one prompt position."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: vLLM's prompt_logprobs: per prompt position (the first has none), token id -> its Logprob
PromptLogprobs = list[Optional[dict[str, PromptTokenLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = Field(None, description="stop, length, abort or error; null while streaming.")
    stop_reason: Union[int, str, None] = Field(None, description="vLLM: the stop token id or string that matched.")
    prompt_logprobs: Optional[PromptLogprobs] = Field(None, description="vLLM: with prompt_logprobs.")
    prompt_token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids.")
    token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = Field("assistant", description="assistant, or the server's --response-role; a reply that "
                                               "continues the last message (no generation prompt) takes its role.")
    content: Optional[str] = Field(description="null when the reply is tool calls only.")
    tool_calls: Optional[list[ToolCall]] = None
    reasoning: Optional[str] = Field(None, description="vLLM: with --reasoning-parser, the model's thinking (null "
                                                       "when it did not think).")
    reasoning_content: Optional[str] = Field(None, description="vLLM's older name of reasoning, the same text.")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[PromptLogprobs] = Field(None, description="vLLM: with prompt_logprobs.")
    prompt_token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids.")


class DeltaFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first has its id and name, the rest add arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning: Optional[str] = Field(None, description="vLLM: with --reasoning-parser, new thinking.")
    reasoning_content: Optional[str] = Field(None, description="vLLM's older name of reasoning, the same text.")


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids, this chunk's tokens.")


class ChatCompletionChunk(BaseModel):
    """One SSE chunk of a streamed chat completion; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_logprobs: Optional[PromptLogprobs] = Field(None, description="vLLM: with prompt_logprobs, in the "
                                                                        "first chunk that has tokens.")
    prompt_token_ids: Optional[list[int]] = Field(None, description="vLLM: with return_token_ids, in the first "
                                                                    "chunk that has tokens.")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str] = Field(description="Floats, or base64 of little-endian float32.")


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="The model directory, or the adapter's path.")
    parent: Optional[str] = Field(None, description="For a LoRA adapter: the base model's name.")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdapterResponse(BaseModel):
    status: Literal["ok"] = "ok"
    lora_name: str


class HealthResponse(BaseModel):
    status: Literal["ok", "error"]
    detail: Optional[str] = Field(None, description="Why the engine stopped, when it did.")


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = Field(None, description="The request field the error is about, dotted.")
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, for every 4xx and 5xx."""

    error: ErrorInfo
