"""`tpengine generate ...`, `tpengine serve ...`, `tpengine bench {latency,throughput,serve} ...` and
`tpengine make-tiny-model PATH`; launch/*.py run the first two under torchrun (main_under_torchrun)."""
import argparse
import html
import json
import logging
import os
import re
import sys

import msgspec

from tpengine.bench import latency as bench_latency
from tpengine.bench import serve as bench_serve
from tpengine.bench import throughput as bench_throughput
from tpengine.config import SETTING_GROUPS, EngineField, engine_fields
from tpengine.entrypoints.data_parallel import ROUTER_POLICIES
from tpengine.entrypoints.tool_calls import TOOL_CALL_PARSERS

# `serve` on the CPU decodes at most this many requests at once (vLLM's CPU serving default): every
# running request shares each step, so under a burst fewer at once means a lower time per output token
# for each, for a later first token for the ones that wait (docs/benchmarks.md, "Per-token latency under load").
SERVE_CPU_MAX_NUM_SEQS = 128
DEFAULT_MODEL_HELP = "the embedded tiny random Qwen3, written on first use; its text is meaningless"
# `tpengine bench NAME`: each module's add_arguments and run (tpengine/bench/), as `vllm bench NAME`
BENCHMARKS = {"latency": bench_latency, "throughput": bench_throughput, "serve": bench_serve}


# Flags whose value may start with '-' (layer counts such as -1,5, which the engine then refuses by name).
_DASHED_VALUE_FLAGS = tuple(field.flag for field in engine_fields().values() if field.value_type == list[int])


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
    _add_generate(commands, under_torchrun)
    _add_serve(commands, under_torchrun)
    _add_bench(commands)
    tiny = commands.add_parser("make-tiny-model", help="write the tiny random-weight Qwen3 checkpoint to a folder",
                               description="Write the embedded tiny random-weight Qwen3 checkpoint and its "
                                           "byte-level tokenizer to PATH.")
    tiny.add_argument("path", help="output folder")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    return parser


def _add_generate(commands, under_torchrun: bool) -> None:
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
    # not `seed`: that is the engine's (--engine-seed)
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None, metavar="SEED",
                     help="per-request sampling seed; completion i of --n uses seed + i (default: none: the engine "
                          "seed's stream)")
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
    _add_engine_flags(gen, _flag_defaults("generate", under_torchrun))
    gen.add_argument("--quiet", action="store_true", help="no progress bar or log lines on standard error")


def _add_serve(commands, under_torchrun: bool) -> None:
    serve = commands.add_parser(
        "serve", help="serve the OpenAI API over HTTP",
        description="Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions (streamed as "
                    "server-sent events when asked), /v1/embeddings (any model; --runner pooling for an "
                    "embedding-only one), /v1/models, vLLM's /tokenize, /detokenize and /version, "
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
    serve.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    serve.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module, default=[],
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) to serve beside the model, each NAME=PATH or vLLM's JSON "
                            '{"name": ..., "path": ..., "base_model_name": ...}: a request whose model is NAME runs '
                            "on it; needs --enable-lora (default: none)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="add vLLM's POST /v1/load_lora_adapter ({\"lora_name\", \"lora_path\"}) and "
                            "/v1/unload_lora_adapter ({\"lora_name\"}) routes; needs --enable-lora")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="replicas of the engine, each its own --tp x --pp ranks on its own CPU cores (an equal "
                            "share) or its own GPUs, behind vLLM's router (vllm-router) on --host/--port (default 1: "
                            "no router; not under torchrun)")
    serve.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="with --data-parallel-size: cache_aware sends a request to the replica that most likely "
                            "caches its prompt's prefix, round_robin to each in turn (default cache_aware)")
    _add_engine_flags(serve, _flag_defaults("serve", under_torchrun))
    serve.add_argument("--quiet", action="store_true", help="log warnings only")


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark the engine: latency, throughput, or a server under load",
                                description="Benchmark the engine, as `vllm bench` does: measured on the model and "
                                            "engine flags given (default: the embedded tiny model).")
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        text = " ".join(module.__doc__.split()).split(": ", 1)[1]  # after "`tpengine bench NAME`: "
        summary = module.__doc__.split("\n\n")[0].split(": ", 1)[1].rstrip(".")
        sub = kinds.add_parser(name, help=summary, description=text[0].upper() + text[1:])
        module.add_arguments(sub)
        # bench serve starts `tpengine serve` with the flags given: the defaults are serve's
        _add_engine_flags(sub, _flag_defaults("serve" if name == "serve" else "generate", False))
        sub.add_argument("--quiet", action="store_true", help="log warnings only")


