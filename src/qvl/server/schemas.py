"""Pydantic schemas of the OpenAI chat-completions API as qvl serves it (requests strict,
responses as OpenAI sends them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator

from qvl.sampling import SEED_MAX, SEED_MIN

MAX_MESSAGES = 4096  # the context holds 32k tokens; every message costs a few
MAX_PARTS = 1024
Seed = Annotated[int | None, Field(ge=SEED_MIN, le=SEED_MAX)]  # every front door's `seed`
# every front door's `cache_salt` (as vLLM's): a request shares cached work (answers, prompt
# prefixes, image features) only with requests of the same salt and API key
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    # Wrong types are errors, not coerced ("1" is not a number); unknown fields are ignored.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _content_list(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content parts")
    return value


def _stop_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class ImageURL(_Strict):
    url: str = Field(min_length=1)  # "detail" is ignored: the pixel budget is max_pixels
    pages: str | None = Field(None, max_length=256)  # qvl: a PDF's pages, "2-4,7" (default: all)


class VideoURL(_Strict):
    url: str = Field(min_length=1)


class ContentPart(_Strict):
    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None  # vLLM's convention: data: URI, or a URL / path as for images

    @model_validator(mode="after")
    def _matching_field(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a part of type '{self.type}' needs a '{self.type}' field")
        return self


def _optional_content(value: Any) -> Any:
    return [] if value is None else _content_list(value)


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[ContentPart], BeforeValidator(_optional_content), Field(max_length=MAX_PARTS)] = []
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # arguments always follow the schema when a call is forced (see docs/api.md)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type 'json_schema' needs a 'json_schema' field")
        return self


class StructuredOutputs(_Strict):
    """qvl's (and vLLM's) extension: exactly one of a JSON schema, a regular expression, a Lark
    grammar (llguidance's dialect) or a list of choices."""

    json_: dict | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=65536)
    grammar: str | None = Field(None, max_length=262144)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.json_, self.regex, self.grammar, self.choice)) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, grammar, choice")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str | None = None  # any name is accepted: one process serves one model
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Annotated[Annotated[list[str], Field(max_length=4)] | None, BeforeValidator(_stop_list)] = None
    seed: Seed = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int = Field(1, ge=1, le=16)  # answers forked from one prefill; at most the engine's --max-batch
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    # qvl extras (as vLLM names them)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0)
    max_pixels: int | None = Field(None, ge=1)
    fps: float | None = Field(None, gt=0, le=60)  # video: frames sampled per second of clip
    max_frames: int | None = Field(None, ge=2)  # video: frames per clip at most (the server caps it)
    max_video_tokens: int | None = Field(None, ge=1)  # video: token budget of a clip (the server caps it)
    reasoning_budget: int | None = Field(None, ge=0)  # Thinking models: reasoning tokens before </think> is forced
    chat_template_kwargs: Any = None  # more template variables ({"enable_thinking": false}); checked by the engine
    cache_salt: CacheSalt = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # OpenAI features qvl does not offer: accepted by the schema, refused with a clear 400
    functions: Any = None
    function_call: Any = None
    audio: Any = None

    def unsupported(self) -> str | None:
        """The first field asking for something qvl cannot do, or None."""
        for name in ("functions", "function_call", "audio"):
            if getattr(self, name) is not None:
                return name
        return None


# -- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict  # {"cached_tokens"}: the prompt's tokens reused from the prefix cache
    completion_tokens_details: dict | None = None  # {"reasoning_tokens"} for a Thinking model

    @model_serializer(mode="wrap")
    def _details_when_known(self, handler) -> dict:
        data = handler(self)
        return data if data["completion_tokens_details"] else {k: v for k, v in data.items()
                                                               if k != "completion_tokens_details"}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[dict] | None = None  # [{"id", "type": "function", "function": {"name", "arguments"}}]
    reasoning_content: str | None = None  # a Thinking model's reasoning

    @model_serializer(mode="wrap")
    def _extras_when_present(self, handler) -> dict:
        data = handler(self)
        return {k: v for k, v in data.items() if k not in ("tool_calls", "reasoning_content") or v is not None}


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict | None = None  # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} when asked


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    qvl: dict  # extra: timings, image tokens, cache hits


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then {"content"} or {"tool_calls"}, last {}
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: dict | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage
    qvl: dict | None = None  # only on the chunk with finish_reason

    @model_serializer(mode="wrap")
    def _drop_absent_extras(self, handler) -> dict:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in ("usage", "qvl") and v is None)}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qvl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- embeddings and reranking (an embedding or reranker model: qvl.server.embeddings) ------------
# An input, query or document is a string, a list of content parts as in chat messages, or (rerank)
# an object with "text", "image", "video" as Jina's API and the reference take it: checked when read.

MAX_INPUTS = 2048  # inputs of one embeddings request, documents of one rerank


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: Any = None  # a string, a list of strings, or a list of inputs each a list of content parts
    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)  # vLLM's chat form: one input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    instruction: str | None = Field(None, max_length=4096)  # qvl: what the embeddings are for (the reference's)
    cache_salt: CacheSalt = None


class RerankRequest(_Strict):
    model: str | None = None
    query: Any
    documents: Any  # a list of documents, or vLLM's {"content": [parts]} (each part a document)
    top_n: int | None = Field(None, ge=0)  # 0 or none: all
    return_documents: bool = True
    instruction: str | None = Field(None, max_length=4096)
    cache_salt: CacheSalt = None


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: Any  # one query, or as many as text_2
    text_2: Any
    instruction: str | None = Field(None, max_length=4096)
    cache_salt: CacheSalt = None


class OllamaEmbedRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[str], Field(max_length=MAX_INPUTS)]
    dimensions: int | None = Field(None, ge=1)
    truncate: bool | None = None  # an input over the context is refused either way
    options: dict | None = None
    keep_alive: Any = None
    cache_salt: CacheSalt = None
