#!/usr/bin/env bash
# vLLM's router (vllm-router) in front of `tpengine serve` replicas that run anywhere, e.g. one per node:
#   node 1:  tpengine serve --model /models/qwen3 --tp 4 --host 0.0.0.0 --port 8001
#   node 2:  tpengine serve --model /models/qwen3 --tp 4 --host 0.0.0.0 --port 8001
#   router:  REPLICAS="http://10.0.0.1:8001 http://10.0.0.2:8001" launch/dp_serve.sh --host 0.0.0.0 --port 8000
# The router runs as `tpengine serve --data-parallel-size N` runs it on one node: each request goes to the
# replica whose prefix cache most likely holds its prompt (--router-policy cache_aware, the default; or
# round_robin), and a replica whose /health fails twice in a row (checked every second) gets no more.
# Flags: --host, --port, --router-policy, --metrics-port (the router's Prometheus port, default 29000);
# any other flag goes to vllm-router as it is (see `vllm-router --help`).
set -euo pipefail
: "${REPLICAS:?set REPLICAS to the URLs of the replicas, space-separated}"
urls=()
for url in $REPLICAS; do urls+=(--replica-url "$url"); done
exec "${PYTHON:-python3}" -m tpengine.entrypoints.data_parallel "${urls[@]}" "$@"
