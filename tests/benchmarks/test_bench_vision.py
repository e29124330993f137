"""benchmarks/bench_vision.py --quick runs end to end: the CPU flags line, the TTFT table's rows for tpengine and
transformers on the same tiny Qwen2.5-VL checkpoint, both engines' first token alike, and the --json record."""
import json
import re

from tests.benchmarks import run_script


def test_bench_vision_quick_times_first_token_and_encoder_for_both_engines(tmp_path):
    path = tmp_path / "vision.json"
    out = run_script("bench_vision.py", "--quick", "--json", str(path)).stdout
    assert out.startswith("CPU flags: "), out
    assert "| engine | dtype | TTFT ms (median of 2, range) | encoder ms | encoder share |" in out, out
    for engine in ("tpengine", "transformers"):
        assert re.search(rf"^\| {engine} \| (bfloat16|float32) \| [\d,.]+ \([\d,.]+-[\d,.]+\) \| [\d,.]+ "
                         rf"\([\d,.]+-[\d,.]+\) \| \d+% \| [\d.]+x \|$", out, re.MULTILINE), out
    # 112 x 112 pixels: 8 x 8 patches of 14, 16 image tokens after the 2 x 2 merge
    assert "one 112x112 image (grid (1, 8, 8) patches, 16 image tokens)" in out, out
    # the same on this machine; random logits are near-tied, so another CPU's kernels may round to another
    assert re.search(r"^first token: tpengine \d+, transformers \d+ \((same|differs: .*)\)$", out, re.MULTILINE), out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "bench_vision" and record["cpu_flags"] and record["image_size"] == 112
    assert record["grid"] == [1, 8, 8] and record["repeat"] == 2
    assert set(record["engines"]) == {"tpengine", "transformers"}
    for engine in record["engines"].values():
        assert len(engine["ttft_ms"]) == len(engine["encoder_ms"]) == 2
        assert engine["ttft_median_ms"] > 0 and engine["encoder_median_ms"] > 0 and engine["encoder_share"] > 0
    assert record["engines"]["tpengine"]["image_tokens"] == 16