def _flag_defaults(command: str, under_torchrun: bool) -> dict[str, tuple[object, str]]:
    """The engine flags whose default on this command is not the EngineConfig field's: (default, what it means)."""
    defaults = {"model": (None, DEFAULT_MODEL_HELP)}
    if under_torchrun:
        defaults["tensor_parallel_size"] = (None, "torchrun's world size / --pp")
    if command == "serve":
        defaults["max_num_seqs"] = (None, f"{engine_fields()['max_num_seqs'].default}; {SERVE_CPU_MAX_NUM_SEQS} on "
                                          "the CPU")
        # a load balancer routes on /health: the first requests must not land in first-use stalls
        defaults["warm_up"] = (True, None)
    return defaults


def _add_engine_flags(parser: argparse.ArgumentParser, defaults: dict[str, tuple[object, str]]) -> None:
    """Every EngineConfig field as a flag, its value under the field's name, in a group per SETTING_GROUPS key;
    defaults: _flag_defaults."""
    groups = {name: parser.add_argument_group(_group_title(name), description)
              for name, description in SETTING_GROUPS.items()}
    for field in engine_fields().values():
        default, default_help = defaults.get(field.name, (field.default, field.setting.default_help))
        if field.value_type is bool:
            default_text = " on" if default else " off"
        elif default_help is not None:
            default_text = f": {default_help}"
        else:
            default_text = f" {default:g}" if isinstance(default, float) else f" {default}"
        groups[field.setting.group].add_argument(
            field.flag, dest=field.name, default=default, **_flag_parsing(field),
            help=f"{field.setting.help} (default{default_text})".replace("%", "%%"))


def _group_title(group: str) -> str:
    return f"engine {group} settings"


def _flag_parsing(field: EngineField) -> dict:
    """argparse's action, or type and choices or metavar, for a field's type and Setting."""
    if field.value_type is bool:  # --enforce-eager and --no-enforce-eager, as vLLM spells its switches
        return {"action": argparse.BooleanOptionalAction}
    if field.value_type == list[int]:
        parse = _layer_counts
    elif field.value_type is dict or isinstance(field.value_type, type) and issubclass(field.value_type,
                                                                                      msgspec.Struct):
        parse = _json_object  # speculative_config: vLLM's JSON object
    else:
        parse = field.value_type
    if field.setting.choices is not None:
        return {"type": parse, "choices": field.setting.choices}
    return {"type": parse, "metavar": field.flag.removeprefix("--").replace("-", "_").upper()}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _lora_module(text: str):
    from tpengine.entrypoints.lora_modules import parse_lora_module  # the server's modules load only when used
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layer_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer counts, got {text!r}") from None


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments the engine flags in args give, but model (the caller's to default)."""
    kwargs = {name: getattr(args, name) for name in engine_fields() if name != "model"}
    if kwargs["max_num_seqs"] is None:  # serve's default: fewer on the CPU
        kwargs["max_num_seqs"] = SERVE_CPU_MAX_NUM_SEQS if _on_cpu(args.device) else \
            engine_fields()["max_num_seqs"].default
    return kwargs


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
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        stop_token_ids=args.stop_token_id, include_stop_str_in_output=args.include_stop_str,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    model = args.model or _default_model()
    with LLM(model, **_engine_kwargs(args)) as llm:
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
    _check_lora_flags(args, data_parallel_size)
    if data_parallel_size > 1:
        return _serve_data_parallel(args)
    engine_kwargs = _engine_kwargs(args)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="tpengine: %(message)s")
    return run_server(model=args.model or _default_model(),
                      model_name=args.served_model_name or args.model or "tpengine-tiny",
                      host=args.host, port=args.port, api_key=args.api_key, chat_template=args.chat_template,
                      access_log=not args.disable_access_log, log_level="warning" if args.quiet else "info",
                      engine_kwargs=engine_kwargs, body_timeout_s=args.body_timeout, tool_parser=args.tool_call_parser,
                      enable_auto_tool_choice=args.enable_auto_tool_choice, lora_modules=args.lora_modules,
                      allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def _check_lora_flags(args, data_parallel_size: int) -> None:
    for flag, value in (("--lora-modules", args.lora_modules),
                        ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating)):
        if value and not args.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora (and --max-loras, --max-lora-rank to fit the adapters)")
    if args.allow_runtime_lora_updating and data_parallel_size > 1:  # the router sends a load to one replica
        raise ValueError("--allow-runtime-lora-updating would load an adapter on one replica only: not with "
                         "--data-parallel-size; name the adapters with --lora-modules")


def _bench(args) -> int:
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="tpengine: %(message)s")
    argv = getattr(args, "argv", None)
    if args.benchmark == "serve":  # the server it starts resolves its own model
        return bench_serve.run(args, _engine_argv(args), argv)
    return BENCHMARKS[args.benchmark].run(args, args.model or _default_model(), _engine_kwargs(args), argv)


def _serve_data_parallel(args) -> int:
    from tpengine.entrypoints.data_parallel import DataParallelServer

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="tpengine: %(message)s")
    # resolved once here, so the replicas do not all write the embedded model at once, and serve one name
    args.served_model_name = args.served_model_name or args.model or "tpengine-tiny"
    args.model = args.model or _default_model()
    server = DataParallelServer(replica_argv=_replica_argv(args), num_replicas=args.data_parallel_size,
                                ranks_per_replica=args.tensor_parallel_size * args.pipeline_parallel_size,
                                on_cpu=_on_cpu(args.device), host=args.host, port=args.port,
                                router_policy=args.router_policy, quiet=args.quiet, api_key=args.api_key)
    return server.run()


