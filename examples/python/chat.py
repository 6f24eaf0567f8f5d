"""Chat with a language model from Python: text in and out through libpipe alone. The model
folder's own tokenizer and chat template (libpipe reads tokenizer.json and tokenizer_config.json;
neither transformers nor the `tokenizers` package is needed) turn the question into token ids; the
decoder, cut into 2 pipeline stages, generates greedily until one of the model's stop ids; a
decode stream prints the reply as its tokens arrive.

    python chat.py [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]

MODEL_DIR is a Hugging Face model folder (tokenizer.json, tokenizer_config.json,
generation_config.json, model.safetensors) holding decoder.pt, which
`python -m libpipe.export_llm MODEL_DIR MODEL_DIR/decoder.pt --max-batch 1` writes.
--prompt-ids first prints the prompt's token ids on a line of their own.
"""

import argparse
from pathlib import Path

import libpipe
from libpipe.text import Tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-ids", action="store_true", help="print the prompt's token ids first")
    args = parser.parse_args()

    with Tokenizer.load(args.model_dir) as tokenizer:
        # The conversation through the model's chat template (SmolLM2's adds its default system
        # turn), encoded without added special tokens: the template writes them as text.
        conversation = [{"role": "user", "content": args.question}]
        prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        if args.prompt_ids:
            print(" ".join(map(str, prompt)))

        # The decoder in 2 stages of equal layers; its weights are the checkpoint's, unchanged.
        weights = args.model_dir / "model.safetensors"
        with libpipe.Generator(args.model_dir / "decoder.pt", stages=2, weights=weights) as generator:
            # Greedy (the default), ending at the model's stop ids (generation_config.json's eos).
            generation = generator.generate(prompt, max_new_tokens=args.max_new_tokens, stop_ids=tokenizer.stop_ids)
            # Whole characters only (a token may end inside one), without <|im_end|>.
            stream = tokenizer.decode_stream(skip_special_tokens=True)
            for token in generation:  # ids as they come
                print(stream.step(token), end="", flush=True)
            print()


if __name__ == "__main__":
    main()
