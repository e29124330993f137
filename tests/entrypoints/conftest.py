"""`tpengine serve` started as a user starts it: a subprocess on a free port, ready once /health answers."""
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tpengine.distributed.parallel_state import find_free_port

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
BLOCK_SIZE = 16


def child_pids(pid: int) -> set[int]:
    """Processes whose parent is pid."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the command name (2nd field) may hold spaces: the parent pid follows its closing ')'
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we looked
    return children


def worker_pids(pid: int) -> set[int]:
    """The tensor-parallel workers among pid's children (multiprocessing's resource tracker is another)."""
    workers = set()
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"tpengine.runner.worker" in f.read():
                    workers.add(child)
        except OSError:
            continue
    return workers


def segments_of(pid: int) -> set[str]:
    """The /dev/shm segments a process created (their names carry its pid)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"tpengine_{pid}_")}


class Server:
    model_name = "tiny"

    def __init__(self, *args: str, launcher: tuple[str, ...] = (sys.executable, "-m", "tpengine.cli", "serve"),
                 stderr=None):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*launcher, "--port", str(self.port), "--quiet", "--served-model-name", self.model_name, *args]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} before it was ready")
            try:
                if self.request("GET", "/health", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"server not ready within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    @classmethod
    def running_at(cls, port: int) -> "Server":
        """A handle on a server another process started (a data-parallel replica): requests and metrics only."""
        server = cls.__new__(cls)
        server.port, server.url, server.process = port, f"http://127.0.0.1:{port}", None
        return server

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict | str]:
        """One plain HTTP request: (status, the JSON body parsed, or the text)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
                headers = {"Content-Type": "application/json", **(headers or {})}
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            text = response.read().decode()
        finally:
            connection.close()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

    def stop(self, sig=signal.SIGTERM) -> int:
        """Signal the server and wait for it; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def kill_leftovers(self) -> None:
        """Stop the server and its workers whatever state a failed test left them in."""
        children = child_pids(self.pid) if self.process.poll() is None else set()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics, read with prometheus_client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families
        status, text = self.request("GET", "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise KeyError(f"{name} {labels} not in /metrics")

    def wait_for_metric(self, name: str, value: float, timeout: float = 20.0, **labels) -> None:
        deadline = time.monotonic() + timeout
        while (current := self.metric(name, **labels)) != value:
            if time.monotonic() > deadline:
                pytest.fail(f"{name} stayed {current}, expected {value}")
            time.sleep(0.05)


def running_server(model: str, *flags: str):
    """A fixture's tp=1 server on model with the suite's cache settings and flags; it must stop cleanly (0)."""
    server = Server("--model", model, "--block-size", str(BLOCK_SIZE), "--max-model-len", "512",
                    "--num-kvcache-blocks", "256", *flags)
    yield server
    try:
        assert server.stop() == 0
    finally:
        server.kill_leftovers()


@pytest.fixture(scope="session")
def server(tied_model):
    """One tp=1 server on the tiny tied model (byte tokenizer, ChatML template), shared by the tests."""
    yield from running_server(tied_model)


@pytest.fixture
def client(server):
    from openai import OpenAI
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture
def async_client(server):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)
