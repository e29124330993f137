"""Request bodies of the OpenAI API (with vLLM's sampling extensions) as pydantic v2 models.

Every field a model declares is honoured; an unknown field is a 400 naming it. OpenAI fields this
server cannot honour are declared too, so that a value asking for them is a 400 naming the field
(their neutral values, which ask for nothing, are accepted). Types are strict, as OpenAI's own
checks are: a bool is not an integer, a string is not a number, 1.0 is not a token id.
"""
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tpengine.errors import InvalidRequestError
from tpengine.sampling_params import (MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                      RequestOutputKind, SamplingParams, StructuredOutputsParams)

# One request may ask for at most this many completions per prompt (n): each is a sequence in the batch.
MAX_N = 128
# and give at most this many prompts (each one a request in the engine)
MAX_PROMPTS = 1024
# OpenAI's highest temperature: past it the endpoints refuse what OpenAI refuses (the offline LLM takes more)
MAX_TEMPERATURE = 2.0
# The roles OpenAI's chat messages take (a template renders any role it is given, a typo as well).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

TokenIds = list[Annotated[int, Field(ge=0)]]

# What a union-typed field takes, for the one error message its failed alternatives become.
FIELD_KINDS = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0), or a list of token-id lists",
    "input": "a string, a list of strings, a list of token ids (integers >= 0), or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string, a list of text and image_url parts, or null",
}


# Fields this server does not implement: field -> (the values that ask for nothing, why not).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: v is None or v == "", "suffix (text after the completion) is not supported"),
    "functions": (lambda v: not v, "functions are OpenAI's deprecated form of tools: send tools"),
    "function_call": (lambda v: v is None, "function_call is OpenAI's deprecated form of tool_choice: send "
                                           "tool_choice"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning effort is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "store": (lambda v: v is None or v is False, "this server does not store completions"),
    "metadata": (lambda v: v is None, "metadata belongs to stored completions, which this server does not keep"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "this server has one service tier: 'auto'"),
    # vLLM's router (vllm-router) re-serializes each request it forwards with these SGLang/vLLM fields at the
    # values below, which ask for nothing; any other value asks for what this server does not do
    "no_stop_trim": (lambda v: v is None or v is False, "no_stop_trim is not supported: send "
                                                        "include_stop_str_in_output to keep a stop string"),
    "return_hidden_states": (lambda v: v is None or v is False, "hidden states are not returned"),
    "continue_final_message": (lambda v: v is None or v is False, "continuing the final assistant message is "
                                                                  "not supported"),
    "separate_reasoning": (lambda v: v is None or v is True, "reasoning is always separated (with "
                                                             "--reasoning-parser) into reasoning_content"),
    "stream_reasoning": (lambda v: v is None or v is True, "reasoning is always streamed as it is generated"),
    "include_reasoning": (lambda v: v is None or v is True, "reasoning is always included (with "
                                                            "--reasoning-parser) as reasoning_content"),
}


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def refusing(unsupported: dict):
    """A field validator for the fields of unsupported (name -> (accepts(value), why)): a value it does not accept is
    a ValueError saying why."""
    def refuse(value, info: ValidationInfo):
        accepts, why = unsupported[info.field_name]
        if not accepts(value):
            raise ValueError(f"{why} (got {value!r:.80})")
        return value
    return refuse


_refuse_unsupported = refusing(UNSUPPORTED)


def stream_options_need_stream(stream_options, info: ValidationInfo):
    if stream_options is not None and not info.data.get("stream"):
        raise ValueError("stream_options is only allowed when stream is true")
    return stream_options


class JsonSchemaFormat(OpenAIBody):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None   # the grammar enforces the schema whatever it says


class ResponseFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    # validate_default: a "json_schema" type without its json_schema is refused here, not found missing later
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_goes_with_its_type(cls, json_schema, info: ValidationInfo):
        if "type" not in info.data:
            return json_schema  # the type itself was refused, naming what it takes
        if json_schema is None and info.data["type"] == "json_schema":
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        if json_schema is not None and info.data["type"] != "json_schema":
            raise ValueError(f'json_schema goes with type "json_schema" only, not {info.data["type"]!r}')
        return json_schema


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value):
        if value:
            raise ValueError("stream obfuscation is not supported: send false or leave it out")
        return value


