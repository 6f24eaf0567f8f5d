#!/usr/bin/env bash
# The README's first command: install, build, then the main job: a real chat model,
# SmolLM2-135M-Instruct (the install step converts it into a Hugging Face folder), exported as a
# decoder, cut into 2 pipeline stages, answering chat questions as text streamed as it is generated
# (`pipe chat`, with tokens/s), in one process and then over 2 processes, each reply checked against
# transformers' greedy reply to the same conversation. Then the toy model: a small model with
# pipe::split() markers run through the pipeline with 4 micro-batches, checked against eager PyTorch.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
"$LIBPIPE_ROOT/scripts/build.sh"

pipe=$LIBPIPE_BUILD/pipe
work=$LIBPIPE_BUILD/demo
mkdir -p "$work"

# --- the main job: a chat model over 2 pipeline stages ---
model=$("$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/models/smollm2.py") # converted once per machine, then cached
chat=$work/smollm2
questions=("What is the capital of France?" "And what is the capital of Germany?"
  "Name the three primary colors, please.")
max_new_tokens=64
split=(--stages 2 --policy params)

echo "== SmolLM2-135M-Instruct exported as a decoder (python -m libpipe.export_llm), beside its files"
mkdir -p "$chat"
for f in "$model"/*; do ln -sfn "$f" "$chat/"; done # the folder as a user has it: config, weights, tokenizer
PYTHONPATH=$LIBPIPE_ROOT/bindings/python "$LIBPIPE_PYTHON" -m libpipe.export_llm "$model" "$chat/decoder.pt" \
  --max-seq-len 1024 --max-batch 1
echo
echo "== The plan: 2 stages of equal parameter bytes (pipe split; the weights are the folder's model.safetensors)"
"$pipe" split "$chat/decoder.pt" "${split[@]}" --weights "$chat/model.safetensors" | grep -v '^    '
echo
echo "== A chat over the 2 stages in this process (pipe chat, one message per line from a pipe)"
printf '  > %s\n' "${questions[@]}"
echo "   replies, streamed as they are generated, each with its tokens/s:"
# The replies on stdout, the [statistics] on stderr: both shown in order, the replies kept for the check.
printf '%s\n' "${questions[@]}" |
  "$pipe" chat "$chat" "${split[@]}" --max-new-tokens "$max_new_tokens" --stats 2>&1 | tee "$work/chat.log"
echo
echo "== The same chat with the second stage in another process (--processes 2)"
printf '%s\n' "${questions[@]}" |
  "$pipe" chat "$chat" "${split[@]}" --processes 2 --max-new-tokens "$max_new_tokens" --stats 2>&1 |
  tee "$work/chat-2-processes.log"
for log in chat chat-2-processes; do grep -v '^\[' "$work/$log.log" >"$work/$log.txt" || true; done
echo
echo "== Compared with transformers' greedy replies to the same conversation"
HF_HUB_OFFLINE=1 "$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/llm/chat_reference.py" "$model" "${questions[@]}" \
  --max-new-tokens "$max_new_tokens" --check "$work/chat.txt"
cmp -s "$work/chat.txt" "$work/chat-2-processes.txt" || {
  echo "the replies over 2 processes differ from those in one process" >&2
  exit 1
}
echo "over 2 processes: the same replies"
echo
echo "   (on a terminal, 'build/pipe chat $chat ${split[*]}' is an interactive chat: Ctrl-C stops a reply, Ctrl-D ends)"
echo

# --- the toy model: markers in the code, micro-batches ---
echo "== Exporting the toy model with PyTorch"
PYTHONPATH=$LIBPIPE_ROOT/bindings/python "$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/examples/model/make_demo_model.py" "$work"
echo
echo "== The plan (pipe split)"
"$pipe" split "$work/demo.pt"
echo
echo "== Pipelined run on the CPU, 4 micro-batches (pipe run)"
"$pipe" run "$work/demo.pt" --input "$work/demo.inputs.safetensors" \
  --output "$work/demo.outputs.safetensors" --microbatches 4
echo
echo "== Compared with eager PyTorch"
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/examples/model/compare_outputs.py" \
  "$work/demo.outputs.safetensors" "$work/demo.expected.safetensors"
