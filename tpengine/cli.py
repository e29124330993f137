"""`tpengine generate ...`, `tpengine serve ...` and `tpengine make-tiny-model PATH`; launch/*.py run the
first two under torchrun (main_under_torchrun)."""
import argparse
import json
import logging
import os
import re
import sys

from tpengine.config import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, ONLINE_QUANTIZATIONS, REASONING_PARSERS,
                             SCHEDULING_POLICIES)
from tpengine.entrypoints.data_parallel import ROUTER_POLICIES
from tpengine.entrypoints.tool_calls import TOOL_CALL_PARSERS

MAX_NUM_SEQS = 512
# `serve` on the CPU decodes at most this many requests at once (vLLM's CPU serving default): every
# running request shares each step, so under a burst fewer at once means a lower time per output token
# for each, for a later first token for the ones that wait (docs/benchmarks.md, "Per-token latency under load").
SERVE_CPU_MAX_NUM_SEQS = 128


# Flags whose value may start with '-' (layer counts such as -1,5, which the engine then refuses by name).
_DASHED_VALUE_FLAGS = ("--pp-layer-partition",)


def _join_dashed_values(argv: list[str]) -> list[str]:
    """'--pp-layer-partition -1,5' as '--pp-layer-partition=-1,5': argparse reads a separate value that starts
    with '-' as a flag (and says "expected one argument"); joined, the value reaches its own check."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] == "--":  # the rest are positional: left as they are
            return joined + argv[i:]
        if argv[i] in _DASHED_VALUE_FLAGS and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(_join_dashed_values(sys.argv[1:] if args is None else list(args)),
                                        namespace)

    def error(self, message):
        # every user mistake reads the same: "tpengine: error: ...", exit status 2
        self.exit(2, f"tpengine: error: {message} (see: {self.prog} --help)\n")


def build_parser(*, under_torchrun: bool = False) -> argparse.ArgumentParser:
    """Every command's flags; under torchrun --tp defaults to the world size over --pp."""
    parser = _Parser(prog="tpengine", description="Tensor-parallel LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser(
        "generate", help="generate text for prompts",
        description="Generate a completion for each prompt. Prompts come from the command line, "
                    "from --file (one per line), or from standard input (one per line) when neither is given.")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    gen.add_argument("--file", help="read prompts from this file, one per line ('-' for standard input)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1 keeps all (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one's "
                                                               "probability (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed; completion i of --n uses "
                                                            "seed + i (default: none: the engine seed's stream)")
    gen.add_argument("--engine-seed", type=int, default=0, help="seeds what unseeded sampled requests draw: the "
                                                                "same command gives the same text (default 0)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt; they share the prompt's KV (default 1)")
    gen.add_argument("--stop", action="append", default=None, metavar="STR",
                     help="stop when the output contains STR (repeatable); the text ends before it")
    gen.add_argument("--include-stop-str", action="store_true", help="keep the stop string at the end of the text")
    gen.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID",
                     help="stop at this token id (repeatable)")
    gen.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens (default 0)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="report each token's log-probability and the K likeliest alternatives (0-20; --json)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, over generated tokens (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, over generated tokens (default 0)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 0, over prompt and generated tokens, as transformers defines it (default 1)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    output = gen.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt: text, token ids, finish and stop reasons, and "
                             "'outputs' with every completion (and its logprobs)")
    output.add_argument("--stream", action="store_true", help="print text as it is generated, prompt by prompt")
    _add_engine_args(gen, under_torchrun)
    gen.add_argument("--quiet", action="store_true", help="no progress bar or log lines on standard error")

    serve = commands.add_parser(
        "serve", help="serve the OpenAI API over HTTP",
        description="Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions (streamed as "
                    "server-sent events when asked), /v1/models, vLLM's /tokenize, /detokenize and /version, "
                    "/health and Prometheus /metrics. "
                    "SIGTERM or Ctrl-C stops it cleanly.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                           "only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: the --model value, "
                                                   "or tpengine-tiny for the embedded model)")
    serve.add_argument("--api-key", default=os.environ.get("TPENGINE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize (default: "
                            "$TPENGINE_API_KEY, else no key)")
    serve.add_argument("--chat-template", help="Jinja chat template file (or the template itself) for models "
                                               "whose tokenizer has none, or to override it")
    serve.add_argument("--body-timeout", type=float, default=60.0,
                       help="seconds a client has to send a whole request body before it gets a 408 (default 60)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model choose whether to call a tool (tool_choice "auto", the default with tools); '
                            "needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                       help="how the model writes tool calls, for tool_choice auto: hermes (Qwen2.5, Qwen3: "
                            "<tool_call>{...}</tool_call>) or llama3_json (Llama 3.x: a JSON object)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="a reasoning model's <think>...</think>: returned as reasoning_content, and structured "
                            "outputs constrain only the answer after it (qwen3, deepseek_r1)")
    serve.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="replicas of the engine, each its own --tp x --pp ranks on its own CPU cores (an equal "
                            "share) or its own GPUs, behind vLLM's router (vllm-router) on --host/--port (default 1: "
                            "no router; not under torchrun)")
    serve.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="with --data-parallel-size: cache_aware sends a request to the replica that most likely "
                            "caches its prompt's prefix, round_robin to each in turn (default cache_aware)")
    _add_engine_args(serve, under_torchrun)
    serve.add_argument("--quiet", action="store_true", help="log warnings only")

    tiny = commands.add_parser("make-tiny-model", help="write the tiny random-weight Qwen3 checkpoint to a folder",
                               description="Write the embedded tiny random-weight Qwen3 checkpoint and its "
                                           "byte-level tokenizer to PATH.")
    tiny.add_argument("path", help="output folder")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    return parser


