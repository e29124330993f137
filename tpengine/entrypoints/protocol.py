"""Request bodies of the OpenAI API (with vLLM's sampling extensions) as pydantic v2 models."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpengine.sampling_params import SamplingParams

# One request may ask for at most this many completions per prompt (n): each is a sequence in the batch.
MAX_N = 128
# top logprobs per token, as OpenAI allows (the engine computes at most 20)
MAX_LOGPROBS = 20

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""
    # Unknown fields (user, metadata, ...) are accepted and ignored, as OpenAI's clients send some.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and token_ids in each choice

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    # OpenAI's default; null means "as many as the context allows"
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _prompt_not_empty(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list: give a string, token ids, or a list of either")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token-id lists)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts are joined as OpenAI's models read them
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)              # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
