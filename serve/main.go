// Command pipe-serve serves text completions from a language model over HTTP, with libpipe's
// generator underneath: the model is cut into pipeline stages, and the sequences of concurrent
// requests are batched into shared steps that stream through them. The API has the shape of
// OpenAI's /v1/completions and /v1/chat/completions, streaming with server-sent events (see
// server.go and chat.go); /metrics is Prometheus' (metrics.go).
//
//	pipe-serve -decoder DECODER.pt -model-dir HF_DIR [-split POINT,... | -stages N] [-processes N]
//	           [-addr HOST:PORT] [-max-queued N] [-name NAME] [-api-key KEY | -api-key-file FILE] [-metrics-public]
//	           [-read-header-timeout D] [-read-timeout D] [-write-timeout D] [-idle-timeout D]
//	           [-queue-timeout D] [-max-conns N]
//
// (-flag and --flag are the same; --help lists the flags, one line each, on stdout.)
//
// DECODER.pt follows libpipe's decoder contract (`python -m libpipe.export_llm HF_DIR
// DECODER.pt` writes one for Llama, Qwen2, Mistral and GPT-2 checkpoints). HF_DIR is the Hugging
// Face folder: tokenizer.json (required), model.safetensors or model.safetensors.index.json (the
// weights, when DECODER.pt holds none), generation_config.json or config.json (its eos_token_id
// ends a reply, as does tokenizer_config.json's eos_token), chat_template.jinja or
// tokenizer_config.json (the chat template and its special tokens, for /v1/chat/completions): all
// read by libpipe's tokenizer (tokenizer.go). Once listening it prints "pipe-serve: listening on
// http://HOST:PORT" on stdout; -addr 127.0.0.1:0 picks a free port. It listens on the loopback
// unless told otherwise; the timeouts, the connection limit and the API key (limits.go, auth.go)
// are what make it safe to expose further. With -processes N the later stages run in worker
// processes it starts (workers.go), and a worker that dies is a fault the service answers and
// recovers from (faults.go); it exits non-zero only when it cannot recover, for its supervisor to
// start it again.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// config is what the flags say.
type config struct {
	decoder, modelDir, split, addr, name string
	stages, maxQueued, processes         int
	limits                               limits
	queueTimeout                         time.Duration
	apiKey                               string
	metricsPublic                        bool
}

func main() {
	if spec, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(serveAsWorker(spec)) // a worker process this service started (workers.go)
	}
	var c config
	flags := flag.NewFlagSet("pipe-serve", flag.ContinueOnError)
	// One line each in --help (printUsage): a backquoted word names the value.
	flags.StringVar(&c.decoder, "decoder", "", "the decoder, `DECODER.pt` (libpipe's decoder contract); required")
	flags.StringVar(&c.modelDir, "model-dir", "", "the Hugging Face folder, `HF_DIR` (tokenizer, weights); required")
	flags.StringVar(&c.split, "split", "", "split `POINTS`, comma-separated (e.g. model.layers.15:begin)")
	flags.IntVar(&c.stages, "stages", 2, "stages of equal parameter size, without -split")
	flags.IntVar(&c.processes, "processes", 1,
		"processes running the stages: `N` > 1 runs the later ones in N-1 workers, restarted if one dies")
	flags.StringVar(&c.addr, "addr", "127.0.0.1:8080", "where to listen, `HOST:PORT`; port 0: a free one")
	flags.IntVar(&c.maxQueued, "max-queued", 0, "requests that may wait for a cache slot, more get 503; 0: 4 x slots")
	flags.StringVar(&c.name, "name", "", "the model's `NAME` in the API (default: the folder's name)")
	apiKey := flags.String("api-key", "", "the `KEY` clients send as \"Authorization: Bearer KEY\"; default none")
	apiKeyFile := flags.String("api-key-file", "", "a `FILE` holding the key (unlike -api-key, not shown by ps)")
	flags.BoolVar(&c.metricsPublic, "metrics-public", false, "serve /metrics without the API key")
	flags.DurationVar(&c.limits.readHeader, "read-header-timeout", 10*time.Second,
		"the most a request's headers may take; 0: no limit")
	flags.DurationVar(&c.limits.read, "read-timeout", 30*time.Second,
		"the most a request's body may take after its headers, else 408; 0: no limit")
	flags.DurationVar(&c.limits.write, "write-timeout", 30*time.Second,
		"the most a client may take to accept a write, else cut off; 0: no limit")
	flags.DurationVar(&c.limits.idle, "idle-timeout", 60*time.Second,
		"the most a kept-alive connection idles between requests; 0: no limit")
	flags.DurationVar(&c.queueTimeout, "queue-timeout", 30*time.Second,
		"the most a request waits for a cache slot, else 503; 0: no limit")
	flags.IntVar(&c.limits.maxConns, "max-conns", 256, "connections served at once, more wait; 0: no limit")
	flags.SetOutput(io.Discard) // the errors are printed below, with a hint rather than the whole list
	switch err := flags.Parse(os.Args[1:]); {
	case errors.Is(err, flag.ErrHelp):
		printUsage(os.Stdout, flags)
		os.Exit(0)
	case err != nil:
		fmt.Fprintf(os.Stderr, "pipe-serve: %v; --help lists the flags\n", err)
		os.Exit(2)
	}
	if c.decoder == "" || c.modelDir == "" || flags.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: pipe-serve -decoder DECODER.pt -model-dir HF_DIR [flags]; --help lists the flags")
		os.Exit(2)
	}
	if c.processes < 1 {
		fmt.Fprintf(os.Stderr, "pipe-serve: -processes is %d; give 1 (every stage here) or more\n", c.processes)
		os.Exit(2)
	}
	if c.name == "" {
		c.name = filepath.Base(filepath.Clean(c.modelDir))
	}
	var err error
	if c.apiKey, err = loadAPIKey(*apiKey, *apiKeyFile); err != nil {
		fmt.Fprintln(os.Stderr, "pipe-serve:", err)
		os.Exit(2)
	}
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "pipe-serve:", err)
		os.Exit(1)
	}
}

