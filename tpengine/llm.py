"""The offline API vLLM users call: LLM(model, ...).generate, .chat, .beam_search, .embed, .classify, .score and
.get_tokenizer. What vLLM's LLM has and tpengine does not (reward models, sleep mode, ...) is a NotImplementedError
that names it, never an AttributeError or an argument quietly ignored."""
import dataclasses
from itertools import islice
from typing import Any

from tqdm.auto import tqdm

from tpengine.beam_search import BeamSearch, BeamSearchOutput
from tpengine.engine.inputs import prompt_list
from tpengine.engine.llm_engine import LLMEngine
from tpengine.entrypoints.chat_template import encode_chat_text, render_chat_text
from tpengine.multimodal.chat import has_image_parts, take_images
from tpengine.errors import InvalidRequestError
from tpengine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput,
                              ScoringRequestOutput)
from tpengine.sampling_params import MAX_LOGPROBS, BeamSearchParams, PoolingParams, SamplingParams

# "auto" renders as the server does (text parts joined into one string); "openai" hands templates the parts
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")

# vLLM's arguments for features tpengine lacks: None (their default) is accepted, anything else refused
VLLM_ONLY_ARGUMENTS = {
    "prompt_adapter_request": "prompt adapters",
    "priority": "per-request priorities",
    "tokenization_kwargs": "tokenizer arguments (a text prompt is encoded as the server encodes it)",
    "guided_options_request": "guided_options_request (use SamplingParams(structured_outputs=...))",
}


def refuse_vllm_only(method: str, arguments: dict[str, Any]) -> None:
    """NotImplementedError for a vLLM argument given a value; TypeError, as Python's own, for an unknown one."""
    for name, value in arguments.items():
        if name not in VLLM_ONLY_ARGUMENTS:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
        if value is not None:
            raise NotImplementedError(f"LLM.{method}({name}=...): tpengine has no {VLLM_ONLY_ARGUMENTS[name]}")


def _not_supported(name: str, why: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.{name}() is not supported: {why}")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"vLLM's LLM.{name}(); not supported here: {why}."
    return method


def conversation_list(messages) -> list:
    """chat()'s messages as conversations: one conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
        return list(messages)
    return [messages]


def template_conversation(conversation, content_format: str) -> list[dict[str, Any]]:
    """A conversation's messages as the chat template reads them: keys set to None dropped and text parts joined
    into one string, as the server does, or with content_format "openai" every content a list of text parts."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages (dicts with 'role' and 'content'), "
                         f"got {conversation!r:.60}")
    messages = []
    for message in conversation:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"a message must be a dict with a 'role' string, got {message!r:.60}")
        message = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            for part in content:
                if not (isinstance(part, dict) and (part.get("type") == "text" and isinstance(part.get("text"), str)
                                                    or part.get("type") == "image")):
                    raise ValueError("a message's content parts must be text parts ({'type': 'text', 'text': ...}) "
                                     f"or images (image_url, image_pil); got {part!r:.60}")
            # an image's part stays a part: the template writes its placeholder
            with_images = any(part["type"] == "image" for part in content)
            message["content"] = list(content) if content_format == "openai" or with_images else \
                "".join(part["text"] for part in content)
        elif isinstance(content, str):
            if content_format == "openai":
                message["content"] = [{"type": "text", "text": content}]
        elif content is not None:
            raise ValueError(f"a message's content must be a string, a list of text parts or None, got "
                             f"{content!r:.60}")
        messages.append(message)
    return messages


# vLLM's task names, as the runner each means (LLM(model, task="embed"))
TASKS = {"generate": "generate", "embed": "pooling", "classify": "pooling", "score": "pooling"}


