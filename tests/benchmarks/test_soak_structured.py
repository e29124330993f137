"""benchmarks/soak_structured.py --quick: a server answers every request with a schema of its own, and the script
reports its resident memory as the grammar cache fills."""
import json

from tests.benchmarks import run_script


def test_soak_structured_quick_answers_every_distinct_schema_and_reports_rss(tied_model):
    out = run_script("soak_structured.py", "--quick", "--model", tied_model).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["statuses"] == {"200": 60} and summary["rss_end_mb"] > 0, out
