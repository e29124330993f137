"""`tpengine serve --data-parallel-size N`: N replica servers, each its own tp x pp ranks on its own cores or
GPUs, behind vLLM's cache-aware router (vllm-router) on the user's host and port.

The replicas are plain `tpengine serve` processes on free local ports; the router sends each request to the
replica whose prefix cache most likely holds its prompt (cache_aware) or to each in turn (round_robin), and
stops sending to one whose /health fails. SIGTERM or Ctrl-C stops the router and every replica, which drain
as a lone server does.
"""
import ctypes
import http.client
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger("tpengine")

ROUTER_POLICIES = ("cache_aware", "round_robin")
# A replica or the router gets this long to exit after SIGTERM (a replica drains in GRACEFUL_SHUTDOWN_S)
STOP_TIMEOUT_S = 20.0
# The router checks each replica's /health this often; this many failures in a row take it out of rotation
ROUTER_HEALTH_CHECK_INTERVAL_S = 1
ROUTER_HEALTH_FAILURE_THRESHOLD = 2
POLL_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1


@dataclass
class ManagedProcess:
    name: str
    url: str  # where this host reaches it
    process: subprocess.Popen


def router_available() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def replica_device_env(index: int, ranks_per_replica: int, on_cpu: bool, num_replicas: int,
                       usable_cpus: list[int], visible_gpus: list[str]) -> tuple[dict, list[int] | None]:
    """(environment changes, CPU cores) of replica `index`, whose engine has ranks_per_replica ranks (tp x pp):
    on the CPU an equal share of this process's cores (its threads pinned to them), on CUDA a GPU per rank."""
    if on_cpu:
        share = len(usable_cpus) // num_replicas
        if share < 1:
            raise ValueError(f"--data-parallel-size {num_replicas} is more replicas than the {len(usable_cpus)} CPU "
                             "cores this process may use: each replica needs a core at least")
        cores = usable_cpus[index * share:(index + 1) * share]
        return {"OMP_NUM_THREADS": str(max(1, share // ranks_per_replica))}, cores
    needed = num_replicas * ranks_per_replica
    if needed > len(visible_gpus):
        raise ValueError(f"--data-parallel-size {num_replicas} replicas of {ranks_per_replica} ranks (--tp x --pp) "
                         f"need {needed} GPUs, but {len(visible_gpus)} are visible")
    gpus = visible_gpus[index * ranks_per_replica:(index + 1) * ranks_per_replica]
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}, None


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices, or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def _free_port() -> int:
    from tpengine.distributed.parallel_state import find_free_port  # imports torch: not at `tpengine --help`
    return find_free_port()


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM it when the supervisor dies, however it dies (Linux), so nothing is left."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _spawn(name: str, command: list[str], url: str, env: dict | None = None,
           cores: list[int] | None = None) -> ManagedProcess:
    # its own session: Ctrl-C reaches the supervisor alone, which stops the router and replicas in order
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                               preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if cores:
        os.sched_setaffinity(process.pid, cores)  # before it starts threads, which inherit the mask
    return ManagedProcess(name, url, process)


def router_command(replica_urls: list[str], host: str, port: int, policy: str, metrics_port: int,
                   log_level: str = "info") -> list[str]:
    """vllm-router in front of the replicas: each request to the replica by policy, a replica out of rotation
    after ROUTER_HEALTH_FAILURE_THRESHOLD failed health checks ROUTER_HEALTH_CHECK_INTERVAL_S apart."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *replica_urls, "--policy", policy, "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", str(ROUTER_HEALTH_CHECK_INTERVAL_S),
            "--health-failure-threshold", str(ROUTER_HEALTH_FAILURE_THRESHOLD),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", log_level]


def http_status(url: str, path: str, timeout: float = 2.0) -> int | None:
    """The status of GET url+path, or None when nothing answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        connection.close()


class StopRequested(Exception):
    """SIGTERM or SIGINT reached the supervisor."""


class StartFailed(RuntimeError):
    """A replica or the router exited before it was ready."""


class DataParallelServer:
    """Starts the replicas, then the router; stops all of them on a signal or when serving is impossible."""

    def __init__(self, *, replica_argv: list[str], num_replicas: int, ranks_per_replica: int, on_cpu: bool,
                 host: str, port: int, router_policy: str, quiet: bool, api_key: str | None = None):
        if num_replicas < 2:
            raise ValueError(f"--data-parallel-size must be at least 2 to start a router, got {num_replicas}")
        if router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, got {router_policy!r}")
        if not router_available():
            raise ValueError("--data-parallel-size needs vLLM's router: pip install vllm-router "
                             "(Linux wheels; or install tpengine with the 'router' extra)")
        self.replica_argv, self.num_replicas = replica_argv, num_replicas
        self.ranks_per_replica = ranks_per_replica
        self.on_cpu, self.host, self.port, self.router_policy, self.quiet = on_cpu, host, port, router_policy, quiet
        self.api_key = api_key
        from tpengine.entrypoints.server import bind_socket
        bind_socket(host, port).close()  # a taken port fails now, not once the replicas have loaded
        cpus, gpus = (usable_cpus(), []) if on_cpu else ([], visible_gpus())
        # checked for every replica before any starts, so a bad size starts nothing
        self.placements = [replica_device_env(i, ranks_per_replica, on_cpu, num_replicas, cpus, gpus)
                           for i in range(num_replicas)]
        self.replicas: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start_replicas()
            self._wait_until_healthy(self.replicas, "/health")
            self._start_router()
            self._wait_until_healthy([self.router], "/readiness")
            logger.info("serving %d replicas behind vllm-router (%s) on http://%s:%d", self.num_replicas,
                        self.router_policy, self.host, self.port)
            return self._supervise()
        except StopRequested:
            return 0
        except StartFailed as e:
            logger.error("%s: stopping the others", e)
            return 1
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        raise StopRequested

    def _start_replicas(self) -> None:
        for index, (device_env, cores) in enumerate(self.placements):
            port = _free_port()
            env = {**os.environ, **device_env}
            if self.api_key is not None:
                env["TPENGINE_API_KEY"] = self.api_key  # not on the command line, where ps shows it
            command = [sys.executable, "-m", "tpengine.cli", "serve", *self.replica_argv,
                       "--host", "127.0.0.1", "--port", str(port)]
            self.replicas.append(_spawn(f"replica {index}", command, f"http://127.0.0.1:{port}", env, cores))
            logger.info("replica %d: pid %d on port %d (%s)", index, self.replicas[-1].process.pid, port,
                        f"CPU cores {cores}" if cores else f"CUDA_VISIBLE_DEVICES={device_env['CUDA_VISIBLE_DEVICES']}")

    def _start_router(self) -> None:
        # the router's own Prometheus port: its default (29000) may be taken by another deployment
        command = router_command([replica.url for replica in self.replicas], self.host, self.port,
                                 self.router_policy, _free_port(), "warning" if self.quiet else "info")
        # vllm-router 0.1.17 logs at info whatever --log-level warning says; RUST_LOG it does read
        env = {**os.environ, "RUST_LOG": "warn"} if self.quiet else None
        self.router = _spawn("router", command, f"http://{self._local_address()}:{self.port}", env)

    def _local_address(self) -> str:
        """Where this host reaches the router: its address, or loopback when it listens on every interface."""
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    def _wait_until_healthy(self, processes: list[ManagedProcess], path: str) -> None:
        waiting = list(processes)
        while waiting:
            for managed in list(waiting):
                if managed.process.poll() is not None:
                    raise StartFailed(f"{managed.name} exited with status {managed.process.returncode} before it was "
                                      "ready (its log is above)")
                if http_status(managed.url, path) == 200:
                    waiting.remove(managed)
            time.sleep(POLL_INTERVAL_S)

    def _supervise(self) -> int:
        """Until a signal: a replica that exits is left out by the router; with none left, or no router, stop."""
        reported: set[str] = set()
        while True:
            if self.router.process.poll() is not None:
                logger.error("the router exited with status %d: stopping the replicas", self.router.process.returncode)
                return 1
            exited = [replica for replica in self.replicas if replica.process.poll() is not None]
            for replica in exited:
                if replica.name not in reported:
                    reported.add(replica.name)
                    logger.warning("%s exited with status %d: the router sends its requests to the others",
                                   replica.name, replica.process.returncode)
                    _clean_up_after(replica.process)
            if len(exited) == len(self.replicas):
                logger.error("every replica has exited: stopping the router")
                return 1
            time.sleep(POLL_INTERVAL_S)

    def stop(self) -> None:
        """SIGTERM to the router and every replica at once (the replicas drain while the router stops), then
        SIGKILL what is still running after STOP_TIMEOUT_S, and remove the shared memory of a replica killed so."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        managed = [m for m in (self.router, *self.replicas) if m is not None]
        for m in managed:
            if m.process.poll() is None:
                m.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for m in managed:
            try:
                m.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killing it", m.name, STOP_TIMEOUT_S)
                _kill_session(m.process)
            if m in self.replicas:
                _clean_up_after(m.process)


def _clean_up_after(replica: subprocess.Popen) -> None:
    """A replica killed by a signal (by us or anyone) leaves its workers running a moment, and its /dev/shm
    segments for good: end both. One that exited on its own has already."""
    if replica.returncode < 0 and replica.returncode != -signal.SIGTERM:
        _kill_session(replica)
        remove_segments_of(replica.pid)


def _kill_session(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything in its session (a replica's tensor-parallel workers)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def remove_segments_of(pid: int) -> None:
    """The /dev/shm segments a killed replica created (their names carry its pid) would outlive it."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if name.startswith(f"tpengine_{pid}_"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def main(argv: list[str] | None = None) -> None:
    """The router alone, in front of replicas started elsewhere (launch/dp_serve.sh): flags it does not know go
    to vllm-router as they are."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tpengine.entrypoints.data_parallel",
                                     description="vLLM's router in front of running `tpengine serve` replicas.")
    parser.add_argument("--replica-url", action="append", required=True, metavar="URL",
                        help="a replica's URL, http://HOST:PORT (repeat for each)")
    parser.add_argument("--host", default="127.0.0.1", help="address the router listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                        help="cache_aware or round_robin (default cache_aware)")
    parser.add_argument("--metrics-port", type=int, default=29000, help="the router's Prometheus port (default 29000)")
    args, router_flags = parser.parse_known_args(argv)
    if not router_available():
        parser.exit(2, "the router is not installed: pip install vllm-router (Linux wheels)\n")
    command = router_command(args.replica_url, args.host, args.port, args.router_policy, args.metrics_port)
    os.execv(command[0], command + router_flags)


if __name__ == "__main__":
    main()