class LLM(LLMEngine):
    """`LLM(model, tensor_parallel_size=..., ...)`; `llm.generate(prompts, sampling_params)`, `llm.chat(messages)`,
    `llm.beam_search(prompts, BeamSearchParams(...))`, `llm.embed(prompts)`, `llm.score(query, documents)`."""

    def __init__(self, model, task: str | None = None, **kwargs):
        if task is not None:
            if task not in TASKS:
                raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
            if kwargs.setdefault("runner", TASKS[task]) != TASKS[task]:
                raise ValueError(f"task={task!r} and runner={kwargs['runner']!r} disagree")
        super().__init__(model, **kwargs)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """LLMEngine.embed; truncate_prompt_tokens (vLLM's argument) goes into every prompt's PoolingParams."""
        if truncate_prompt_tokens is not None:
            params = pooling_params if isinstance(pooling_params, (list, tuple)) else [pooling_params]
            pooling_params = [dataclasses.replace(p or PoolingParams(), truncate_prompt_tokens=truncate_prompt_tokens)
                              for p in params]
            if len(pooling_params) == 1:
                pooling_params = pooling_params[0]
        return super().embed(prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, *, use_tqdm: bool = True, pooling_params: PoolingParams | list | None = None,
                 lora_request=None) -> list[ClassificationRequestOutput]:
        """LLMEngine.classify, with vLLM's keyword arguments."""
        return super().classify(prompts, pooling_params, use_tqdm, lora_request)

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None) -> list[ScoringRequestOutput]:
        """LLMEngine.score, with vLLM's keyword arguments; truncate_prompt_tokens goes into the PoolingParams."""
        if truncate_prompt_tokens is not None:
            pooling_params = dataclasses.replace(pooling_params or PoolingParams(),
                                                 truncate_prompt_tokens=truncate_prompt_tokens)
        return super().score(data_1, data_2, pooling_params, use_tqdm, lora_request)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, **vllm_only) -> list[RequestOutput]:
        """LLMEngine.generate; vLLM's other arguments (priority, ...) are taken only as None."""
        refuse_vllm_only("generate", vllm_only)
        return super().generate(prompts, sampling_params, use_tqdm, lora_request)

    def get_tokenizer(self):
        """The Hugging Face tokenizer prompts are encoded and outputs decoded with."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: prompts are token ids and outputs have no text")
        return self.tokenizer

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, mm_processor_kwargs=None) -> list[RequestOutput]:
        """Generate a reply to each conversation (one, a list of message dicts, or a list of them); one
        RequestOutput per conversation, its prompt the rendered text. Conversations render through the chat
        template exactly as the server's /v1/chat/completions renders messages."""
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=JINJA")
        if chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CHAT_TEMPLATE_CONTENT_FORMATS}, got "
                             f"{chat_template_content_format!r:.60}")
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r:.60}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True continues the last message, so it needs "
                             "add_generation_prompt=False")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a Jinja template (a string), got {type(chat_template).__name__}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of dicts (OpenAI's tool definitions), got {tools!r:.60}")
        if continue_final_message:  # an apply_chat_template argument: the template renders as usual, then is cut
            chat_template_kwargs = {**(chat_template_kwargs or {}), "continue_final_message": True}
        texts, images = [], []
        for i, conversation in enumerate(conversation_list(messages)):
            try:
                if self.images is None and (has_image_parts(conversation) or mm_processor_kwargs is not None):
                    raise ValueError(f"this model ({self.config.model}) reads no images{self.text_only_reason}: image parts and "
                                     "mm_processor_kwargs need an image model (Qwen2.5-VL, Qwen3-VL, Gemma 3)")
                conversation, conversation_images = take_images(conversation, self.config.allowed_local_media_path)
                texts.append(render_chat_text(tokenizer, chat_template,
                                              template_conversation(conversation, chat_template_content_format),
                                              add_generation_prompt, chat_template_kwargs, tools))
                images.append(conversation_images)
            except ValueError as e:
                raise InvalidRequestError(f"conversation {i}: {e}", getattr(e, "param", "messages")) from None
        # a chat reply: a reasoning model may open its thinking with its first token (tpengine/thinking.py)
        replies = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(texts)
        replies = [dataclasses.replace(p or SamplingParams(), may_open_thinking=True)
                   if p is None or isinstance(p, SamplingParams) else p for p in replies]
        # a conversation's image placeholders written out as the model's processor writes them, then tokenized
        prompts = [{"prompt_token_ids": encode_chat_text(tokenizer, self.images.expand_text(text) if imgs else text)}
                   for text, imgs in zip(texts, images)]
        for prompt, conversation_images in zip(prompts, images):
            if conversation_images:  # mm_processor_kwargs: each image's pixel range (min_pixels, max_pixels)
                prompt.update(multi_modal_data={"image": conversation_images}, mm_processor_kwargs=mm_processor_kwargs)
        outputs = self.generate(prompts, replies, use_tqdm, lora_request)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """transformers' beam search (num_beams=beam_width, do_sample=False) for each prompt, on the engine:
        each round every running beam is a one-token request for its likeliest next tokens (their prefix is
        in the prefix cache). concurrency_limit: at most that many prompts' searches run at once."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or
                                              not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r:.60}")
        searches = []
        for i, prompt in enumerate(prompt_list(prompts)):
            try:  # checked as generate checks a prompt, none queued
                request = self._make_request(prompt, SamplingParams(temperature=0.0, max_tokens=params.max_tokens),
                                             stream=False, lora_request=lora_request)
            except ValueError as e:
                raise InvalidRequestError(f"prompt {i}: {e}", getattr(e, "param", None)) from None
            searches.append(BeamSearch(request.prompt_token_ids, params, self.scheduler.eos_token_ids))
        if not searches:
            return []
        num_logprobs = searches[0].num_logprobs
        if num_logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"beam_width={params.beam_width} needs each beam's {num_logprobs} likeliest tokens (beam_width past "
                f"the model's {num_logprobs - params.beam_width} EOS tokens), more than the limit of {MAX_LOGPROBS}",
                "beam_width")
        step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_logprobs, ignore_eos=True)
        group_size = concurrency_limit or len(searches)
        with tqdm(total=len(searches), desc="Beam search", dynamic_ncols=True, disable=not use_tqdm) as progress:
            for start in range(0, len(searches), group_size):
                group = searches[start:start + group_size]
                while live := [search for search in group if not search.done]:
                    beams = [beam for search in live for beam in search.running]
                    outputs = iter(self.generate([{"prompt_token_ids": beam.tokens} for beam in beams], step_params,
                                                 use_tqdm=False, lora_request=lora_request))
                    for search in live:
                        # no logprobs: no token could be sampled (logits not finite), so the beam has no candidates
                        search.advance([(output.outputs[0].logprobs or [{}])[0]
                                        for output in islice(outputs, len(search.running))])
                        if search.done:
                            progress.update()
        results = [search.output() for search in searches]
        for sequence in (sequence for result in results for sequence in result.sequences):
            tokens = sequence.tokens
            if sequence.finish_reason == "stop" and not params.include_stop_str_in_output:
                tokens = tokens[:-1]
            sequence.text = None if self.tokenizer is None else self.tokenizer.decode(tokens)
        return results

    # vLLM's pooling-model tasks, and controls of its runtime tpengine has no counterpart for
    encode = _not_supported("encode", "tpengine pools embeddings only: use embed()")
    reward = _not_supported("reward", "tpengine runs generative models, not reward models")
    sleep = _not_supported("sleep", "tpengine has no sleep mode; shutdown() frees the model and its KV cache")
    wake_up = _not_supported("wake_up", "tpengine has no sleep mode")
    collective_rpc = _not_supported("collective_rpc", "tpengine's workers take only its own step messages")
