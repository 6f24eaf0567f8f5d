// Chat with a language model from Go: text in and out through libpipe alone. The model folder's
// own tokenizer and chat template (libpipe reads tokenizer.json and tokenizer_config.json) turn
// the question into token ids; the decoder, cut into 2 pipeline stages, generates greedily until
// one of the model's stop ids; a decode stream prints the reply as its tokens arrive.
//
//	example_go_chat [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]
//
// MODEL_DIR is a Hugging Face model folder (tokenizer.json, tokenizer_config.json,
// generation_config.json, model.safetensors) holding decoder.pt, which
// `python -m libpipe.export_llm MODEL_DIR MODEL_DIR/decoder.pt --max-batch 1` writes.
// --prompt-ids first prints the prompt's token ids on a line of their own.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

func main() {
	maxNewTokens := flag.Int("max-new-tokens", 64, "tokens to generate at most")
	promptIDs := flag.Bool("prompt-ids", false, "print the prompt's token ids first")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: %s [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 || flag.NArg() > 2 {
		flag.Usage()
		os.Exit(2)
	}
	question := "What is the capital of France?"
	if flag.NArg() == 2 {
		question = flag.Arg(1)
	}
	if err := chat(flag.Arg(0), question, *maxNewTokens, *promptIDs); err != nil {
		// A *pipe.Error prints the failing call, libpipe's message and the status name.
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func chat(dir, question string, maxNewTokens int, printIDs bool) error {
	tokenizer, err := pipe.LoadTokenizer(dir)
	if err != nil {
		return err
	}
	defer tokenizer.Close()
	// The conversation through the model's chat template (SmolLM2's adds its default system
	// turn), encoded without added special tokens: the template writes them as text.
	text, err := tokenizer.ApplyChatTemplate([]pipe.ChatMessage{{Role: "user", Content: question}}, true)
	if err != nil {
		return err
	}
	prompt, err := tokenizer.Encode(text, false)
	if err != nil {
		return err
	}
	if printIDs {
		fmt.Println(strings.Trim(fmt.Sprint(prompt), "[]"))
	}

	// The decoder in 2 stages of equal layers; its weights are the checkpoint's, unchanged.
	model, err := pipe.LoadModel(filepath.Join(dir, "decoder.pt"))
	if err != nil {
		return err
	}
	defer model.Close()
	plan, err := model.NewPlan(&pipe.PlanOptions{Stages: 2, Policy: "uniform"})
	if err != nil {
		return err
	}
	defer plan.Close()
	weights := &pipe.StageOptions{Weights: filepath.Join(dir, "model.safetensors")}
	generator, err := plan.NewGenerator(&pipe.SessionOptions{Stage: weights}, nil)
	if err != nil {
		return err
	}
	defer generator.Close()

	// Greedy (the zero Temperature), ending at the model's stop ids (generation_config.json's eos).
	options := &pipe.GenerationOptions{MaxNewTokens: maxNewTokens, StopIDs: tokenizer.StopIDs()}
	generation, err := generator.Generate(context.Background(), prompt, options)
	if err != nil {
		return err
	}
	// Whole characters only (a token may end inside one), without <|im_end|>.
	stream, err := tokenizer.NewDecodeStream(true)
	if err != nil {
		return err
	}
	defer stream.Close()
	for token := range generation.Tokens() { // ids as they come
		piece, err := stream.Push(token)
		if err != nil {
			return err
		}
		fmt.Print(piece)
	}
	fmt.Println()
	return generation.Err() // nil after a stop id or the length limit
}
