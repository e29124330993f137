"""Engine settings, each declared once: its type, default, group, help and flag (cli.py makes every one a flag of
`generate` and `serve`, and docs/cli.md lists them); resolved once on rank 0, then sent to every worker as a
msgspec struct.

A record: it imports nothing of the engine, the runner or the models, and neither torch nor transformers.
"""
import functools
import types
from collections.abc import Mapping
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec

from tpengine.families import FAMILIES
from tpengine.hf_config import (HFConfig, head_dim_of, load_hf_config, long_rope_threshold_of, max_model_len_of,
                                max_positions_of, tensor_parallel_sizes)

MLA_PREFILL_FORMS = ("auto", "absorbed", "expanded")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flash_attn")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# "auto": the model's dtype; "fp8" / "fp8_e4m3" (vLLM's names): e4m3 with per-layer K and V scales, twice the tokens
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # how a model writes its thinking: <think>...</think>
GGUF_ACTIVATIONS = ("auto", "float")
RUNNERS = ("generate", "pooling")  # vLLM's names: a generative engine (that embeds too), or one that only embeds
SCHEDULING_POLICIES = ("mixed", "prefill_first")  # vLLM's and nano-vllm's (engine/scheduler.py runs them)
ONLINE_QUANTIZATIONS = ("int8", "int4", "fp8")  # a float checkpoint quantized at load (tpengine/models/loader.py)
# the CPU has no FP8 matmul: online fp8 there would only round the weights and keep them float (as vLLM, refused)
FP8_NEEDS_A_GPU = ("quantization='fp8' runs FP8 matmuls, which need a CUDA GPU of compute capability 8.9 or "
                   "newer (Ada, Hopper); on {where} use quantization='int8'")
# proposers the engine has (engine/proposer.py, runner/drafter.py, runner/mtp_drafter.py)
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
DEFAULT_IMAGES_PER_PROMPT = 999  # vLLM's limit_mm_per_prompt default for each modality
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram length when neither prompt_lookup_min nor _max is given
# Past this many tokens proposed a step, even a draft 90% right would see the next one kept under 4% of the
# time (0.9 ** 33), while each costs a row of the verify forward; vLLM's users propose up to ~16.
MAX_SPECULATIVE_TOKENS = 32


