"""benchmarks/bench_cpu_replay.py --quick decodes the three ways (eager, replayed from Python, replayed from C++) in one
engine and reports each batch."""
from tests.benchmarks import run_script


def test_bench_cpu_replay_reports_the_three_ways_per_batch():
    out = run_script("bench_cpu_replay.py", "--quick").stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2], out
    for row in rows:
        assert all(float(cell.strip().rstrip("x")) > 0 for cell in row[1:]), out
