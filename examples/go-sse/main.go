// Command go-sse serves text completions from a language model over HTTP, with libpipe's
// generator underneath: the model is cut into pipeline stages, and the sequences of concurrent
// requests are batched into shared steps that stream through them. The API has the shape of
// OpenAI's /v1/completions and /v1/chat/completions, streaming with server-sent events (see
// server.go and chat.go).
//
//	go-sse -decoder DECODER.pt -model-dir HF_DIR [-split POINT,... | -stages N] [-addr HOST:PORT]
//	       [-max-queued N] [-name NAME]
//
// DECODER.pt follows libpipe's decoder contract (`python -m libpipe.export_llm HF_DIR
// DECODER.pt` writes one for Llama, Qwen2, Mistral and GPT-2 checkpoints). HF_DIR is the Hugging
// Face folder: tokenizer.json (required), model.safetensors or model.safetensors.index.json (the
// weights, when DECODER.pt holds none), generation_config.json (its eos_token_id ends a
// completion), chat_template.jinja or tokenizer_config.json (the chat template and its special
// tokens, for /v1/chat/completions). Once listening it prints "go-sse: listening on
// http://HOST:PORT" on stdout; -addr 127.0.0.1:0 picks a free port.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

func main() {
	decoder := flag.String("decoder", "", "the decoder (TorchScript, libpipe's decoder contract)")
	modelDir := flag.String("model-dir", "", "the Hugging Face folder: tokenizer.json, weights, generation_config.json")
	split := flag.String("split", "", "split points, comma-separated (e.g. model.layers.15:begin); default: -stages")
	stages := flag.Int("stages", 2, "stages, balanced by parameters, when -split is not given")
	addr := flag.String("addr", "127.0.0.1:8080", "where to listen (port 0: a free one)")
	maxQueued := flag.Int("max-queued", 0, "requests that may wait for a cache slot before 503 (0: 4 x slots)")
	name := flag.String("name", "", "the model's name in the API (default: the folder's name)")
	flag.Parse()
	if *decoder == "" || *modelDir == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: go-sse -decoder DECODER.pt -model-dir HF_DIR [flags]; -h lists the flags")
		os.Exit(2)
	}
	if *name == "" {
		*name = filepath.Base(filepath.Clean(*modelDir))
	}
	if err := run(*decoder, *modelDir, *split, *stages, *addr, *maxQueued, *name); err != nil {
		fmt.Fprintln(os.Stderr, "go-sse:", err)
		os.Exit(1)
	}
}

func run(decoder, modelDir, split string, stages int, addr string, maxQueued int, name string) error {
	text, err := loadTokenizer(filepath.Join(modelDir, "tokenizer.json"))
	if err != nil {
		return err
	}
	stopIDs, err := eosIDs(modelDir)
	if err != nil {
		return err
	}
	chat, err := loadChatTemplate(modelDir)
	if err != nil {
		return err
	}
	if chat == nil {
		log.Printf("%s has no chat template: /v1/chat/completions answers 400", modelDir)
	}
	gen, err := newGenerator(decoder, modelDir, split, stages, maxQueued)
	if err != nil {
		return err
	}
	defer gen.Close()
	info := gen.Info()
	log.Printf("%s: %d stages, %d slots of %d tokens (%.1f MiB of cache each), vocabulary %d",
		name, gen.NumStages(), info.Slots, info.MaxLen, float64(info.CacheBytesPerSlot)/(1<<20), info.Vocab)

	s := &server{gen: gen, text: text, model: name, stopIDs: stopIDs, chat: chat,
		chatStopIDs: endOfTurnIDs(text, chat, stopIDs)}
	// Signals are caught before the service says it listens: a SIGTERM right after the first
	// request must stop it gracefully, not kill it.
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	httpServer := &http.Server{Handler: s.routes(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("go-sse: listening on http://%s\n", listener.Addr())

	done := make(chan error, 1)
	go func() { done <- httpServer.Serve(listener) }()
	select {
	case err := <-done:
		return err
	case sig := <-signals:
		log.Printf("%v: finishing the requests in progress", sig)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := httpServer.Shutdown(ctx); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// newGenerator loads the decoder with the folder's weights (when it has some), cuts it and starts
// the generator.
func newGenerator(decoder, modelDir, split string, stages, maxQueued int) (*pipe.Generator, error) {
	model, err := pipe.LoadModel(decoder)
	if err != nil {
		return nil, err
	}
	defer model.Close()
	planOpts := &pipe.PlanOptions{Stages: stages, Policy: "params"}
	if split != "" {
		planOpts = &pipe.PlanOptions{SplitPoints: strings.Split(split, ",")}
	}
	plan, err := model.NewPlan(planOpts)
	if err != nil {
		return nil, err
	}
	defer plan.Close()
	var session *pipe.SessionOptions
	for _, weights := range []string{"model.safetensors", "model.safetensors.index.json"} {
		path := filepath.Join(modelDir, weights)
		if _, err := os.Stat(path); err == nil {
			session = &pipe.SessionOptions{Stage: &pipe.StageOptions{Weights: path}}
			break
		}
	}
	return plan.NewGenerator(session, &pipe.GeneratorOptions{MaxQueued: maxQueued})
}

// eosIDs is generation_config.json's eos_token_id (a number or a list), none without the file.
func eosIDs(modelDir string) ([]int64, error) {
	data, err := os.ReadFile(filepath.Join(modelDir, "generation_config.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var config struct {
		EOS json.RawMessage `json:"eos_token_id"`
	}
	if err := json.Unmarshal(data, &config); err != nil {
		return nil, fmt.Errorf("generation_config.json: %w", err)
	}
	if len(config.EOS) == 0 || string(config.EOS) == "null" {
		return nil, nil
	}
	var one int64
	if json.Unmarshal(config.EOS, &one) == nil {
		return []int64{one}, nil
	}
	var many []int64
	if err := json.Unmarshal(config.EOS, &many); err != nil {
		return nil, fmt.Errorf("generation_config.json: eos_token_id is neither a number nor a list: %s", config.EOS)
	}
	return many, nil
}
