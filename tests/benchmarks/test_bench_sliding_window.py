"""benchmarks/bench_sliding_window.py --quick: the three configurations' table, the same tokens with blocks released
and kept, fewer blocks held once released, and the JSON record."""
import json

from tests.benchmarks import run_script


def test_bench_sliding_window_quick_releases_blocks_and_keeps_tokens(tmp_path):
    path = tmp_path / "sliding_window.json"
    out = run_script("bench_sliding_window.py", "--quick", "--model", str(tmp_path / "model"),
                     "--json", str(path)).stdout
    for name in ("window, released", "window, kept", "full attention"):
        assert f"| {name} |" in out
    assert "released and kept write the same tokens: True" in out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "sliding_window" and record["same_tokens"]
    rows = record["rows"]
    # 256 + 8 tokens in blocks of 16: 17 blocks kept; released, the 64-token window and the block being written
    assert rows["window, kept"]["held_blocks"] == 17 == rows["full attention"]["held_blocks"]
    assert rows["window, released"]["held_blocks"] <= 64 // 16 + 2
