"""LoRA adapters in `tpengine serve`, as vLLM serves them: --lora-modules, a request's model naming an adapter,
/v1/models listing them, and the runtime load/unload routes; one server on a tiny base with two adapters."""
import json

import openai
import pytest

from tests.entrypoints.conftest import running_server
from tests.entrypoints.test_errors import assert_openai_error
from tests.lora.adapters import make_peft_adapter, write_tiny_base
from tpengine.cli import _replica_argv, build_parser, main
from tpengine.entrypoints.lora_modules import LoRAModulePath, parse_lora_module

PROMPTS = ["Hello, my name is", "The capital of France"]
GREEDY = dict(max_tokens=8, temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
ADAPTER_SEEDS = {"sql": 1, "chat": 2, "late": 3}  # late: loaded at run time


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> str:
    return write_tiny_base(str(tmp_path_factory.mktemp("lora_base")))


@pytest.fixture(scope="module")
def adapters(lora_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(lora_base, str(root / name), r=8, seed=seed)
            for name, seed in ADAPTER_SEEDS.items()}


@pytest.fixture(scope="module")
def lora_server(lora_base, adapters):
    chat_module = json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": "tiny"})
    yield from running_server(lora_base, "--dtype", "float32", "--enable-lora", "--max-loras", "2",
                              "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}", chat_module,
                              "--allow-runtime-lora-updating", "--no-warm-up")


@pytest.fixture(scope="module")
def lora_client(lora_server):
    with openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def offline_tokens(lora_base, adapters) -> dict[str | None, list[list[int]]]:
    """The offline engine's greedy tokens of PROMPTS on the base (None) and on each adapter."""
    from tpengine import LLM, SamplingParams
    from tpengine.lora.request import LoRARequest

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    with LLM(lora_base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", kvcache_block_size=16,
             num_kvcache_blocks=64) as llm:
        for lora_int_id, name in enumerate([None, *ADAPTER_SEEDS], start=0):
            lora_request = None if name is None else LoRARequest(name, lora_int_id, adapters[name])
            outputs = llm.generate(PROMPTS, params, lora_request=lora_request, use_tqdm=False)
            tokens[name] = [out.outputs[0].token_ids for out in outputs]
    return tokens


def served_tokens(client, model: str) -> list[list[int]]:
    completion = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    assert completion.model == model
    return [choice.token_ids for choice in sorted(completion.choices, key=lambda c: c.index)]


def test_models_lists_the_served_model_then_each_adapter_with_its_parent(lora_client, adapters):
    cards = {card.id: card.model_dump() for card in lora_client.models.list().data}
    assert list(cards)[:3] == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    for name in ("sql", "chat"):
        assert cards[name]["object"] == "model" and cards[name]["owned_by"] == "tpengine"
        assert cards[name]["root"] == adapters[name] and cards[name]["parent"] == "tiny"
    assert lora_client.models.retrieve("sql").model_dump() == cards["sql"]


def test_each_adapter_generates_what_the_offline_engine_does_and_not_what_the_base_does(lora_client,
                                                                                      offline_tokens):
    assert served_tokens(lora_client, "tiny") == offline_tokens[None]
    for name in ("sql", "chat"):
        tokens = served_tokens(lora_client, name)
        assert tokens == offline_tokens[name], name
        assert tokens != offline_tokens[None], name


def test_chat_responses_and_messages_run_on_the_adapter_their_model_names(lora_server, lora_client):
    messages = [{"role": "user", "content": "hi"}]
    chat = lora_client.chat.completions.create(model="sql", messages=messages, **GREEDY)
    assert chat.model == "sql" and chat.choices[0].finish_reason == "length"
    reply = lora_client.responses.create(model="chat", input="hi", max_output_tokens=4, temperature=0.0)
    assert reply.model == "chat" and reply.status in ("completed", "incomplete")
    status, message = lora_server.request("POST", "/v1/messages", {"model": "sql", "max_tokens": 4,
                                                                   "messages": messages})
    assert status == 200 and message["model"] == "sql", message


def test_an_unknown_model_is_a_404_naming_it(lora_client):
    with pytest.raises(openai.NotFoundError) as error:
        lora_client.completions.create(model="nope", prompt="a", max_tokens=1)
    assert "'nope'" in error.value.message and "2 LoRA adapters" in error.value.message
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        lora_client.models.retrieve("nope")


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(lora_server, lora_client, adapters,
                                                                    offline_tokens):
    status, text = lora_server.request("POST", "/v1/load_lora_adapter",
                                       {"lora_name": "late", "lora_path": adapters["late"]})
    assert (status, text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert "late" in [card.id for card in lora_client.models.list().data]
    assert served_tokens(lora_client, "late") == offline_tokens["late"]
    # a request already running on it when it is unloaded finishes
    stream = lora_client.completions.create(model="late", prompt="a", max_tokens=128, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    first = next(iter(stream))
    status, text = lora_server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (status, text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        lora_client.completions.create(model="late", prompt="a", max_tokens=1)
    assert "late" not in [card.id for card in lora_client.models.list().data]


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/elsewhere"}, 400, "lora_name",
     "'sql' has already been loaded"),
    ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/elsewhere"}, 400, "lora_name",
     "the served model's name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "lora_path",
     "no such folder"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p", "load_inplace": True}, 400, "load_inplace",
     "not supported"),
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "'nope' cannot be found"),
    ("/v1/unload_lora_adapter", {"lora_name": "sql", "lora_int_id": 99}, 404, "lora_name", "lora_int_id 99"),
])
def test_adapter_route_mistakes_are_refused_naming_the_field(lora_server, path, body, status, param, message):
    answer_status, answer = lora_server.request("POST", path, body)
    assert answer_status == status, answer
    assert_openai_error(answer_status, answer, message)
    assert answer["error"]["param"] == param, answer


