"""Engine settings: validated once on rank 0, then sent to every worker as a msgspec struct.

A record: it imports nothing of the engine, the runner or the models, and neither torch nor transformers.
"""
import msgspec

from tpengine.hf_config import HFConfig, head_dim_of, load_hf_config, tensor_parallel_sizes

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flash_attn")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# "auto": the model's dtype; "fp8" / "fp8_e4m3" (vLLM's names): e4m3 with per-layer K and V scales, twice the tokens
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # how a model writes its thinking: <think>...</think>
SCHEDULING_POLICIES = ("mixed", "prefill_first")  # vLLM's and nano-vllm's (engine/scheduler.py runs them)
ONLINE_QUANTIZATIONS = ("int8", "int4", "fp8")  # a float checkpoint quantized at load (tpengine/models/loader.py)
# the CPU has no FP8 matmul: online fp8 there would only round the weights and keep them float (as vLLM, refused)
FP8_NEEDS_A_GPU = ("quantization='fp8' runs FP8 matmuls, which need a CUDA GPU of compute capability 8.9 or "
                   "newer (Ada, Hopper); on {where} use quantization='int8'")
SPECULATIVE_METHODS = ("ngram", "draft_model")  # proposers the engine has (engine/proposer.py, runner/drafter.py)
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


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str
    tensor_parallel_size: int = 1
    # pipeline stages, each a contiguous slice of the layers on its own tensor-parallel group: tp x pp ranks
    pipeline_parallel_size: int = 1
    # layers per stage, first stage first (None: as even as can be, the later stages taking one more)
    pp_layer_partition: list[int] | None = None
    # steps in flight at once, each from its own scheduler (None: pipeline_parallel_size, so every stage has
    # one; 1: the stages take turns, the pipeline only splits the memory)
    max_steps_in_flight: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    kvcache_block_size: int = 256
    kv_cache_dtype: str = "auto"               # KV_CACHE_DTYPES; fp8: the triton or torch attention backend
    num_kvcache_blocks: int | None = None
    kvcache_memory_gb: float | None = None     # CPU: KV-cache budget per rank (default: what the limits need, at most 4)
    gpu_memory_utilization: float = 0.9        # CUDA: fraction of the GPU the engine may fill
    max_num_seqs: int = 512
    # most tokens through one forward (decode tokens and prompt chunks together); None: the device's
    # default, 2048 on the CPU (its activations stay in cache), 16384 on CUDA
    max_num_batched_tokens: int | None = None
    # "mixed": every running request gets its next token each step, prompt chunks fill the rest of the
    # budget; "prefill_first": nano-vllm's, a prefill step whenever a prompt waits
    scheduling_policy: str = "mixed"
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int | None = 0                        # unseeded sampled requests draw from a generator seeded by it; None: random
    # a worker that takes longer than this over one step is taken for stuck (stopped, a wedged kernel
    # or host): every rank is stopped and the step fails with WorkerFailedError naming it
    step_timeout_s: float = 300.0
    # a reasoning model's parser ("qwen3", "deepseek_r1"): structured outputs constrain what follows its
    # thinking (the server also splits the thinking off as reasoning_content)
    reasoning_parser: str | None = None
    # quantize a float checkpoint's linears as they load: "int8" (per output channel) or "int4" (groups of
    # quantization_group_size input features), symmetric; the LM head and embedding too unless
    # quantize_lm_head is False. "fp8": e4m3 per output channel with inputs quantized per token, the linears
    # only (LM head and embedding stay float), CUDA sm_89+ only. A quantized checkpoint needs none of this:
    # its own config says how.
    quantization: str | None = None
    quantization_group_size: int = 128
    quantize_lm_head: bool = True
    # speculative decoding: vLLM's dict (validate makes it a SpeculativeConfig), or None for none
    speculative_config: SpeculativeConfig | None = None

    def validate(self, hf_config: HFConfig) -> None:
        """Raise ValueError for settings that can never work, before any process starts."""
        def positive(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_model_len"):
            positive(name)
        if self.max_num_batched_tokens is not None:
            positive("max_num_batched_tokens")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, "
                             f"got {self.reasoning_parser!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        block_size = self.kvcache_block_size
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {block_size!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.num_kvcache_blocks is not None:
            positive("num_kvcache_blocks")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.step_timeout_s, bool) or not isinstance(self.step_timeout_s, (int, float)) \
                or not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be a number of seconds > 0, got {self.step_timeout_s!r}")
        if self.kvcache_memory_gb is not None and not self.kvcache_memory_gb > 0:
            raise ValueError(f"kvcache_memory_gb must be > 0, got {self.kvcache_memory_gb}")
        if self.quantization is not None:
            if self.quantization not in ONLINE_QUANTIZATIONS:
                raise ValueError(f"quantization must be one of {ONLINE_QUANTIZATIONS} or None, "
                                 f"got {self.quantization!r}")
            if hf_config.quantization_config:
                raise ValueError(f"quantization={self.quantization!r} quantizes a float checkpoint, but "
                                 f"{self.model!r} is already quantized (its config.json has a quantization_config)")
            if hf_config.model_type == "gpt_oss":  # its experts load whole per projection, float only
                raise ValueError(f"quantization={self.quantization!r} is not supported for gpt-oss: its experts, most "
                                 "of its weights, would stay float")
            positive("quantization_group_size")
            if self.quantization == "fp8" and self.device == "cpu":
                raise ValueError(FP8_NEEDS_A_GPU.format(where="the CPU"))
        # settings of online quantization that would do nothing are refused, not ignored
        if self.quantization != "int4" and self.quantization_group_size != 128:
            raise ValueError(f"quantization_group_size={self.quantization_group_size} applies to quantization='int4' "
                             f"only, not quantization={self.quantization!r}")
        if self.quantization in (None, "fp8") and not self.quantize_lm_head:
            raise ValueError("quantize_lm_head=False applies to quantization='int8' or 'int4' only, not "
                             f"quantization={self.quantization!r}")
        self._check_tensor_parallel(hf_config, "the model")
        self._check_pipeline(hf_config)
        if self.quantization == "int4":
            self._check_groups(hf_config)
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self._check_draft(hf_config)

    def _check_tensor_parallel(self, hf_config: HFConfig, whose: str) -> None:
        tp = self.tensor_parallel_size
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {whose}'s {heads} attention heads")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} and {whose}'s {kv_heads} KV heads must divide one another")
        for name, size in tensor_parallel_sizes(hf_config).items():
            if size % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {whose}'s {name}={size}")

    @property
    def world_size(self) -> int:
        """Every rank of the engine: each pipeline stage's tensor-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def pipeline_layers(self) -> list[tuple[int, int]]:
        """Each pipeline stage's layers of the model, [start, end)."""
        num_layers = load_hf_config(self.model).num_hidden_layers
        return layer_partition(num_layers, self.pipeline_parallel_size, self.pp_layer_partition)

    def _check_pipeline(self, hf_config: HFConfig) -> None:
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
        if pp > 1 and self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError("speculative decoding with a draft model runs on one pipeline stage only: use "
                             "pipeline_parallel_size=1, or method='ngram'")

    def _check_draft(self, hf_config: HFConfig) -> None:
        """The draft model is sharded over the engine's ranks and reads the target's token ids."""
        path = self.speculative_config.model
        draft = load_hf_config(path)  # ValueError naming the file or field at fault
        if draft.vocab_size != hf_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {path!r} has a vocabulary of {draft.vocab_size} "
                             f"tokens, the model {hf_config.vocab_size}: a draft must share the model's vocabulary")
        self._check_tensor_parallel(draft, f"the draft model {path!r}")
        if self.quantization == "int4" and not draft.quantization_config:  # a float draft is quantized as the model
            self._check_groups(draft, f"the draft model {path!r}")

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