# what the supervisor decides for its replicas rather than passing on
_NOT_FOR_REPLICAS = {"command", "host", "port", "api_key", "data_parallel_size", "router_policy", "help"}


def _replica_argv(args: argparse.Namespace) -> list[str]:
    """The `tpengine serve` flags that give a replica the engine and API settings args holds (the parsed
    values, so an abbreviated or repeated flag reads as argparse read it)."""
    serve_parser = _command_parsers(build_parser())["serve"]
    return _argv_of(args, [action for action in serve_parser._actions
                           if action.dest not in _NOT_FOR_REPLICAS and action.option_strings])


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `tpengine serve` that give a server the engine settings args holds (those away from
    serve's defaults)."""
    serve_parser = _command_parsers(build_parser())["serve"]
    return _argv_of(args, [action for action in serve_parser._actions if action.dest in engine_fields()])


def _argv_of(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The flags that give these actions the values args holds, those away from their defaults only."""
    argv = []
    for action in actions:
        value, flag = getattr(args, action.dest), action.option_strings[-1]
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):  # --lora-modules' too (an _ExtendAction)
            for item in value:
                argv += [flag, msgspec.json.encode(item).decode() if isinstance(item, msgspec.Struct) else str(item)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):  # --pp-layer-partition's layer counts
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices


def flag_reference() -> str:
    """docs/cli.md: every flag of generate, serve and the benchmarks as --help words it, the engine's once, group by
    group."""
    parsers = _command_parsers(build_parser())
    parsers.update({f"bench {name}": parser for name, parser in _command_parsers(parsers["bench"]).items()})
    engine_help = {action.dest: action.help for action in parsers["generate"]._actions}
    lines = ["# Command-line flags", "",
             "Generated from the settings' declarations (EngineConfig in tpengine/config.py) and tpengine/cli.py by "
             "`python tools/write_cli_reference.py`; `tpengine COMMAND --help` says the same.", ""]
    for command in ("generate", "serve", *(f"bench {name}" for name in BENCHMARKS)):
        parser = parsers[command]
        own = [action for action in parser._actions if action.dest not in engine_fields() and action.dest != "help"]
        lines += [f"## tpengine {command}", "", parser.description, "", "| flag | |", "|---|---|",
                  *(f"| `{_invocation(action)}` | {_markdown(action.help)} |" for action in own), ""]
        differing = [action for action in parser._actions
                     if action.dest in engine_fields() and action.help != engine_help[action.dest]]
        lines += ["And every [engine flag](#engine-flags)" + (", but:" if differing else "."), ""]
        lines += [f"- `{action.option_strings[0]}`: {_markdown(action.help)}" for action in differing]
        lines += [""] if differing else []
    lines += ["## Engine flags", "",
              "`generate`, `serve` and every `bench` command take them; each sets the EngineConfig field, the "
              "keyword argument of `LLM(model, ...)`, named beside it.", ""]
    groups = {_group_title(name): name for name in SETTING_GROUPS}
    for group in parsers["generate"]._action_groups:
        if group.title in groups:
            lines += [f"### {groups[group.title]}: {group.description}", "",
                      "| flag | `LLM()` argument | |", "|---|---|---|",
                      *(f"| `{_invocation(action)}` | `{action.dest}` | {_markdown(action.help)} |"
                        for action in group._group_actions), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _invocation(action: argparse.Action) -> str:
    """How a flag is written: '--tp TP', '--device {auto,cpu,cuda}', '--enforce-eager, --no-enforce-eager'."""
    value = "{" + ",".join(action.choices) + "}" if action.choices else action.metavar or action.dest.upper()
    if not action.option_strings:
        return f"[{value} ...]" if action.nargs == "*" else value
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    return f"{action.option_strings[0]} {value}"


def _markdown(text: str) -> str:
    """text as a table cell shows it: <think> is not a tag, | not a column."""
    return html.escape(text.replace("%%", "%"), quote=False).replace("|", "\\|")


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch
        return not torch.cuda.is_available()
    return device == "cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # a benchmark's record names its command
    return run(args)


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
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        if tp is None:
            tp = args.tensor_parallel_size = world_size // pp if pp >= 1 and world_size % pp == 0 else world_size
        if tp * pp != world_size:
            print(f"tpengine: error: --tp {tp} x --pp {pp} must be torchrun's world size, {world_size} ranks",
                  file=sys.stderr)
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
        if args.command == "bench":
            return _bench(args)
        return _generate(args)
    except ValueError as e:
        print(f"tpengine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: every rank is already stopped; exit as command-line tools do
        return 130


if __name__ == "__main__":
    sys.exit(main())
