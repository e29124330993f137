"""`tpengine serve --data-parallel-size 2`: two tp=1 replicas behind vLLM's real router (vllm-router), shared by
the tests in order; the last ones kill a replica, then stop the whole deployment."""
import os
import signal
import socket
import threading
import time

import openai
import pytest

from tests.entrypoints.conftest import BLOCK_SIZE, Server, child_pids, segments_of
from tests.entrypoints.test_server_lifecycle import assert_nothing_left
from tpengine.cli import _replica_argv, build_parser
from tpengine.entrypoints.data_parallel import DataParallelServer, replica_device_env, router_available

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
ROUTER_NOTICE_TIMEOUT_S = 20.0
# long enough that the router's prefix match and the replica's cached blocks are unmistakable
SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence, citing the manual section. " * 3

requires_router = pytest.mark.skipif(not router_available(), reason="vllm-router has wheels for Linux only: "
                                                                    "not installable on this platform")


class Replica:
    """One replica, reached directly at the URL the router lists for it."""

    def __init__(self, url: str):
        self.url = url
        self.server = Server.running_at(int(url.rsplit(":", 1)[1]))

    def metric(self, name: str) -> float:
        return self.server.metric(name, model_name=Server.model_name)

    @property
    def prefix_cache_hits(self) -> float:
        return self.metric("tpengine:prefix_cache_hits_total")

    @property
    def prompt_tokens(self) -> float:
        return self.metric("tpengine:prompt_tokens_total")

    def pid(self, supervisor_pid: int) -> int:
        port_flag = f"--port\0{self.server.port}\0".encode()
        return next(pid for pid in child_pids(supervisor_pid) if port_flag in open(f"/proc/{pid}/cmdline", "rb").read())


@pytest.fixture(scope="module")
def deployment(tied_model):
    if not router_available():
        pytest.skip("vllm-router has wheels for Linux only: not installable on this platform")
    server = Server("--model", tied_model, "--data-parallel-size", "2", "--block-size", str(BLOCK_SIZE),
                    "--max-model-len", "2048", "--num-kvcache-blocks", "256")
    try:
        yield server
    finally:
        server.kill_leftovers()


@pytest.fixture(scope="module")
def replicas(deployment) -> list[Replica]:
    status, body = deployment.request("GET", "/get_loads")  # the router's own list of its workers
    assert status == 200
    return [Replica(worker["worker"]) for worker in body["workers"]]


@pytest.fixture
def client(deployment):
    with openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


def test_replicas_get_the_engine_flags_but_not_the_routers_address_or_the_key():
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--router-policy", "round_robin",
                                      "--host", "0.0.0.0", "--port", "9000", "--api-key", "secret", "--model", "m",
                                      "--block-size", "16", "--no-quantize-lm-head", "--quiet", "--pp", "2",
                                      "--pp-layer-partition", "3,1", "--speculative-config", '{"method": "ngram"}'])
    argv = _replica_argv(args)
    assert argv == ["--model", "m", "--pp", "2", "--pp-layer-partition", "3,1", "--block-size", "16",
                    "--no-quantize-lm-head", "--speculative-config", '{"method": "ngram"}', "--quiet"]
    assert vars(build_parser().parse_args(["serve", *argv])) == dict(vars(args), data_parallel_size=1, host="127.0.0.1",
                                                                      port=8000, router_policy="cache_aware",
                                                                      api_key=os.environ.get("TPENGINE_API_KEY"))


def test_each_replica_gets_its_own_cores_or_gpus_and_too_many_are_refused_naming_the_limit():
    assert replica_device_env(1, 1, True, 2, [0, 1, 2, 3], []) == ({"OMP_NUM_THREADS": "2"}, [2, 3])
    assert replica_device_env(1, 2, False, 2, [], ["0", "1", "2", "3"]) == ({"CUDA_VISIBLE_DEVICES": "2,3"}, None)
    with pytest.raises(ValueError, match="need 6 GPUs, but 4 are visible"):
        replica_device_env(0, 2, False, 3, [], ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="more replicas than the 2 CPU cores"):
        replica_device_env(0, 1, True, 3, [0, 1], [])


