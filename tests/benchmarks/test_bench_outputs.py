"""benchmarks/bench_outputs.py --quick runs end to end and reports every case against its baseline."""
from tests.benchmarks import run_script


def test_bench_outputs_reports_every_case_on_a_tiny_workload():
    out = run_script("bench_outputs.py", "--quick").stdout
    for case in ("| neither (generate()) |", "| streamed |", "| stop strings |", "| streamed + stop strings |",
                 "| streamed, delta outputs |", "| streamed + stop strings, delta outputs |"):
        assert case in out, out
    server = next(line for line in out.splitlines() if line.startswith("| streamed, delta outputs, built off"))
    assert float(server.split("|")[-2]) > 0, server  # the outputs' build, timed apart
