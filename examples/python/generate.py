"""Text generation with libpipe from Python: a Hugging Face causal LM folder (config.json,
model.safetensors, tokenizer.json) exported as a libpipe decoder skeleton, its layers pipelined
over two stages, answering chat prompts with the text streamed as it comes, then several prompts
at once on one asyncio loop (no thread per generation). The tokenizer and chat template are the
folder's own, run by libpipe (libpipe.text): no other tokenizer library.

    python generate.py HF_MODEL_DIR [--prompt TEXT ...] [--max-new-tokens N] [--stages N]

SmolLM2-135M-Instruct, which the repository's tests convert once per machine:

    python generate.py "$(python tests/models/smollm2.py)"
"""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import libpipe
from libpipe.export_llm import export_llm
from libpipe.text import Tokenizer

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 3?"]


def chat(tokenizer, question):
    """The prompt's ids: the model's chat template over one user message (encoded without added
    special tokens: the template writes them), or the text itself for a model without one."""
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
    except libpipe.InvalidFormatError:  # no chat template in the folder
        return tokenizer.encode(question)


async def answer_all(generator, tokenizer, stops, max_new_tokens):
    generations = [
        generator.generate(chat(tokenizer, q), max_new_tokens=max_new_tokens, stop_ids=stops, tokenizer=tokenizer)
        for q in QUESTIONS
    ]
    return await asyncio.gather(*generations)  # each `await` gives the whole text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a Hugging Face folder: config.json, model.safetensors, ...")
    parser.add_argument("--prompt", action="append", help="a question (repeatable); default: a few of ours")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()

    tokenizer = Tokenizer.load(args.model_dir)
    stops = tokenizer.stop_ids  # generation_config.json's eos_token_id and the tokenizer's eos
    with tempfile.TemporaryDirectory() as tmp:
        # The skeleton: code and cache placeholders, no weights (they come from the checkpoint).
        skeleton = Path(tmp) / "decoder.pt"
        export_llm(str(args.model_dir), str(skeleton), max_seq_len=512, max_batch=4)
        with libpipe.Generator(skeleton, stages=args.stages, weights=args.model_dir / "model.safetensors") as generator:
            print(f"libpipe {libpipe.version()}: {generator.session.num_stages} stages, {generator.info}")
            for question in args.prompt or QUESTIONS[:1]:
                print(f"\n> {question}\n", flush=True)
                generation = generator.generate(
                    chat(tokenizer, question), max_new_tokens=args.max_new_tokens, stop_ids=stops, tokenizer=tokenizer
                )
                for piece in generation:  # text as it comes
                    print(piece, end="", flush=True)
                print(f"\n[{generation.info.generated_tokens} tokens, {generation.finish_reason}]")

            print("\nSeveral questions at once:")
            answers = asyncio.run(answer_all(generator, tokenizer, stops, args.max_new_tokens))
            for question, answer in zip(QUESTIONS, answers):
                print(f"> {question}\n{answer.strip()}\n")
            stats = generator.stats()
            print(
                f"{stats['generated_tokens']} tokens at {stats['tokens_per_s']:.1f} tokens/s, time to first token "
                f"{stats['mean_time_to_first_token_ms']:.1f} ms, {stats['mean_rows_per_step']:.2f} sequences per step"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