@requires_router
def test_bad_data_parallel_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="at least 2"):
        DataParallelServer(replica_argv=[], num_replicas=1, ranks_per_replica=1, on_cpu=True, host="127.0.0.1",
                           port=0, router_policy="cache_aware", quiet=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            DataParallelServer(replica_argv=[], num_replicas=2, ranks_per_replica=1, on_cpu=True, host="127.0.0.1",
                               port=taken.getsockname()[1], router_policy="cache_aware", quiet=True)
    with pytest.raises(ValueError, match="more replicas than the"):
        DataParallelServer(replica_argv=[], num_replicas=len(os.sched_getaffinity(0)) + 1, ranks_per_replica=1,
                           on_cpu=True, host="127.0.0.1", port=0, router_policy="cache_aware", quiet=True)


def test_requests_sharing_a_long_prefix_go_to_the_replica_caching_it_even_while_it_is_busier(client, replicas):
    hits_before = [replica.prefix_cache_hits for replica in replicas]
    prompt_tokens_before = [replica.prompt_tokens for replica in replicas]
    client.completions.create(model="tiny", prompt=SHARED_PREFIX + "Where is the fuse?", max_tokens=2, **GREEDY)
    holder = max(range(2), key=lambda i: replicas[i].prompt_tokens - prompt_tokens_before[i])
    # a long stream keeps the holder busier than the other replica: a least-loaded choice would pick the other
    stream = client.completions.create(model="tiny", prompt=SHARED_PREFIX + "Read it all out.", max_tokens=1500,
                                       stream=True, **GREEDY)
    try:
        next(iter(stream))
        for question in ("How do I reset it?", "What voltage?"):
            client.completions.create(model="tiny", prompt=SHARED_PREFIX + question, max_tokens=2, **GREEDY)
    finally:
        stream.close()
    other = replicas[1 - holder]
    assert other.prompt_tokens == prompt_tokens_before[1 - holder], "a request with the shared prefix went elsewhere"
    assert other.prefix_cache_hits == hits_before[1 - holder]
    # the stream's prompt and both questions found the prefix's full blocks cached
    full_blocks = len(SHARED_PREFIX) // BLOCK_SIZE * BLOCK_SIZE
    assert replicas[holder].prefix_cache_hits - hits_before[holder] >= 2 * full_blocks


def test_distinct_prompts_sent_at_once_spread_over_both_replicas(client, replicas):
    served_before = [replica.prompt_tokens for replica in replicas]
    # as long as the shared prefix's requests, so the router's "least cached text" choice alternates soon
    prompts = [f"{i} distinct topic number {i * 7919 % 1000}: write about it. " * 4 for i in range(8)]
    errors = []

    def send(prompt):
        try:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    served = [replica.prompt_tokens - before for replica, before in zip(replicas, served_before)]
    assert all(tokens > 0 for tokens in served), f"prompt tokens per replica: {served}"


def test_greedy_output_through_the_router_equals_a_replica_directly(client, replicas):
    kwargs = dict(model="tiny", prompt=["The router forwards", "each request whole"], max_tokens=12, **GREEDY)
    routed = client.completions.create(**kwargs)
    for replica in replicas:
        with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0) as direct:
            assert [c.text for c in direct.completions.create(**kwargs).choices] == [c.text for c in routed.choices]
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, **GREEDY)
    routed_chat = client.chat.completions.create(**chat).choices[0].message.content
    with openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key="unused", max_retries=0) as direct:
        assert direct.chat.completions.create(**chat).choices[0].message.content == routed_chat


def test_streams_pass_through_the_router(client):
    kwargs = dict(model="tiny", prompt="Stream me", max_tokens=10, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    assert "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)) == whole


def test_a_killed_replica_gets_no_more_requests_and_the_other_answers(deployment, replicas, client):
    # the replica that holds SHARED_PREFIX, so the cache-aware router would prefer it
    prompt = SHARED_PREFIX + "Which replica answers now?"
    prompt_tokens_before = [replica.prompt_tokens for replica in replicas]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    holder = max(range(2), key=lambda i: replicas[i].prompt_tokens - prompt_tokens_before[i])
    survivor = replicas[1 - holder]
    victim_pid = replicas[holder].pid(deployment.pid)
    os.kill(victim_pid, signal.SIGKILL)
    deadline = time.monotonic() + ROUTER_NOTICE_TIMEOUT_S
    while deployment.request("GET", "/health")[0] != 503:  # the router's health check found it dead
        assert time.monotonic() < deadline, "the router did not notice the killed replica"
        time.sleep(0.2)
    before = survivor.prompt_tokens
    for i in range(3):
        response = client.completions.create(model="tiny", prompt=f"{prompt} ({i})", max_tokens=4, **GREEDY)
        assert response.usage.completion_tokens == 4
    assert survivor.prompt_tokens > before


def test_sigterm_stops_the_router_and_every_replica_leaving_nothing(deployment):
    children = child_pids(deployment.pid)
    descendants = children | {pid for child in children for pid in child_pids(child)}
    assert len(children) >= 2  # the router and the replica still alive
    assert deployment.stop() == 0
    assert_nothing_left(deployment, descendants)
    for pid in children:
        assert not segments_of(pid)