def layer_partition(num_layers: int, num_stages: int, override: list[int] | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's layers as [start, end): override's counts, or as even as can be with the later
    stages taking one more (the last also holds the final norm and LM head, the first the embedding)."""
    if override is None:
        counts = [num_layers // num_stages + (i >= num_stages - num_layers % num_stages) for i in range(num_stages)]
    else:
        counts = list(override)
        if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition={override!r} must be {num_stages} counts >= 1 (one per pipeline "
                             f"stage) that add up to the model's {num_layers} layers")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


class SpeculativeConfig(msgspec.Struct, kw_only=True):
    """Speculative decoding, as vLLM's speculative_config: each step a speculating request's next
    num_speculative_tokens tokens are proposed and verified in one forward (engine/scheduler.py)."""
    method: str
    num_speculative_tokens: int
    # n-gram: the longest suffix of prompt_lookup_max..prompt_lookup_min tokens found earlier in the
    # sequence proposes the tokens that followed it there
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # draft_model: a checkpoint with the target's vocabulary, sharded over the same ranks (runner/drafter.py)
    model: str | None = None
    # vLLM's: steps of this many running rows or more take no drafts
    disable_by_batch_size: int | None = None
    # per batch size, draft only where steps with drafts have measured faster (engine/draft_policy.py)
    adaptive: bool = True

    @classmethod
    def from_dict(cls, spec: dict) -> "SpeculativeConfig":
        """vLLM's dict, checked: unknown keys, and keys of the other method, are refused by name."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size", "adaptive"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        policy = {name: spec[name] for name in ("disable_by_batch_size", "adaptive") if spec.get(name) is not None}
        if "adaptive" in policy and not isinstance(policy["adaptive"], bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {policy['adaptive']!r}")
        model = spec.get("model")
        if model in ("ngram", "[ngram]"):  # vLLM's older spelling of the n-gram method
            model = None
            spec = {**spec, "method": spec.get("method") or "ngram"}
        method = spec.get("method") or ("draft_model" if model is not None else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: method 'draft_model' needs \"model\", the draft checkpoint's "
                                 f"path, got {model!r}")
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(spec))
            if lookup:
                raise ValueError(f"speculative_config: {lookup} apply to method 'ngram' only, not 'draft_model'")
            config = cls(method=method, num_speculative_tokens=spec.get("num_speculative_tokens"), model=model,
                         **policy)
            config._check_numbers()
            return config
        if model is not None:
            raise ValueError(f"speculative_config: \"model\" ({model!r}) is a draft checkpoint, which method "
                             f"{method!r} does not take")
        if method == "mtp":  # the checkpoint's own multi-token-prediction layer (DeepSeek V3)
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(spec))
            if lookup:
                raise ValueError(f"speculative_config: {lookup} apply to method 'ngram' only, not 'mtp'")
            config = cls(method=method, num_speculative_tokens=spec.get("num_speculative_tokens"), **policy)
            config._check_numbers()
            return config
        lookup_min, lookup_max = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        config = cls(method=method, num_speculative_tokens=spec.get("num_speculative_tokens"),
                     prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max, **policy)
        config._check_numbers("prompt_lookup_min", "prompt_lookup_max")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={config.prompt_lookup_min} is more than "
                             f"prompt_lookup_max={config.prompt_lookup_max}")
        return config

    def _check_numbers(self, *names: str) -> None:
        if self.disable_by_batch_size is not None:
            names += ("disable_by_batch_size",)
        for name in ("num_speculative_tokens", *names):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={self.num_speculative_tokens} is more than "
                             f"the limit of {MAX_SPECULATIVE_TOKENS} tokens proposed per step")


# How settings are grouped in EngineConfig, validated, shown by --help and logged, as vLLM's EngineArgs groups them
SETTING_GROUPS = {
    "model": "the checkpoint and what it runs as",
    "device": "where and how the forward runs",
    "parallel": "tensor- and pipeline-parallel ranks",
    "cache": "the KV cache",
    "scheduler": "what each step runs",
    "quantization": "quantizing a float checkpoint as it loads",
    "speculative": "speculative decoding",
    "lora": "LoRA adapters served on the model (multi-LoRA)",
}


class Setting(msgspec.Struct, frozen=True):
    """What the command line and docs/cli.md say of an EngineConfig field: `generate` and `serve` both take it."""
    group: str                              # a SETTING_GROUPS key
    help: str
    flag: str | None = None                 # None: --the-field-name (a bool also takes --no-the-field-name)
    choices: tuple[str, ...] | None = None  # the values validate accepts (and None, where that is the default)
    default_help: str | None = None         # what a None default means


class EngineField(msgspec.Struct, frozen=True):
    name: str
    type: Any       # the annotation, Setting aside: int, float | None, list[int] | None, ...
    default: Any    # msgspec.NODEFAULT where the field has none
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.name.replace("_", "-")

    @property
    def value_type(self) -> Any:
        """The type a value given takes: the annotation without its None."""
        if get_origin(self.type) in (Union, types.UnionType):
            [value_type] = [arg for arg in get_args(self.type) if arg is not type(None)]
            return value_type
        return self.type


@functools.cache
def engine_fields() -> Mapping[str, EngineField]:
    """Every EngineConfig field with its Setting, by name, in declaration order (group by group)."""
    fields = {}
    for field in msgspec.structs.fields(EngineConfig):
        value_type, setting = get_args(field.type)
        assert isinstance(setting, Setting), f"EngineConfig.{field.name} is declared without its Setting"
        fields[field.name] = EngineField(field.name, value_type, field.default, setting)
    return types.MappingProxyType(fields)


