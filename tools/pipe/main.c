/* pipe: the libpipe command-line tool. Written against the public C ABI (pipe/pipe.h) only, so
 * it is also a working example of that ABI. Every error ends with one line on stderr and a
 * non-zero exit status: 1 for a failed operation, 2 for a usage error. This file holds the usage
 * text and dispatches to one file per command. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char usage_text[] =
    "usage: pipe <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  inspect MODEL\n"
    "      Print MODEL's module tree with parameter counts and bytes.\n"
    "  split MODEL [SPLIT] [--input IN.safetensors] [--json] [--save-stages DIR [--stage K]]\n"
    "      Cut MODEL (a TorchScript file, or a torch.export .pt2) into stages and print the\n"
    "      plan. With --input, each stage is timed on those inputs; --save-stages writes\n"
    "      DIR/stage<i>.pt (.pt2 for a .pt2 model; only stage K with --stage), each a\n"
    "      standalone model of MODEL's format holding only its weights. With --dtype,\n"
    "      --quantize, --quantize-head or --quantize-embedding, each stage's bytes as a CPU stage stores them too\n"
    "      (\"weight_bytes\" in --json).\n"
    "  run MODEL [SPLIT] --input IN.safetensors --output OUT.safetensors [--microbatches M]\n"
    "      [--microbatching adaptive|fixed] [--replicate NAME,...] [--trace TRACE.json]\n"
    "      Run MODEL through the pipeline. IN holds one tensor per forward argument, named as\n"
    "      in the model code; OUT receives 'output' (or output.0, output.1, ... for tuples,\n"
    "      output.<key> for dicts). Inputs are cut into micro-batches along dimension 0;\n"
    "      --replicate gives the named ones whole to every micro-batch instead (e.g. a table\n"
    "      shared by the batch). --trace writes a Chrome trace of the run (one track per\n"
    "      stage), viewable in Perfetto.\n"
    "  bench MODEL [SPLIT] --input IN.safetensors [--microbatches M] [--requests R]\n"
    "      [--concurrency C] [--threads-per-stage T] [--microbatching adaptive|fixed]\n"
    "      [--replicate NAME,...] [--json]\n"
    "      Run R requests (default 100) of IN from C threads at once (default 2) after a\n"
    "      warm-up, and report throughput, latency percentiles and each stage's busy fraction.\n"
    "      --microbatching fixed cuts every request into M micro-batches; adaptive (the\n"
    "      default) cuts a request that arrives while others are in flight more coarsely.\n"
    "  generate MODEL [SPLIT] --weights W --prompt-ids ID,ID,... | --prompt TEXT [...]\n"
    "      --max-new-tokens N [--temperature T [--top-k K] [--top-p P]] [--seed S]\n"
    "      [--stop-ids ID,...] [--prefill-chunk C] [--threads-per-stage T] [--json]\n"
    "      [--trace TRACE.json [--trace-operators]] [--tokenizer DIR]\n"
    "      Generate up to N tokens after each prompt with MODEL, a decoder (`python -m\n"
    "      libpipe.export_llm` writes one for a Hugging Face model). Every prompt is submitted\n"
    "      at once, so they are batched and pipelined together; prints the generated ids, one\n"
    "      line per prompt in order. Greedy unless --temperature T > 0, then sampled among the\n"
    "      top K ids (default all) and the top-P probability mass (default 1), prompt i with\n"
    "      seed S + i (default S 0). A sequence ends at a --stop-ids id (printed as its last\n"
    "      id) or after N tokens. --prefill-chunk: tokens per step (default 256; padded positions\n"
    "      for a decoder without skips_padding), so that long prompts do not stall the others.\n"
    "      --json prints {\"outputs\": [[ids], ...],\n"
    "      \"tokens_per_s\": x, \"time_to_first_token_ms\": y, \"finish_reasons\": [...] (each\n"
    "      \"stop\" or \"length\"), \"steps_in_flight\": {\"now\": n, \"one_at_a_time\": a,\n"
    "      \"pipelined\": b}, \"peak_rss_mib\": {\"driver\": r, \"largest_worker\": w}}.\n"
    "      --prompt TEXT (repeatable, mixable with --prompt-ids) is one user turn of the\n"
    "      model's chat template (the text as it is without one), read with the tokenizer of\n"
    "      --tokenizer DIR, a Hugging Face model folder (default: the folder of --weights);\n"
    "      with a tokenizer each reply is printed as text (special tokens left out), one after\n"
    "      the other, --json adds \"texts\": [...], and without --stop-ids the folder's stop\n"
    "      ids end a reply.\n"
    "      --trace writes a Chrome trace of the generation: a track per\n"
    "      stage and one of the engine's steps (launch, collect, sample, deliver);\n"
    "      --trace-operators adds each stage slice's time per operator (slower while it runs).\n"
    "  chat MODEL_DIR_OR_DECODER [SPLIT] [--max-new-tokens N] [--temperature T [--top-k K]\n"
    "      [--top-p P]] [--seed S] [--system TEXT] [--tokenizer DIR] [--prefill-chunk C]\n"
    "      [--threads-per-stage T] [--stats]\n"
    "      A conversation with a decoder: each message is added to the conversation, which the\n"
    "      model's chat template renders whole (earlier turns are found in the cache, not computed\n"
    "      again), and the reply is printed as it is generated. MODEL_DIR_OR_DECODER is a Hugging\n"
    "      Face model folder with a decoder exported into it (`python -m libpipe.export_llm DIR\n"
    "      DIR/decoder.pt`; decoder.pt, else decoder.pt2, with the folder's model.safetensors and\n"
    "      tokenizer), or a decoder file with --weights (the tokenizer: --tokenizer DIR, else the\n"
    "      folder of --weights). On a terminal: type a message and press Enter; Ctrl-C stops a\n"
    "      reply, Ctrl-D ends the chat. From a pipe: one message per line (empty lines skipped),\n"
    "      each reply on a line of stdout, until the end of input. A reply ends at the folder's\n"
    "      stop ids, after --max-new-tokens N (default: none), or when the conversation fills the\n"
    "      decoder's --max-seq-len (said on stderr; a message that no longer fits is refused).\n"
    "      Greedy unless --temperature T > 0 (turn i sampled with seed S + i, default S 0).\n"
    "      --system TEXT opens the conversation with a system message; --stats prints each\n"
    "      reply's tokens, tokens/s and prompt tokens found in the cache on stderr.\n"
    "  worker --rank R --world-size N --store HOST:PORT [--comm-timeout-ms T] [--threads T]\n"
    "         [--token-file FILE]\n"
    "      Host stages for a session whose driver (a `pipe run`/`bench`/`generate` with\n"
    "      --world-size, or a program of the C ABI) listens at HOST:PORT (the port it\n"
    "      reported, never 0); exits when that session ends. Under torchrun or srun without\n"
    "      --rank and --world-size, launched rank i serves as rank i + 1 of a driver outside\n"
    "      the launch, whose store --store or LIBPIPE_STORE names.\n"
    "  version\n"
    "      Print the libpipe version.\n"
    "\n"
    "SPLIT is one of:\n"
    "  (nothing)                       cut at the pipe::split() markers in the model code\n"
    "  --split-at FQN:begin|FQN:end    cut before/after module FQN (repeatable; FQN@K:end\n"
    "                                  for the K-th call of a module called several times)\n"
    "  --stages N --policy P           N stages balanced by P: uniform (equal layers), params\n"
    "                                  (equal parameter bytes) or time (measured on --input)\n"
    "and may add:\n"
    "  --weights FILE_OR_INDEX         load each stage's weights from a .safetensors file or a\n"
    "                                  *.safetensors.index.json (needed for skeleton models)\n"
    "  --dtype fp32|fp16|bf16          convert floating weights (and inputs) to this dtype\n"
    "  --quantize int8|int4[:G]|none   CPU stages: linear layers' weights as 8-bit codes (a scale per\n"
    "                                  output feature) or 4-bit codes (a scale per G = 32 (default),\n"
    "                                  64 or 128 inputs); activations stay in the dtype (default none)\n"
    "  --quantize-head int8|int4|none  with --quantize: the output head (the linear layer whose\n"
    "                                  result the model returns, a decoder's lm_head) as 8-bit or\n"
    "                                  4-bit codes (int4 in --quantize's groups) or unquantized\n"
    "                                  (default: as the other weights under int8, int8 under int4)\n"
    "  --quantize-embedding int8|none  CPU stages: embedding tables as 8-bit codes with a scale per\n"
    "                                  row (with or without --quantize; not a table tied to the\n"
    "                                  stage's head; TorchScript models only) (default none)\n"
    "\n"
    "run, bench, generate and chat place the stages with:\n"
    "  --devices D0,D1,...|D|auto      one device per stage (cpu, cuda, cuda:N), one device for\n"
    "                                  all, or auto (the visible GPUs in order, else the CPU; over\n"
    "                                  processes each one's own GPU, cuda:LOCAL_RANK under a\n"
    "                                  launcher);\n"
    "                                  default: every stage on the CPU\n"
    "\n"
    "run, bench, generate and chat spread the stages over processes with:\n"
    "  --processes N                   start N-1 local workers (`pipe worker`) and use them\n"
    "                                  (they share a token made for them; the store on 127.0.0.1)\n"
    "  --world-size N --store HOST:PORT  drive N-1 workers started elsewhere; this process\n"
    "                                  hosts the rendezvous store at HOST:PORT only (PORT 0: a\n"
    "                                  free port) and, once it listens, prints on stderr\n"
    "                                  pipe: store listening on HOST:PORT (start workers with --store HOST:PORT)\n"
    "  (under torchrun or srun)        without those flags, the launcher's environment decides:\n"
    "                                  run the same command on every rank; rank 0 drives, hosts\n"
    "                                  the store at MASTER_ADDR:MASTER_PORT+1 under torchrun\n"
    "                                  (MASTER_PORT under srun; LIBPIPE_PORT overrides) and prints;\n"
    "                                  the others serve their stages and exit 0 when it is done\n"
    "  --token-file FILE               the session's secret (default: LIBPIPE_TOKEN); every\n"
    "                                  process of a session needs the same, at least 16 bytes\n"
    "  --transport tcp|nccl            how stages talk (default tcp: CPU tensors over TCP)\n"
    "  --comm-timeout-ms T             setup limit; a heartbeat silent this long fails (default 60000)\n";

int main(int argc, char **argv) {
  if (argc < 2) {
    fputs(usage_text, stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    fputs(usage_text, stdout);
    return 0;
  }
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("pipe %s\n", pipe_version());
    return 0;
  }
  for (int i = 2; i < argc; ++i)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage_text, stdout);
      return 0;
    }
  if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
  if (strcmp(cmd, "split") == 0) return cmd_split(argc - 2, argv + 2);
  if (strcmp(cmd, "run") == 0) return cmd_run(argc - 2, argv + 2);
  if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 2, argv + 2);
  if (strcmp(cmd, "generate") == 0) return cmd_generate(argc - 2, argv + 2);
  if (strcmp(cmd, "chat") == 0) return cmd_chat(argc - 2, argv + 2);
  if (strcmp(cmd, "worker") == 0) return cmd_worker(argc - 2, argv + 2);
  return usage_error("unknown command '%s'", cmd);
}