def test_an_adapter_too_large_for_max_lora_rank_is_refused_at_load(lora_server, lora_base, tmp_path):
    path = make_peft_adapter(lora_base, str(tmp_path / "big"), r=16, targets=("q_proj",))
    status, answer = lora_server.request("POST", "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": path})
    assert status == 400 and "max_lora_rank=8" in answer["error"]["message"], answer


def test_an_adapter_for_another_model_is_refused_at_load(lora_server, tmp_path):
    other_base = write_tiny_base(str(tmp_path / "other_base"), intermediate_size=96)
    path = make_peft_adapter(other_base, str(tmp_path / "other"), targets=("down_proj",))
    status, answer = lora_server.request("POST", "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": path})
    assert status == 400 and "for another model" in answer["error"]["message"], answer
    assert answer["error"]["param"] == "lora_path"


def test_without_the_flag_the_adapter_routes_are_404(server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert server.request("POST", path, {"lora_name": "a", "lora_path": "/p"})[0] == 404


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--enable-lora", "--allow-runtime-lora-updating", "--data-parallel-size", "2"], "one replica only"),
    (["--enable-lora", "--lora-modules", "a=/no/such/adapter"], "--lora-modules a: "),
    (["--enable-lora", "--served-model-name", "a", "--lora-modules", "a=/p"], "the served model's name"),
    (["--enable-lora", "--lora-modules", "a=/p", "b=/q", "a=/r"], "names 'a' 2 times"),
])
def test_serve_refuses_lora_flags_it_cannot_honour_before_starting(capsys, argv, message):
    assert main(["serve", "--model", "unused", *argv]) == 2
    assert message in capsys.readouterr().err


def test_lora_modules_takes_vllms_two_forms_and_refuses_others(capsys):
    assert parse_lora_module("a=/p=q") == LoRAModulePath("a", "/p=q")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("a", "/p", "m")
    for bad in ("a", "=/p", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 8}'):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--lora-modules", bad])
        assert "--lora-modules" in capsys.readouterr().err


def test_a_data_parallel_replica_gets_the_same_lora_modules():
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/p",
                                      '{"name": "b", "path": "/q", "base_model_name": "m"}'])
    replica = build_parser().parse_args(["serve", *_replica_argv(args)])
    assert replica.lora_modules == [LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q", "m")]
    assert replica.enable_lora
