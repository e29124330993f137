"""The server process: tp=2 parity, a dead worker turns /health to 503, SIGTERM leaves nothing behind,
an idle server sleeps, and a long step never blocks /health."""
import os
import signal
import sys
import threading
import time

import openai
import pytest

from tests.entrypoints.conftest import BLOCK_SIZE, Server, child_pids, segments_of, worker_pids
from tests.entrypoints.test_completions import assert_greedy_equals_offline

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP2_FLAGS = ("--tp", "2", "--block-size", str(BLOCK_SIZE), "--num-kvcache-blocks", "128", "--max-model-len", "512")


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def assert_nothing_left(server: Server, children: set[int]) -> None:
    """No child of the stopped server (workers, resource tracker) runs, and no segment of it is left."""
    deadline = time.monotonic() + 10  # a child may take a moment to see its parent gone
    while alive := {pid for pid in children if process_exists(pid)}:
        assert time.monotonic() < deadline, f"processes still running after the server exited: {alive}"
        time.sleep(0.1)
    assert not segments_of(server.pid), "shared-memory segments left in /dev/shm"


def process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_tp2_server_matches_offline_then_sigterm_mid_stream_exits_0_leaving_nothing(tied_model):
    server = Server("--model", tied_model, *TP2_FLAGS)
    try:
        children = child_pids(server.pid)
        assert worker_pids(server.pid)
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            assert_greedy_equals_offline(client, tied_model)
            stream = client.completions.create(model="tiny", prompt="long", max_tokens=480, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            server.process.send_signal(signal.SIGTERM)
            chunks = list(stream)  # the server finishes or aborts it, and ends the stream properly
        assert chunks[-1].choices[0].finish_reason in ("abort", "length")
        assert server.stop() == 0
        assert_nothing_left(server, children)
    finally:
        server.kill_leftovers()


def test_dead_worker_turns_health_to_503_and_requests_to_503(tied_model):
    server = Server("--model", tied_model, *TP2_FLAGS)
    try:
        children = child_pids(server.pid)
        worker, = worker_pids(server.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.request("GET", "/health")[0] != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 after the worker died"
            time.sleep(0.1)
        status, body = server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "a"})
        assert status == 503 and "engine" in body["error"]["message"]
        assert server.stop() == 0
        assert_nothing_left(server, children)
    finally:
        server.kill_leftovers()


def test_under_torchrun_rank_0_serves_and_sigterm_to_it_stops_every_rank(tied_model):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launcher = (torchrun, "--standalone", "--nproc-per-node", "2", os.path.join(REPO, "launch", "serve.py"))
    server = Server("--model", tied_model, "--block-size", str(BLOCK_SIZE), "--num-kvcache-blocks", "64",
                    launcher=launcher)
    try:
        ranks = child_pids(server.pid)  # torchrun's children: one process per rank
        assert len(ranks) == 2
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            assert client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        rank_0, = (pid for pid in ranks if b"RANK=0" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))
        children = ranks | child_pids(rank_0)
        os.kill(rank_0, signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0  # every rank exited 0
        assert_nothing_left(server, children)
        assert not segments_of(rank_0)
    finally:
        server.kill_leftovers()


def test_idle_server_uses_almost_no_cpu(server, client):
    client.completions.create(model="tiny", prompt="wake up", max_tokens=2)
    time.sleep(0.5)
    before = process_cpu_seconds(server.pid)
    time.sleep(3.0)
    assert process_cpu_seconds(server.pid) - before < 0.3  # under 10% of one core


def test_health_answers_while_a_long_prefill_runs(server, client):
    prompts = [[(7 * i + j) % 300 for j in range(400)] for i in range(48)]  # ~19k prompt tokens
    done = threading.Event()
    health = []

    def poll_health():
        while not done.is_set():
            started = time.monotonic()
            health.append((server.request("GET", "/health")[0], time.monotonic() - started))
            time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        response = client.completions.create(model="tiny", prompt=prompts, max_tokens=1)
    finally:
        done.set()
        poller.join()
    assert len(response.choices) == len(prompts)
    assert len(health) >= 2 and all(status == 200 for status, _ in health)
