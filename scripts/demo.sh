#!/usr/bin/env bash
# The README's first command: install, build, then export a small model with pipe::split()
# markers with this machine's PyTorch, print its plan, run it through the pipeline on the CPU
# with 4 micro-batches, and check the result against eager PyTorch.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
"$LIBPIPE_ROOT/scripts/build.sh"

work=$LIBPIPE_BUILD/demo
mkdir -p "$work"
echo "== Exporting the demo model with PyTorch"
PYTHONPATH=$LIBPIPE_ROOT/bindings/python "$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/examples/model/make_demo_model.py" "$work"
echo
echo "== The plan (pipe split)"
"$LIBPIPE_BUILD/pipe" split "$work/demo.pt"
echo
echo "== Pipelined run on the CPU, 4 micro-batches (pipe run)"
"$LIBPIPE_BUILD/pipe" run "$work/demo.pt" --input "$work/demo.inputs.safetensors" \
  --output "$work/demo.outputs.safetensors" --microbatches 4
echo
echo "== Compared with eager PyTorch"
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/examples/model/compare_outputs.py" \
  "$work/demo.outputs.safetensors" "$work/demo.expected.safetensors"