def _add_engine_args(parser: argparse.ArgumentParser, under_torchrun: bool) -> None:
    """The flags that build the engine, the same for generate and serve."""
    parser.add_argument("--model", help="local Hugging Face checkpoint folder of a supported family: Qwen3, "
                                        "Qwen3-MoE, Qwen2/2.5, Llama 3.x, Mistral, Gemma 2/3, Phi-3/3.5/4, gpt-oss "
                                        "(default: the embedded tiny random Qwen3, written on first use; its text is "
                                        "meaningless)")
    if not under_torchrun:
        parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ranks per pipeline stage "
                                                              "(default 1)")
    else:
        parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size: ranks per pipeline stage "
                                                                 "(default: torchrun's world size / --pp)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel size: stages, each a slice of the layers on its own --tp ranks; "
                             "tp x pp ranks in all (default 1)")
    parser.add_argument("--pp-layer-partition", type=_layer_counts, default=None,
                        help="layers per pipeline stage, first stage first, e.g. 14,14 (default: as even as can "
                             "be, later stages taking one more)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default auto)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights and KV-cache dtype; auto = float32 on CPU, the checkpoint's on CUDA; a half "
                             "dtype the CPU has no instructions for runs as float32 (bfloat16 keeping its linear "
                             "weights in bfloat16 on AVX2 CPUs)")
    parser.add_argument("--block-size", type=int, default=256, help="KV-cache block size in tokens (default 256)")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None, help="KV-cache blocks (default: by memory)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV-cache element type; auto = the model's dtype; fp8 (= fp8_e4m3): e4m3 with per-layer "
                             "K and V scales (the checkpoint's, else 1.0), twice the tokens of a 16-bit cache in the "
                             "same memory; attention through triton on CUDA (compute capability 8.9+), torch on the "
                             "CPU (default auto)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + output (default 4096)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"most sequences running at once (default {MAX_NUM_SEQS}; "
                             f"{SERVE_CPU_MAX_NUM_SEQS} for serve on the CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens through one forward, decodes and prompt chunks together "
                             "(default 2048 on the CPU, 16384 on CUDA)")
    parser.add_argument("--scheduling-policy", default="mixed", choices=SCHEDULING_POLICIES,
                        help="mixed: every running request gets a token each step, prompt chunks fill the rest; "
                             "prefill_first: nano-vllm's, decodes wait while a prompt prefills (default mixed)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="attention implementation; auto = flash_attn, else triton on CUDA, and cpu (a C++ "
                             "kernel built on first use), else torch, on the CPU (default auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="decode eagerly: no CUDA graphs, no replayed CPU decode steps")
    parser.add_argument("--quantization", default=None, choices=ONLINE_QUANTIZATIONS,
                        help="quantize a float checkpoint's weights as they load: int8 per output channel, int4 in "
                             "groups (--quantization-group-size), symmetric; fp8 (e4m3 per output channel, inputs "
                             "per token) on CUDA sm_89+ only; a quantized checkpoint (GPTQ, AWQ, compressed-tensors, "
                             "fp8) needs no flag (default: none)")
    parser.add_argument("--quantization-group-size", type=int, default=128,
                        help="input features per int4 scale (default 128)")
    parser.add_argument("--no-quantize-lm-head", dest="quantize_lm_head", action="store_false",
                        help="with --quantization: keep the LM head and embedding in floats")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": '
                             '4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, or a draft model with the '
                             'model\'s vocabulary: {"model": "PATH", "num_speculative_tokens": 4} (default: none)')


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _layer_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer counts, got {text!r}") from None


def _engine_kwargs(args) -> dict:
    return dict(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                pp_layer_partition=args.pp_layer_partition, dtype=args.dtype, device=args.device,
                kvcache_block_size=args.block_size, num_kvcache_blocks=args.num_kvcache_blocks,
                kv_cache_dtype=args.kv_cache_dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager, scheduling_policy=args.scheduling_policy,
                quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                quantize_lm_head=args.quantize_lm_head, speculative_config=args.speculative_config)


def _read_lines(stream) -> list[str]:
    return [line.rstrip("\n") for line in stream if line.strip()]


def _read_prompts(args) -> list[str]:
    if args.file and args.file != "-":
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts = _read_lines(f)
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"cannot read prompts from --file {args.file}: {reason}") from None
    elif args.prompts:
        prompts = args.prompts
    elif args.file == "-" or not sys.stdin.isatty():
        prompts = _read_lines(sys.stdin)
    else:
        prompts = []
    if not prompts:
        raise ValueError("no prompts: give them as arguments, with --file, or on standard input")
    return prompts