class SamplingRequest(OpenAIBody):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None   # OpenAI's range, [0, MAX_TEMPERATURE]; SamplingParams takes any >= 0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and token_ids in each choice
    # identifiers of the end user and of a shared prompt: they change no answer, so they are accepted
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None   # the prefix cache finds shared prefixes by their tokens anyway
    service_tier: Any = None
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs (json, json_object, regex,
    # choice, grammar, disable_any_whitespace); one of them
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    no_stop_trim: Any = None
    return_hidden_states: Any = None

    _service_tier = field_validator("service_tier", "no_stop_trim", "return_hidden_states")(_refuse_unsupported)

    @field_validator("temperature")
    @classmethod
    def _temperature_in_openais_range(cls, temperature):
        if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"must be from 0 to {MAX_TEMPERATURE} (OpenAI's range), got {temperature}")
        return temperature

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's grammar and the field that asked for it; InvalidRequestError naming that field."""
        given = [name for name, value in (("response_format", self.response_format),
                                          ("structured_outputs", self.structured_outputs))
                 if value is not None and not (name == "response_format" and value.type == "text")]
        if len(given) > 1:
            raise InvalidRequestError("give response_format or structured_outputs, not both", given[1])
        if not given:
            return None, None
        if given[0] == "structured_outputs":
            try:
                return StructuredOutputsParams(**self.structured_outputs), "structured_outputs"
            except TypeError as e:  # a key StructuredOutputsParams does not take
                raise InvalidRequestError(f"structured_outputs: {e}".replace("__init__() ", ""),
                                          "structured_outputs") from None
        fmt = self.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        return StructuredOutputsParams(json=fmt.json_schema.schema_ or {}), "response_format"

    _stream_options = field_validator("stream_options")(stream_options_need_stream)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request; raises ValueError naming a bad value."""
        # null means the default, as in OpenAI's API
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            **{name: value for name, value in given.items() if value is not None},
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed, logprobs=logprobs,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias, output_kind=output_kind,
            structured_outputs=structured_outputs, prompt_logprobs=self.asked_prompt_logprobs)

    @property
    def asked_prompt_logprobs(self) -> int | None:
        """How many top alternatives each prompt token's logprob comes with (None: the prompt is not scored)."""
        return None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def max_request_len(info: ValidationInfo) -> int | None:
    """The server's limit on one request's tokens, which the validation context carries."""
    return (info.context or {}).get("max_request_len")


def _is_token_ids(value) -> bool:
    # at C speed where it can: a hostile body may hold millions of them, and this runs on the event loop
    return type(value) is list and all(type(t) is int for t in value) and (not value or min(value) >= 0)


def checked_prompts(prompt, limit: int | None, field: str = "prompt"):
    """prompt, if it is a string, a list of strings, token ids, or a list of token-id lists (each within limit
    tokens, when there is one); else a ValueError saying what it must be."""
    if type(prompt) is str:
        return prompt
    if type(prompt) is not list:
        raise ValueError(f"must be {FIELD_KINDS[field]}")
    if not prompt:
        raise ValueError(f"{field} is an empty list: give a string, token ids, or a list of either")
    if type(prompt[0]) is int:
        prompts = [prompt]
    elif len(prompt) > MAX_PROMPTS:
        raise ValueError(f"has {len(prompt)} prompts, more than the limit of {MAX_PROMPTS} per request")
    elif all(type(p) is str for p in prompt):
        return prompt
    else:
        prompts = prompt
    for ids in prompts:
        if not _is_token_ids(ids):
            raise ValueError(f"must be {FIELD_KINDS[field]}")
        if limit is not None and len(ids) > limit:
            raise ValueError(f"a prompt has {len(ids)} tokens, more than the server's limit of {limit} tokens "
                             "per request (max_model_len, or the KV cache if smaller)")
    return prompt


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A checked prompt as a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class CompletionRequest(SamplingRequest):
    # a string, a list of strings, token ids, or a list of token-id lists: checked by _prompt_shape, not a
    # pydantic union (whose validation of a long token list took seconds of the event loop)
    prompt: Any
    echo: bool = False  # before max_tokens: its check reads it
    # OpenAI's default; null means "as many as the context allows"; 0 with echo: the prompt alone (scored with
    # logprobs: what lm-eval-harness asks), as vLLM takes it
    max_tokens: int | None = Field(16, ge=0)
    # with echo, the prompt's tokens get theirs too (the first token's null: nothing before it scores it)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (if it adds one) before a text prompt

    _suffix = field_validator("suffix")(_refuse_unsupported)

    @field_validator("max_tokens")
    @classmethod
    def _no_tokens_only_with_echo(cls, max_tokens, info: ValidationInfo):
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1, or 0 with echo (the prompt alone, scored with logprobs)")
        return max_tokens

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of, info: ValidationInfo):
        # best_of = n asks for nothing more than n; more would need ranking completions, which is not done
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of must equal n={n} (or be left out): choosing the best of more completions "
                             f"than are returned is not supported, got {best_of}")
        return best_of

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt, info: ValidationInfo):
        return checked_prompts(prompt, max_request_len(info))

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token-id lists)."""
        return prompt_list(self.prompt)

    @property
    def asked_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt as the completion is scored; echo with max_tokens 0 scores it too,
        logprobs or not: a prompt alone is a scored prompt to the engine."""
        if not self.echo:
            return None
        return 0 if self.logprobs is None and self.max_tokens == 0 else self.logprobs


