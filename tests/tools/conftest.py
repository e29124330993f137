from tests.benchmarks.conftest import quick_model  # noqa: F401  (the tools profile the benchmarks' quick model)