def _completion_json(completion) -> dict:
    return {"index": completion.index, "text": completion.text, "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "cumulative_logprob": completion.cumulative_logprob,
            "logprobs": None if completion.logprobs is None else
            [[[token_id, logprob] for token_id, logprob in entry.items()] for entry in completion.logprobs]}


def _print_output(prompt: str, out, as_json: bool) -> None:
    if as_json:
        first = out.outputs[0]
        print(json.dumps({"prompt": prompt, "text": first.text, "token_ids": first.token_ids,
                          "prompt_token_ids": out.prompt_token_ids, "finish_reason": first.finish_reason,
                          "stop_reason": first.stop_reason, "num_cached_tokens": out.num_cached_tokens,
                          "outputs": [_completion_json(c) for c in out.outputs]}))
        return
    print(f"Prompt: {prompt!r}")
    for completion in out.outputs:
        label = "Output" if len(out.outputs) == 1 else f"Output {completion.index}"
        print(f"{label}: {completion.text!r}")
    print()


def _stream(llm, prompts: list[str], params) -> None:
    """Print each prompt's completions as they grow, in order: the one being printed live, later ones
    caught up as soon as their turn comes (every step's text is a prefix of the final text)."""
    request_ids = [llm.add_request(prompt, params) for prompt in prompts]
    latest = {}
    turn, printed = 0, -1  # (prompt, completion) being printed, and how much of its text is out (-1: nothing)
    order = [(i, c) for i in range(len(prompts)) for c in range(params.n)]
    while turn < len(order):
        if llm.has_unfinished_requests():
            for out in llm.step():
                latest[out.request_id] = out
        while turn < len(order):
            i, c = order[turn]
            out = latest.get(request_ids[i])
            if out is None:
                break
            if printed < 0:
                if c == 0:
                    print(f"Prompt: {prompts[i]!r}")
                print("Output:" if params.n == 1 else f"Output {c}:", end=" ", flush=True)
                printed = 0
            completion = out.outputs[c]
            text = completion.text or ""
            print(text[printed:], end="", flush=True)
            printed = len(text)
            if completion.finish_reason is None:
                break
            print("\n" if c == params.n - 1 else "", flush=True)
            turn, printed = turn + 1, -1


def _default_model() -> str:
    from tpengine.tiny_model import default_model_path
    try:
        return default_model_path()
    except OSError as e:
        raise ValueError(f"cannot write the embedded tiny model into the cache folder ({e}); "
                         f"set TPENGINE_CACHE_DIR to a writable folder, or pass --model") from None


def _generate(args) -> int:
    from tpengine import LLM, SamplingParams

    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="tpengine: %(message)s")
    prompts = _read_prompts(args)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        stop_token_ids=args.stop_token_id, include_stop_str_in_output=args.include_stop_str,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    model = args.model or _default_model()
    with LLM(model, **_engine_kwargs(args), seed=args.engine_seed) as llm:
        if args.stream:
            _stream(llm, prompts, params)
            return 0
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for prompt, out in zip(prompts, outputs):
        _print_output(prompt, out, args.json)
    return 0


