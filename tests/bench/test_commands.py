"""`tpengine bench latency|throughput|serve`: each takes every engine flag, runs on a tiny model in seconds and
prints its measured figures, and --output-json writes them with the run's record."""
import json

import pytest

from tests.entrypoints.conftest import Server
from tpengine.bench.serve import endpoint_of
from tpengine.cli import BENCHMARKS, _engine_argv, build_parser, main
from tpengine.config import engine_fields
from tpengine.distributed.parallel_state import find_free_port

TINY_RUN = ["--input-len", "6", "--output-len", "3", "--quiet"]
RECORD_FIELDS = {"benchmark", "command", "date", "revision", "machine", "load_average_before", "load_average_after"}


@pytest.mark.parametrize("benchmark", list(BENCHMARKS))
def test_every_engine_setting_is_a_flag_of_every_bench_command(benchmark, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", benchmark, "--help"])
    help_text = capsys.readouterr().out
    assert [field.flag for field in engine_fields().values() if field.flag not in help_text] == []
    args = build_parser().parse_args(["bench", benchmark])
    assert set(engine_fields()) <= set(vars(args))


def test_bench_latency_times_every_batch_and_prints_the_percentiles(tied_model, tmp_path, capsys):
    path = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tied_model, *TINY_RUN, "--batch-size", "2", "--num-iters-warmup", "1",
                 "--num-iters", "2", "--block-size", "16", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Avg latency: " in out and "99% percentile latency: " in out, out
    record = json.loads(path.read_text())
    assert RECORD_FIELDS <= set(record) and record["command"].startswith("tpengine bench latency --model ")
    assert len(record["latencies"]) == 2 and all(s > 0 for s in record["latencies"])
    assert set(record["percentiles"]) == {"10", "25", "50", "75", "90", "99"}


def test_bench_throughput_counts_every_requested_token(tied_model, tmp_path, capsys):
    path = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tied_model, *TINY_RUN, "--num-prompts", "5",
                 "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Throughput: " in out and " output tokens/s" in out, out
    assert "Total num prompt tokens: 30" in out and "Total num output tokens: 15" in out
    record = json.loads(path.read_text())
    assert record["num_requests"] == 5 and record["total_output_tokens"] == 15 and record["elapsed_time"] > 0
    assert record["output_tokens_per_second"] == pytest.approx(15 / record["elapsed_time"])


def test_bench_serve_measures_a_running_server(tied_model, tmp_path, capsys):
    server = Server("--model", tied_model, "--block-size", "16")
    try:
        path = tmp_path / "serve.json"
        assert main(["bench", "serve", "--base-url", server.url, *TINY_RUN, "--num-prompts", "4",
                     "--max-concurrency", "2", "--output-json", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"Model:{' ' * 35}{Server.model_name}" in out and "Successful requests:" in out, out
        for line in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "Mean E2EL (ms):"):
            assert line in out, out
        record = json.loads(path.read_text())
        assert record["completed"] == 4 and record["total_output_tokens"] == 12 and record["total_input_tokens"] == 24
        assert record["mean_ttft_ms"] > 0 and record["output_throughput"] > 0
        assert server.stop() == 0
    finally:
        server.kill_leftovers()


def test_bench_serve_starts_its_server_with_the_engine_flags_given_and_no_others():
    args = build_parser().parse_args(["bench", "serve", "--model", "/m", "--block-size", "16", "--num-prompts", "2",
                                      "--no-enable-prefix-caching", "--input-len", "8"])
    assert _engine_argv(args) == ["--model", "/m", "--block-size", "16", "--no-enable-prefix-caching"]


@pytest.mark.parametrize("flags, address", [
    (["--base-url", "http://10.0.0.2:9000"], ("10.0.0.2", 9000)),
    (["--host", "example"], ("example", 8000)),
    (["--port", "9001"], ("127.0.0.1", 9001)),
    ([], None),
])
def test_bench_serve_measures_the_server_named_or_else_starts_one(flags, address):
    endpoint = endpoint_of(build_parser().parse_args(["bench", "serve", *flags]))
    assert (endpoint and (endpoint.host, endpoint.port)) == address


def test_bench_serve_refuses_engine_flags_for_a_server_it_does_not_start(capsys):
    assert main(["bench", "serve", "--port", "9", "--block-size", "16", "--num-prompts", "1"]) == 2
    assert "engine flags (--block-size 16) apply only to a server bench serve starts" in capsys.readouterr().err


def test_bench_serve_says_so_when_no_server_answers(capsys):
    port = find_free_port()
    assert main(["bench", "serve", "--port", str(port), "--num-prompts", "1"]) == 2
    assert f"cannot reach the server at 127.0.0.1:{port}" in capsys.readouterr().err
