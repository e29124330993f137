"""Benchmarks of the engine: `tpengine bench latency`, `tpengine bench throughput` and `tpengine bench serve`
(latency.py, throughput.py, serve.py, as `vllm bench` names them), and the harness they share with the comparison
benchmarks in benchmarks/: the random-weight models (models.py), the random workloads (workload.py), the timed
runs (timing.py), a minimal streaming client (client.py), and each run's record (results.py, quick.py).
Importing it loads nothing heavy: torch and transformers come in with the run that needs them."""