class EngineConfig(msgspec.Struct, kw_only=True):
    """Every setting of the engine, declared once with its Setting (group, help, flag). LLM(model, **kwargs) and the
    command line build it; resolve() checks it against the model and fills in what the model decides."""
    # --- model -------------------------------------------------------------------------------------------------
    model: Annotated[str, Setting(
        "model", "local Hugging Face checkpoint folder of a supported family: Qwen3, Qwen3-MoE, Qwen2/2.5, "
                 "Llama 3.x, Mistral, Gemma 2/3, Phi-3/3.5/4, gpt-oss, DeepSeek V2/V3, Qwen2.5-VL, Qwen3-VL; or a .gguf "
                 "file (Llama, Qwen2, Qwen3, Gemma 2/3, Qwen3-MoE)")]
    # None: the model's own (its folder's tokenizer files, or the one a GGUF file holds)
    tokenizer: Annotated[str | None, Setting(
        "model", "folder whose Hugging Face tokenizer replaces the model's (a GGUF file's, say)",
        default_help="the model's")] = None
    dtype: Annotated[str, Setting(
        "model", "weights and KV-cache dtype; auto = float32 on CPU, the checkpoint's on CUDA; a half dtype the CPU "
                 "has no instructions for runs as float32 (bfloat16 keeping its linear weights in bfloat16 on AVX2 "
                 "CPUs)", choices=DTYPES)] = "auto"
    # resolve() bounds it by the positions the model (and a draft model) encodes: every request's limit
    max_model_len: Annotated[int, Setting(
        "model", "longest prompt + output; at most what the model's positions reach")] = 4096
    # unseeded sampled requests draw from a generator seeded by it; None: random
    seed: Annotated[int | None, Setting(
        "model", "seeds what unseeded sampled requests draw: the same command gives the same text",
        flag="--engine-seed")] = 0
    runner: Annotated[str, Setting(
        "model", "generate: completions (embedding requests run too, pooled as the checkpoint says); pooling: an "
                 "embedding model or a classifier (a *ForSequenceClassification checkpoint, or hf_overrides' "
                 "classifier_from_token: always pooling), generation requests refused (LLM's task='embed')", choices=RUNNERS)] = "generate"
    # vLLM's hf_overrides: keys that replace config.json's on every rank (a reranker's classifier_from_token)
    hf_overrides: Annotated[dict | None, Setting(
        "model", 'JSON whose keys replace config.json\'s, as vLLM\'s: {"architectures": '
                 '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]} scores with '
                 'Qwen3-Reranker', default_help="none")] = None
    # an image model's images per prompt, as vLLM's limit_mm_per_prompt ({"image": N}); None: vLLM's default
    limit_mm_per_prompt: Annotated[dict | None, Setting(
        "model", 'JSON: the most images one prompt may hold, {"image": N} (an image model: Qwen2.5-VL, Qwen3-VL, Gemma 3)',
        default_help=f'{{"image": {DEFAULT_IMAGES_PER_PROMPT}}}')] = None
    # vLLM's allowed_local_media_path: file:// image URLs are read only from under it
    allowed_local_media_path: Annotated[str | None, Setting(
        "model", "folder whose files chat messages may name as file:// image URLs (nothing is fetched over the "
                 "network: other images come as data: URLs)", default_help="none: file URLs refused")] = None
    # a reasoning model's parser: structured outputs constrain what follows its thinking (the server also
    # splits the thinking off as reasoning_content)
    reasoning_parser: Annotated[str | None, Setting(
        "model", "a reasoning model's <think>...</think>: structured outputs constrain only the answer after it, "
                 "and serve returns the thinking as reasoning_content", choices=REASONING_PARSERS,
        default_help="none")] = None
    # --- device ------------------------------------------------------------------------------------------------
    device: Annotated[str, Setting(
        "device", "where the model runs; auto = CUDA where there is a GPU, else the CPU", choices=DEVICES)] = "auto"
    attention_backend: Annotated[str, Setting(
        "device", "attention implementation; auto = flash_attn, else triton on CUDA, and cpu (a C++ kernel built on "
                  "first use), else torch, on the CPU", choices=ATTENTION_BACKENDS)] = "auto"
    enforce_eager: Annotated[bool, Setting(
        "device", "decode eagerly: no CUDA graphs, no replayed CPU decode steps")] = False
    # every reduction in a fixed order and split, whatever the batch (layers/batch_invariant.py)
    batch_invariant: Annotated[bool, Setting(
        "device", "a request's tokens and logprobs are bit-identical whatever else shares its steps (batch size, "
                  "chunking, its row, prefix hits): fixed reduction orders, at some speed")] = False
    # multi-head latent attention's prefill (layers/latent_attention.py); decode always attends over the latents
    mla_prefill: Annotated[str, Setting(
        "device", "DeepSeek's latent attention in prefill: absorbed (over the cached latents, as decode), expanded "
                  "(per-head keys and values made from them) or auto, the fewer FLOPs for each step",
        choices=MLA_PREFILL_FORMS)] = "auto"
    # what the first requests would otherwise pay on their path (runner/warmup.py): serve's /health waits for it
    warm_up: Annotated[bool, Setting(
        "device", "before taking requests, run a dummy step of every decode batch size up to max_num_seqs and a few "
                  "prompt sizes on every rank: CPU decode replays recorded, kernels built, a CPU KV cache's pages "
                  "written once, so the first requests run at full speed; a one-rank CPU engine also measures "
                  "which small steps run faster on one thread")] = False
    # --- parallel ----------------------------------------------------------------------------------------------
    tensor_parallel_size: Annotated[int, Setting(
        "parallel", "tensor-parallel size: ranks per pipeline stage", flag="--tp")] = 1
    # pipeline stages, each a contiguous slice of the layers on its own tensor-parallel group: tp x pp ranks
    pipeline_parallel_size: Annotated[int, Setting(
        "parallel", "pipeline-parallel size: stages, each a slice of the layers on its own --tp ranks; tp x pp ranks "
                    "in all", flag="--pp")] = 1
    pp_layer_partition: Annotated[list[int] | None, Setting(
        "parallel", "layers per pipeline stage, first stage first, e.g. 14,14",
        default_help="as even as can be, later stages taking one more")] = None
    # each step in flight has its own scheduler; resolve() makes None pipeline_parallel_size
    max_steps_in_flight: Annotated[int | None, Setting(
        "parallel", "pipeline steps in flight at once, each from its own scheduler; 1: the stages take turns, the "
                    "pipeline only splits the memory", default_help="--pp, one per stage")] = None
    # a wedged kernel or host would otherwise hang the engine: every rank is stopped and the step fails
    # with WorkerFailedError naming the worker
    step_timeout_s: Annotated[float, Setting(
        "parallel", "seconds a worker may take over one step before it is taken for stuck and every rank is "
                    "stopped")] = 300.0
    # --- cache -------------------------------------------------------------------------------------------------
    kvcache_block_size: Annotated[int, Setting(
        "cache", "KV-cache block size in tokens, a power of two >= 16", flag="--block-size")] = 256
    kv_cache_dtype: Annotated[str, Setting(
        "cache", "KV-cache element type; auto = the model's dtype; fp8 (= fp8_e4m3): e4m3 with per-layer K and V "
                 "scales (the checkpoint's, else 1.0), twice the tokens of a 16-bit cache in the same memory; "
                 "attention through triton on CUDA (compute capability 8.9+), torch on the CPU",
        choices=KV_CACHE_DTYPES)] = "auto"
    num_kvcache_blocks: Annotated[int | None, Setting(
        "cache", "KV-cache blocks", default_help="by memory")] = None
    kvcache_memory_gb: Annotated[float | None, Setting(
        "cache", "KV-cache GiB per rank (on CUDA in place of what gpu_memory_utilization leaves)",
        default_help="CPU: what the limits can use, at most 4; CUDA: what gpu_memory_utilization leaves")] = None
    gpu_memory_utilization: Annotated[float, Setting(
        "cache", "CUDA: the fraction of each GPU the engine may fill (weights, activations, KV cache)")] = 0.9
    enable_prefix_caching: Annotated[bool, Setting(
        "cache", "reuse the KV-cache blocks of prompt prefixes computed before")] = True
    # --- scheduler ---------------------------------------------------------------------------------------------
    max_num_seqs: Annotated[int, Setting("scheduler", "most sequences running at once")] = 512
    # decode tokens and prompt chunks together; on the CPU a smaller step's activations stay in cache
    max_num_batched_tokens: Annotated[int | None, Setting(
        "scheduler", "most tokens through one forward, decodes and prompt chunks together",
        default_help="2048 on the CPU, 16384 on CUDA")] = None
    scheduling_policy: Annotated[str, Setting(
        "scheduler", "mixed: every running request gets a token each step, prompt chunks fill the rest; "
                     "prefill_first: nano-vllm's, decodes wait while a prompt prefills",
        choices=SCHEDULING_POLICIES)] = "mixed"
    # --- quantization ------------------------------------------------------------------------------------------
    # A quantized checkpoint needs none of these: its own config says how.
    quantization: Annotated[str | None, Setting(
        "quantization", "quantize a float checkpoint's weights as they load: int8 per output channel, int4 in "
                        "groups (--quantization-group-size), symmetric; fp8 (e4m3 per output channel, inputs per "
                        "token) on CUDA sm_89+ only; a quantized checkpoint (GPTQ, AWQ, compressed-tensors, fp8) "
                        "needs no flag", choices=ONLINE_QUANTIZATIONS, default_help="none")] = None
    quantization_group_size: Annotated[int, Setting(
        "quantization", "input features per int4 scale")] = 128
    quantize_lm_head: Annotated[bool, Setting(
        "quantization", "with --quantization int8 or int4: quantize the LM head and embedding too; "
                        "--no-quantize-lm-head keeps them in floats")] = True
    # a GGUF file's block-quantized linears (gguf/tensors.py): auto takes the platform's activation for quantized
    # weights (the CPU's int8 per token, as llama.cpp quantizes them; CUDA's float)
    gguf_activations: Annotated[str, Setting(
        "quantization", "a GGUF file's quantized linears: auto quantizes each token's input to int8 on the CPU, as "
                        "llama.cpp does (integer dot products, a faster prefill); float multiplies it as it is "
                        "(exactly the dequantized weights' result)", choices=GGUF_ACTIVATIONS)] = "auto"
    # --- speculative -------------------------------------------------------------------------------------------
    # vLLM's dict; validate makes it a SpeculativeConfig
    speculative_config: Annotated[SpeculativeConfig | None, Setting(
        "speculative", 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_min": 1, "prompt_lookup_max": 3}, a draft model with the model\'s '
                       'vocabulary: {"model": "PATH", "num_speculative_tokens": 4}, or DeepSeek V3\'s own MTP layer: '
                       '{"method": "mtp", "num_speculative_tokens": 2}', default_help="none")] = None
    # --- lora --------------------------------------------------------------------------------------------------
    # adapters run in max_loras slots beside the weights (each step mixes rows of any of them and of the base); the
    # ranks keep max_cpu_loras read adapters in host memory, so one evicted from its slot comes back without a read
    enable_lora: Annotated[bool, Setting(
        "lora", "serve LoRA adapters (PEFT folders) on the model: requests name one (lora_request, or the "
                "server's model field), rows of different adapters share steps")] = False
    max_loras: Annotated[int, Setting(
        "lora", "adapters resident at once (their slots); a request for another waits until a slot frees")] = 1
    max_lora_rank: Annotated[int, Setting("lora", "largest adapter rank accepted")] = 16
    max_cpu_loras: Annotated[int | None, Setting(
        "lora", "adapters each rank keeps read in host memory (at least max_loras)",
        default_help="max_loras")] = None

    def resolve(self, hf_config: HFConfig) -> "EngineConfig":
        """A copy, validated against the model, with what the model decides filled in: max_model_len bounded by
        the positions the model and a draft model encode, max_steps_in_flight, speculative_config as a
        SpeculativeConfig. The config every rank runs."""
        config = msgspec.structs.replace(self)
        config.validate(hf_config)
        max_model_len = max_model_len_of(hf_config, config.max_model_len)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":  # the draft model's positions bound requests too
            max_model_len = max_model_len_of(load_hf_config(spec.model), max_model_len)
        # a classifier (a reranker) has no LM head to generate with: it runs as a pooling engine
        runner = "pooling" if hf_config.is_classifier else config.runner
        return msgspec.structs.replace(config, max_model_len=max_model_len, runner=runner,
                                       max_steps_in_flight=config.max_steps_in_flight or config.pipeline_parallel_size)

    def validate(self, hf_config: HFConfig) -> None:
        """Raise ValueError for settings that can never work, before any process starts: each group's checks."""
        self._check_choices()
        self._validate_model()
        self._validate_parallel(hf_config)
        self._validate_cache()
        self._validate_scheduler()
        self._validate_quantization(hf_config)
        self._validate_speculative(hf_config)
        self._validate_lora()
        self._validate_images(hf_config)
        if hf_config.kv_lora_rank is not None:
            self._check_latent_attention(hf_config)

    @property
    def images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)

    def _validate_images(self, hf_config: HFConfig) -> None:
        limit = self.limit_mm_per_prompt
        reads_images = FAMILIES[hf_config.model_type].images
        if limit is not None:
            if not isinstance(limit, dict) or any(not isinstance(key, str) for key in limit):
                raise ValueError(f'limit_mm_per_prompt must be a dict such as {{"image": 4}}, got {limit!r}')
            if set(limit) - {"image"}:
                raise ValueError(f"limit_mm_per_prompt: {sorted(set(limit) - {'image'})} not supported: images are "
                                 "the one modality (video and audio are not)")
            count = limit.get("image", DEFAULT_IMAGES_PER_PROMPT)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"limit_mm_per_prompt image must be an integer >= 0, got {count!r}")
            if not reads_images:
                raise ValueError(f"limit_mm_per_prompt applies to image models; {hf_config.model_type} reads none")
        # Gemma 3 serves its text model alone there instead (LLMEngine: text_only_reason)
        reads_images = reads_images and not FAMILIES[hf_config.model_type].bidirectional_images
        if reads_images and self.speculative_config is not None:
            raise ValueError(f"speculative_config is not supported for {hf_config.model_type}: its verify rows "
                             "would need M-RoPE positions")
        if reads_images and self.pipeline_parallel_size > 1:
            raise ValueError(f"pipeline_parallel_size > 1 is not supported for {hf_config.model_type}: its vision "
                             "tower and M-RoPE run on one stage")

    def _check_latent_attention(self, hf_config: HFConfig) -> None:
        if self.enable_lora:
            raise ValueError(f"enable_lora is not supported for {hf_config.model_type}: LoRA adapters target q/k/v "
                             "projections, and its latent attention has none")
        if self.batch_invariant:  # its absorbed projections are batched matmuls, not row-tiled linears
            raise ValueError(f"batch_invariant is not supported for {hf_config.model_type}'s latent attention")

    def describe(self) -> list[str]:
        """One line per group, 'group: name=value ...': what the engine logs as it starts."""
        values = {group: [] for group in SETTING_GROUPS}
        for field in engine_fields().values():
            values[field.setting.group].append(f"{field.name}={getattr(self, field.name)!r}")
        return [f"{group}: {' '.join(settings)}" for group, settings in values.items()]

    @property
    def world_size(self) -> int:
        """Every rank of the engine: each pipeline stage's tensor-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def pipeline_layers(self) -> list[tuple[int, int]]:
        """Each pipeline stage's layers of the model, [start, end)."""
        num_layers = load_hf_config(self.model, self.hf_overrides).num_hidden_layers
        return layer_partition(num_layers, self.pipeline_parallel_size, self.pp_layer_partition)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def _check_choices(self) -> None:
        """Every field declared with choices holds one of them (or None, where that is its default)."""
        for field in engine_fields().values():
            choices, value = field.setting.choices, getattr(self, field.name)
            if choices is None or value in choices or (value is None and field.default is None):
                continue
            or_none = " or None" if field.default is None else ""
            raise ValueError(f"{field.name} must be one of {choices}{or_none}, got {value!r}")

    def _validate_model(self) -> None:
        self._check_positive("max_model_len")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json keys, got {type(self.hf_overrides).__name__}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    def _validate_parallel(self, hf_config: HFConfig) -> None:
        self._check_positive("tensor_parallel_size", "pipeline_parallel_size")
        if isinstance(self.step_timeout_s, bool) or not isinstance(self.step_timeout_s, (int, float)) \
                or not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be a number of seconds > 0, got {self.step_timeout_s!r}")
        self._check_tensor_parallel(hf_config, "the model")
        pp = self.pipeline_parallel_size
        if self.pp_layer_partition is not None:
            layer_partition(hf_config.num_hidden_layers, pp, self.pp_layer_partition)  # raises what is wrong
        elif pp > hf_config.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {hf_config.num_hidden_layers} "
                             "layers: every stage needs at least one")
        if self.max_steps_in_flight is not None:
            value = self.max_steps_in_flight
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= pp:
                raise ValueError(f"max_steps_in_flight must be an integer from 1 to pipeline_parallel_size={pp}, "
                                 f"got {value!r}")

    def _validate_cache(self) -> None:
        block_size = self.kvcache_block_size
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {block_size!r}")
        if self.num_kvcache_blocks is not None:
            self._check_positive("num_kvcache_blocks")
        if self.kvcache_memory_gb is not None and not self.kvcache_memory_gb > 0:
            raise ValueError(f"kvcache_memory_gb must be > 0, got {self.kvcache_memory_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _validate_scheduler(self) -> None:
        self._check_positive("max_num_seqs")
        if self.max_num_batched_tokens is not None:
            self._check_positive("max_num_batched_tokens")

    def _validate_quantization(self, hf_config: HFConfig) -> None:
        if self.quantization is not None:
            if hf_config.quantization_config:
                raise ValueError(f"quantization={self.quantization!r} quantizes a float checkpoint, but "
                                 f"{self.model!r} is already quantized (its config.json has a quantization_config)")
            if hf_config.model_type in ("gpt_oss", "qwen3_vl_moe"):  # experts load whole per projection, float only
                raise ValueError(f"quantization={self.quantization!r} is not supported for {hf_config.model_type}: "
                                 "its experts, most of its weights, would stay float")
            self._check_positive("quantization_group_size")
            if self.quantization == "fp8" and self.device == "cpu":
                raise ValueError(FP8_NEEDS_A_GPU.format(where="the CPU"))
        # settings of online quantization that would do nothing are refused, not ignored
        if self.quantization != "int4" and self.quantization_group_size != 128:
            raise ValueError(f"quantization_group_size={self.quantization_group_size} applies to quantization='int4' "
                             f"only, not quantization={self.quantization!r}")
        if self.quantization in (None, "fp8") and not self.quantize_lm_head:
            raise ValueError("quantize_lm_head=False applies to quantization='int8' or 'int4' only, not "
                             f"quantization={self.quantization!r}")
        if self.quantization == "int4":
            self._check_groups(hf_config)

    def _validate_speculative(self, hf_config: HFConfig) -> None:
        if self.speculative_config is None:
            return
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config.method == "mtp":
            if not hf_config.num_nextn_predict_layers:
                raise ValueError(f"speculative_config method 'mtp' needs a checkpoint with multi-token-prediction "
                                 f"layers (num_nextn_predict_layers >= 1, DeepSeek V3's); {hf_config.model_type} "
                                 f"has {hf_config.num_nextn_predict_layers}")
            if self.pipeline_parallel_size > 1:
                raise ValueError("speculative decoding with method 'mtp' runs on one pipeline stage only: use "
                                 "pipeline_parallel_size=1")
        if self.speculative_config.method == "draft_model":
            if self.pipeline_parallel_size > 1:
                raise ValueError("speculative decoding with a draft model runs on one pipeline stage only: use "
                                 "pipeline_parallel_size=1, or method='ngram'")
            self._check_draft(hf_config)

    def _validate_lora(self) -> None:
        self._check_positive("max_loras", "max_lora_rank")
        if self.max_cpu_loras is not None:
            self._check_positive("max_cpu_loras")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")

    def _check_tensor_parallel(self, hf_config: HFConfig, whose: str) -> None:
        tp = self.tensor_parallel_size
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {whose}'s {heads} attention heads")
        if kv_heads % tp and tp % kv_heads and hf_config.kv_lora_rank is None:  # MLA: one latent on every rank
            raise ValueError(f"tensor_parallel_size={tp} and {whose}'s {kv_heads} KV heads must divide one another")
        for name, size in tensor_parallel_sizes(hf_config).items():
            if size % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {whose}'s {name}={size}")

    def _check_draft(self, hf_config: HFConfig) -> None:
        """The draft model is sharded over the engine's ranks, reads the target's token ids and, with LongRoPE,
        takes the same factors for a row."""
        path = self.speculative_config.model
        draft = load_hf_config(path)  # ValueError naming the file or field at fault
        if draft.vocab_size != hf_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {path!r} has a vocabulary of {draft.vocab_size} "
                             f"tokens, the model {hf_config.vocab_size}: a draft must share the model's vocabulary")
        self._check_tensor_parallel(draft, f"the draft model {path!r}")
        if self.quantization == "int4" and not draft.quantization_config:  # a float draft is quantized as the model
            self._check_groups(draft, f"the draft model {path!r}")
        threshold = long_rope_threshold_of(hf_config)
        if long_rope_threshold_of(draft) != threshold or (
                threshold is not None and max_positions_of(draft) != max_positions_of(hf_config)):
            # one choice of LongRoPE factors per row, and one offset for the long set's rows, serve both models
            raise ValueError(f"the draft model {path!r} must use LongRoPE with the same "
                             "original_max_position_embeddings and max_position_embeddings as the model, or "
                             "neither may use it")

    def _check_groups(self, hf_config: HFConfig, whose: str = "the model") -> None:
        """Every linear's input features, and every row-parallel rank's share of them, in whole int4 groups."""
        group, tp = self.quantization_group_size, self.tensor_parallel_size
        inputs = {"hidden_size": (hf_config.hidden_size, 1),  # q/k/v, gate/up: every rank reads all of them
                  "num_attention_heads * head_dim": (hf_config.num_attention_heads * head_dim_of(hf_config), tp),
                  **{name: (size, tp) for name, size in tensor_parallel_sizes(hf_config).items()}}
        for name, (size, shards) in inputs.items():
            if (size // shards) % group:
                per_rank = f", {size // shards} per rank at tensor_parallel_size={tp}," if shards > 1 else ""
                raise ValueError(f"quantization_group_size={group} must divide {whose}'s {name}={size}{per_rank} "
                                 "for int4 groups of whole input features")

