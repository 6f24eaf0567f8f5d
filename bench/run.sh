#!/usr/bin/env bash
# Builds and runs the benchmarks, printing the rows recorded in bench/RESULTS.md.
# Run after scripts/build.sh (or scripts/demo.sh / scripts/test.sh), on an otherwise idle machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
export PYTHONPATH=$LIBPIPE_ROOT/bindings/python
cmake --build "$LIBPIPE_BUILD" --target pipe_cli pipeline_bench soak >/dev/null
models=$LIBPIPE_BUILD/bench-models
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/make_bench_models.py" "$models"
bench=$LIBPIPE_BUILD/bench/pipeline_bench

echo "## Scheduler"
"$bench" overhead "$models/mlp.pt" "$models/mlp.inputs.safetensors"
"$bench" hop "$models/trivial.pt" "$models/trivial.inputs.safetensors"
"$bench" throughput "$models/mlp.pt" "$models/mlp.inputs.safetensors" 8 2 adaptive
"$bench" throughput "$models/mlp.pt" "$models/mlp.inputs.safetensors" 8 2 fixed
"$bench" throughput "$models/mlp.pt" "$models/mlp.inputs.safetensors" 2 2 fixed
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/pytorch_pipelining.py" --microbatches 8 2>/dev/null
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/pytorch_pipelining.py" --microbatches 2 2>/dev/null
echo
echo "## Across processes (Gloo)"
for processes in 1 2; do
  "$LIBPIPE_BUILD/pipe" bench "$models/mlp.pt" --input "$models/mlp.inputs.safetensors" --microbatches 8 \
    --requests 60 --concurrency 2 --processes "$processes" --json
done
for processes in 1 2 4; do
  "$LIBPIPE_BUILD/pipe" bench "$models/trivial.pt" --input "$models/trivial.inputs.safetensors" --microbatches 1 \
    --requests 300 --concurrency 1 --processes "$processes" --json
done
echo
echo "## Split balance"
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/split_balance.py" "$LIBPIPE_BUILD/pipe" --runs 5
echo
echo "## Stage weights"
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/stage_memory.py" "$LIBPIPE_BUILD/pipe"
echo
echo "## Soak"
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/models/seed_models.py" "$models/seed" >/dev/null
"$LIBPIPE_BUILD/bench/soak" "$models/seed/example_code.traced.pt" "$models/seed/example_code.inputs.safetensors" \
  "$models/seed/example_code.expected.safetensors" 100000 8