class EmbeddingRequest(OpenAIBody):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's truncate_prompt_tokens (keep each input's last that many
    tokens, -1: max_model_len's worth, instead of refusing a longer one)."""
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # before input: input's check reads it
    # as CompletionRequest's prompt: checked by _input_shape, not a pydantic union
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, as OpenAI's; nothing here keys on it

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value, info: ValidationInfo):
        # a truncated input may be longer than the limit: the body's size cap bounds it
        truncated = info.data.get("truncate_prompt_tokens") is not None
        return checked_prompts(value, None if truncated else max_request_len(info), "input")

    @property
    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)

    @property
    def stream(self) -> bool:
        return False  # an embedding comes whole


def _score_inputs(value, field: str):
    """A query or document list: a text, token ids, or a list of texts or of token-id lists (vLLM's score inputs)."""
    if type(value) is str or _is_token_ids(value) and value:
        return value
    if type(value) is not list or not value or not all(type(v) is str or _is_token_ids(v) and v for v in value):
        raise ValueError(f"{field} must be a text, token ids, or a non-empty list of texts or of token-id lists")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"{field} has {len(value)} items, more than the limit of {MAX_PROMPTS} per request")
    return value


class ScoreRequest(OpenAIBody):
    """POST /score (and /v1/score): vLLM's. text_1 (queries: one, or one per document) against text_2 (the
    documents); queries/documents and data_1/data_2 as its other spellings."""
    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    data_1: Any = None
    data_2: Any = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    user: str | None = None

    def pair_inputs(self) -> tuple:
        """(queries, documents) from whichever spelling the body used; ValueError naming the fields."""
        spellings = [(a, b) for a, b in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))
                     if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(spellings) != 1:
            raise InvalidRequestError("give the queries and documents once: text_1 and text_2 (or queries and "
                                      "documents, or data_1 and data_2)", "text_1")
        first, second = spellings[0]
        return tuple(_score_inputs_named(getattr(self, name), name) for name in (first, second))

    @property
    def stream(self) -> bool:
        return False


def _score_inputs_named(value, field: str):
    try:
        return _score_inputs(value, field)
    except ValueError as e:
        raise InvalidRequestError(str(e), field) from None


class RerankDocument(OpenAIBody):
    text: str


class RerankRequest(OpenAIBody):
    """POST /rerank, /v1/rerank and /v2/rerank: Jina's and Cohere's shape (vLLM's): the documents ranked by their
    score against the query, the top_n best (all when 0 or absent), with their text unless return_documents=false."""
    model: str | None = None
    query: str | list[int]
    documents: list[str | RerankDocument | list[int]]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    max_tokens_per_doc: int | None = None  # Cohere's: refused unless absent (use truncate_prompt_tokens)
    user: str | None = None

    @field_validator("documents")
    @classmethod
    def _documents(cls, value):
        if not value:
            raise ValueError("documents is empty: there is nothing to rerank")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"has {len(value)} documents, more than the limit of {MAX_PROMPTS} per request")
        return value

    @field_validator("max_tokens_per_doc")
    @classmethod
    def _no_max_tokens_per_doc(cls, value):
        if value is not None:
            raise ValueError("max_tokens_per_doc is not supported: truncate_prompt_tokens bounds each pair's prompt")
        return value

    def document_inputs(self) -> list[str | list[int]]:
        return [document.text if isinstance(document, RerankDocument) else document for document in self.documents]

    @property
    def stream(self) -> bool:
        return False


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBody):
    url: str       # a data: URL (base64), or a file:// path under --allowed-local-media-path
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the image processor decides the resolution