// printUsage lists the flags, one line each (flag.PrintDefaults takes two), with their defaults.
func printUsage(out io.Writer, flags *flag.FlagSet) {
	fmt.Fprint(out, `pipe-serve: serves a language model over HTTP through libpipe's generator, with OpenAI's
completions and chat completions API (streaming as server-sent events) and Prometheus' /metrics.

usage: pipe-serve -decoder DECODER.pt -model-dir HF_DIR [flags]

flags (-flag and --flag alike):
`)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	flags.VisitAll(func(f *flag.Flag) {
		name, help := flag.UnquoteUsage(f)
		switch f.DefValue {
		case "", "0", "false", "0s":
		default:
			help += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(tw, "  -%s %s\t%s\n", f.Name, name, help)
	})
	tw.Flush()
}

func run(c config) error {
	text, err := loadText(c.modelDir)
	if err != nil {
		return err
	}
	defer text.Close() // last: after the HTTP server and the pipeline have finished
	if text.noChat != nil {
		log.Printf("%v: /v1/chat/completions answers 400", text.noChat)
	}
	source, err := newGeneratorSource(c)
	if err != nil {
		return err
	}
	first, err := source.build()
	if err != nil {
		source.close()
		return err
	}
	// Only a pipeline over worker processes can be rebuilt: it keeps the plan for that.
	var rebuild func() (*backend, error)
	if c.processes > 1 {
		rebuild = source.build
		defer source.close()
	} else {
		source.close()
	}
	p := newPipeline(first, rebuild)
	defer p.Close() // after the HTTP server has finished its requests
	info := first.gen.Info()
	log.Printf("%s: %d stages over %d process(es), %d slots of %d tokens (%.1f MiB of cache each), vocabulary %d",
		c.name, first.gen.NumStages(), c.processes, info.Slots, info.MaxLen, float64(info.CacheBytesPerSlot)/(1<<20),
		info.Vocab)

	s := &server{pipeline: p, info: info, stages: first.gen.NumStages(), text: text, model: c.name,
		stopIDs: text.StopIDs(), queueTimeout: c.queueTimeout}
	if c.apiKey == "" {
		log.Printf("no API key (-api-key, -api-key-file): anyone who can reach %s may use the service", c.addr)
	}
	// Signals are caught before the service says it listens: a SIGTERM right after the first
	// request must stop it gracefully, not kill it.
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	listener, err := c.limits.listen(c.addr)
	if err != nil {
		return err
	}
	httpServer := c.limits.httpServer(s.handler(newAPIKey(c.apiKey, c.metricsPublic)))
	fmt.Printf("pipe-serve: listening on http://%s\n", listener.Addr())

	done := make(chan error, 1)
	go func() { done <- httpServer.Serve(listener) }()
	grace := 30 * time.Second
	var failure error
	select {
	case err := <-done:
		return err
	case sig := <-signals:
		log.Printf("%v: finishing the requests in progress", sig)
	case failure = <-p.Failed():
		// Every request of the broken pipeline has been failed already (faults.go): what is left
		// to finish are responses being written.
		log.Print(failure)
		grace = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := httpServer.Shutdown(ctx); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return failure
}

// newGeneratorSource loads the decoder and cuts it; its generators load the folder's weights
// (when it has some). With -processes N > 1 libpipe's log goes through Go's, where the store's
// address is picked up for the workers (workers.go).
func newGeneratorSource(c config) (*generatorSource, error) {
	model, err := pipe.LoadModel(c.decoder)
	if err != nil {
		return nil, err
	}
	defer model.Close() // the plan keeps what it needs
	planOpts := &pipe.PlanOptions{Stages: c.stages, Policy: "params"}
	if c.split != "" {
		planOpts = &pipe.PlanOptions{SplitPoints: strings.Split(c.split, ",")}
	}
	plan, err := model.NewPlan(planOpts)
	if err != nil {
		return nil, err
	}
	g := &generatorSource{plan: plan, options: pipe.GeneratorOptions{MaxQueued: c.maxQueued}, processes: c.processes}
	for _, weights := range []string{"model.safetensors", "model.safetensors.index.json"} {
		path := filepath.Join(c.modelDir, weights)
		if _, err := os.Stat(path); err == nil {
			g.session.Stage = &pipe.StageOptions{Weights: path}
			break
		}
	}
	if c.processes > 1 {
		if err := routeLibpipeLog(); err != nil {
			plan.Close()
			return nil, err
		}
	}
	return g, nil
}
