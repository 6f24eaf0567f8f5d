#!/usr/bin/env bash
# Builds the unit tests with ThreadSanitizer in build-tsan/ and runs the scheduler's tests
# (sessions, requests, cancellation, deadlines, completion callbacks, shutdown, the generation engine's
# scheduler thread and token callbacks, the spare-core helpers that stages borrow, stages shared by worker
# threads) under it. LibTorch is not instrumented: TSan sees libpipe's own threads, locks and shared state, which
# is what these tests exercise.
# Extra arguments go to the test binary (e.g. --gtest_filter=Session.Cancel*).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
build=${LIBPIPE_TSAN_BUILD:-$LIBPIPE_ROOT/build-tsan}
cmake -S "$LIBPIPE_ROOT" -B "$build" -G Ninja -DLIBPIPE_PYTHON="$LIBPIPE_PYTHON" -DLIBPIPE_SANITIZE=thread >/dev/null
cmake --build "$build" --target unit_tests_threads pipe_test_gate
models=$build/tests/models
export LIBPIPE_TEST_GATE_LIB=$build/tests/gate/libpipe_test_gate.so  # the gated model's operator (tests/gate)
PYTHONPATH=$LIBPIPE_ROOT/bindings/python "$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/models/seed_models.py" "$models" >/dev/null
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/models/decoder_models.py" "$models" >/dev/null  # Engine.* decoders
export PIPE_TEST_MODELS=$models
# The engine's tests that exercise its threads (scheduler, stages, callbacks, cancel, deadline, destroy): under TSan
# each engine costs seconds there, so the planner and the single-path engine tests run in the plain suite only.
engine='Engine.SequencesJoiningMidFlight*:Engine.MoreSequencesThanSlots*:Engine.ASubmitBeyondMaxQueued*'
engine+=':Engine.CancellingASequenceHeld*:Engine.ADeadlinePassing*:Engine.AFailingStep*:Engine.Destroying*'
engine+=':Engine.StagesShared*'
# LibTorch's OpenMP regions are suppressed (see the file for why).
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 exitcode=66 suppressions=$LIBPIPE_ROOT/tests/tsan/suppressions.txt"
"$build/tests/unit_tests_threads" --gtest_filter="Session.*:SharedStages.*:StageSharing.*:SpareCores.*:PanelLinear.*:RequestCompletion.*:Microbatch*:LocalTransport.*:DistributedSession.*:Heartbeat.*:$engine" "$@"