class ImageURLPart(OpenAIBody):
    """An image (tpengine/multimodal/chat.py reads it; an image model's chat template renders its placeholder)."""
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) pass through to the chat template, which renders them.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart | ImageURLPart] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role):
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r:.60}: a message's role is one of {', '.join(CHAT_ROLES)}")
        return role

    def template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and all(isinstance(part, TextPart) for part in self.content):
            message["content"] = "".join(part.text for part in self.content)  # joined, as OpenAI's models read them
        return message  # with images: the parts, each image's read and placed by multimodal/chat.py


class FunctionDefinition(OpenAIBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of its arguments
    strict: bool | None = None                 # the grammar enforces the schema whatever it says


class ChatTool(OpenAIBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBody):
    name: str


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: FunctionName


class ChatPrompt(OpenAIBody):
    """What the chat template renders into a prompt: /v1/chat/completions' and /tokenize's."""
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS on top of what the template writes
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: the images' min_pixels and max_pixels

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_can_fit(cls, messages, info: ValidationInfo):
        # every message the template renders takes a token at least: more than the limit cannot fit
        limit = max_request_len(info)
        if type(messages) is list and limit is not None and len(messages) > limit:
            raise ValueError(f"has {len(messages)} messages, more than could fit in the server's limit of {limit} "
                             "tokens per request")
        return messages

    @field_validator("tools")
    @classmethod
    def _tool_names_are_unique(cls, tools):
        # a call names its function: two tools of one name would leave it unclear which was called
        names = set()
        for tool in tools or ():
            if tool.function.name in names:
                raise ValueError(f"the function name {tool.function.name!r} is given to two tools: each tool "
                                 "needs a name of its own")
            names.add(tool.function.name)
        return tools


class ChatCompletionRequest(SamplingRequest, ChatPrompt):
    max_tokens: int | None = Field(None, ge=1)              # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: "auto" with tools, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None    # None: true
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    continue_final_message: Any = None
    separate_reasoning: Any = None
    stream_reasoning: Any = None
    include_reasoning: Any = None

    _unsupported = field_validator("functions", "function_call", "audio", "modalities", "prediction",
                                   "reasoning_effort", "verbosity", "web_search_options", "store",
                                   "metadata", "continue_final_message", "separate_reasoning", "stream_reasoning",
                                   "include_reasoning")(_refuse_unsupported)

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, tool_choice, info: ValidationInfo):
        if "tools" not in info.data:
            return tool_choice  # the tools were refused, saying why
        tools = info.data["tools"]
        if tool_choice not in (None, "none") and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in \
                {tool.function.name for tool in tools}:
            raise ValueError(f"tool_choice names the function {tool_choice.function.name!r}, which is not among "
                             "the tools")
        return tool_choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when there are tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs, info: ValidationInfo):
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top_logprobs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(OpenAIBody):
    """POST /tokenize (vLLM's) with a prompt: its token ids as /v1/completions would run it."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (if it adds one) before the text
    return_token_strs: bool = False

    @property
    def prompts(self) -> list[str]:
        return [self.prompt]


class TokenizeChatRequest(ChatPrompt):
    """POST /tokenize (vLLM's) with messages: the prompt's token ids as /v1/chat/completions would run it."""
    model: str | None = None
    return_token_strs: bool = False


def tokenize_request_kind(data: dict) -> type[OpenAIBody]:
    """Which of vLLM's two shapes a /tokenize body has: a chat's if it has messages, else a prompt's."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class DetokenizeRequest(OpenAIBody):
    """POST /detokenize (vLLM's): the text of token ids."""
    model: str | None = None
    # token ids: checked by _token_ids, at C speed (a pydantic list[int] took seconds on a long list)
    tokens: Any

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_ids(cls, tokens, info: ValidationInfo):
        limit = max_request_len(info)
        if type(tokens) is list and limit is not None and len(tokens) > limit:  # refused before its ids are read
            raise ValueError(f"has {len(tokens)} token ids, more than the server's limit of {limit} tokens per "
                             "request")
        if not _is_token_ids(tokens):
            raise ValueError("must be a list of token ids (integers >= 0)")
        return tokens


class LoadLoRAAdapterRequest(OpenAIBody):
    """POST /v1/load_lora_adapter (vLLM's, with --allow-runtime-lora-updating): serve a PEFT adapter folder as a
    model named lora_name."""
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    load_inplace: bool = False

    @field_validator("load_inplace")
    @classmethod
    def _not_in_place(cls, load_inplace: bool) -> bool:
        if load_inplace:
            raise ValueError("reloading an adapter in place is not supported: unload it, then load it")
        return load_inplace


class UnloadLoRAAdapterRequest(OpenAIBody):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving an adapter; its running requests finish."""
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: Annotated[int, Field(ge=1)] | None = None