def _serve(args) -> int:
    from tpengine.entrypoints.server import run_server

    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be a number of seconds > 0, got {args.body_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    data_parallel_size = getattr(args, "data_parallel_size", 1)
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
    if data_parallel_size > 1:
        return _serve_data_parallel(args)
    engine_kwargs = _engine_kwargs(args)
    engine_kwargs["reasoning_parser"] = args.reasoning_parser
    if args.max_num_seqs is None and _on_cpu(args.device):
        engine_kwargs["max_num_seqs"] = SERVE_CPU_MAX_NUM_SEQS

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="tpengine: %(message)s")
    return run_server(model=args.model or _default_model(),
                      model_name=args.served_model_name or args.model or "tpengine-tiny",
                      host=args.host, port=args.port, api_key=args.api_key, chat_template=args.chat_template,
                      access_log=not args.disable_access_log, log_level="warning" if args.quiet else "info",
                      engine_kwargs=engine_kwargs, body_timeout_s=args.body_timeout, tool_parser=args.tool_call_parser,
                      enable_auto_tool_choice=args.enable_auto_tool_choice)


def _serve_data_parallel(args) -> int:
    from tpengine.entrypoints.data_parallel import DataParallelServer

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="tpengine: %(message)s")
    # resolved once here, so the replicas do not all write the embedded model at once, and serve one name
    args.served_model_name = args.served_model_name or args.model or "tpengine-tiny"
    args.model = args.model or _default_model()
    server = DataParallelServer(replica_argv=_replica_argv(args), num_replicas=args.data_parallel_size,
                                ranks_per_replica=args.tp * args.pp, on_cpu=_on_cpu(args.device), host=args.host,
                                port=args.port, router_policy=args.router_policy, quiet=args.quiet,
                                api_key=args.api_key)
    return server.run()


# what the supervisor decides for its replicas rather than passing on
_NOT_FOR_REPLICAS = {"command", "host", "port", "api_key", "data_parallel_size", "router_policy", "help"}


def _replica_argv(args: argparse.Namespace) -> list[str]:
    """The `tpengine serve` flags that give a replica the engine and API settings args holds (the parsed
    values, so an abbreviated or repeated flag reads as argparse read it)."""
    serve_parser = next(action for action in build_parser()._actions
                        if isinstance(action, argparse._SubParsersAction)).choices["serve"]
    argv = []
    for action in serve_parser._actions:
        if action.dest in _NOT_FOR_REPLICAS or not action.option_strings:
            continue
        value, flag = getattr(args, action.dest), action.option_strings[-1]
        if value == action.default:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):  # --pp-layer-partition's layer counts
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch
        return not torch.cuda.is_available()
    return device == "cpu"


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def main_under_torchrun(command: str, argv: list[str] | None = None) -> int:
    """`tpengine COMMAND ...` as one rank of a torchrun job of tp x pp ranks (--tp defaults to torchrun's world
    size / --pp): rank 0 runs the command, the other ranks execute the steps it sends."""
    import signal

    import torch.distributed as dist

    from tpengine.distributed.parallel_state import init_torchrun_process_group

    args = build_parser(under_torchrun=True).parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    if getattr(args, "data_parallel_size", 1) != 1:  # each torchrun process is one rank of one engine
        print("tpengine: error: --data-parallel-size starts its own replicas: run `tpengine serve "
              "--data-parallel-size N` without torchrun", file=sys.stderr)
        return 2
    init_torchrun_process_group(args.device)
    try:
        if dist.get_rank() != 0:
            if command == "serve":
                # torchrun signals every rank; the server's rank 0 finishes or aborts what runs and sends the
                # shutdown the others wait for
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            from tpengine.runner.worker import torchrun_worker_main
            torchrun_worker_main()
            return 0
        world_size = dist.get_world_size()
        if args.tp is None:
            args.tp = world_size // args.pp if args.pp >= 1 and world_size % args.pp == 0 else world_size
        if args.tp * args.pp != world_size:
            print(f"tpengine: error: --tp {args.tp} x --pp {args.pp} must be torchrun's world size, {world_size} "
                  "ranks", file=sys.stderr)
            return 2
        return run(args)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; a user mistake prints one `tpengine: error: ...` line and returns 2."""
    try:
        if args.command == "make-tiny-model":
            from tpengine.tiny_model import write_tiny_model
            try:
                write_tiny_model(args.path, seed=args.seed)
            except OSError as e:
                raise ValueError(f"cannot write the model to {args.path}: {e.strerror or e}") from None
            print(args.path)
            return 0
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except ValueError as e:
        print(f"tpengine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: every rank is already stopped; exit as command-line tools do
        return 130


if __name__ == "__main__":
    sys.exit(main())
