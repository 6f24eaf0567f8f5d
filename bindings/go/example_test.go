package pipe_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// Load a model, cut it into two stages before blocks.2, and run one batch as 4 micro-batches.
// (Compiled, not run: it needs a model file.)
func Example() {
	model, err := pipe.LoadModel("demo.pt")
	if err != nil {
		log.Fatal(err) // e.g. pipe: pipe_model_load: cannot open model file 'demo.pt' (PIPE_ERR_NOT_FOUND)
	}
	defer model.Close()
	plan, err := model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.2:begin"}})
	if err != nil {
		log.Fatal(err)
	}
	defer plan.Close()
	session, err := plan.NewSession(&pipe.SessionOptions{Microbatches: 4})
	if err != nil {
		log.Fatal(err)
	}
	defer session.Close()

	x, err := pipe.NewTensor(make([]float32, 32*256), 32, 256)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	outputs, err := session.Run(ctx, x)
	switch {
	case errors.Is(err, pipe.ErrDeadlineExceeded):
		log.Fatal("too slow: ", err)
	case err != nil:
		log.Fatal(err)
	}
	y := outputs.Get("output")
	fmt.Println(y.Shape(), y.Float32s()[:3])
}

// Start several calls at once and collect them: their micro-batches interleave in the stages.
func ExampleSession_Submit() {
	var session *pipe.Session // from Plan.NewSession
	var batches []*pipe.Tensor
	var requests []*pipe.Request
	for _, b := range batches {
		r, err := session.Submit(context.Background(), b)
		if err != nil {
			log.Fatal(err)
		}
		defer r.Close()
		requests = append(requests, r)
	}
	for _, r := range requests {
		out, err := r.Wait()
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(out.Names())
	}
}

// Wait for whichever of several calls finishes first, or for the caller's context, in one select:
// Done is closed when its call finishes, and no OS thread is held while the goroutine waits.
func ExampleRequest_Done() {
	var session *pipe.Session // from Plan.NewSession
	var ctx context.Context   // e.g. an HTTP request's context
	var a, b *pipe.Tensor
	ra, err := session.Submit(ctx, a)
	if err != nil {
		log.Fatal(err)
	}
	defer ra.Close()
	rb, err := session.Submit(ctx, b)
	if err != nil {
		log.Fatal(err)
	}
	defer rb.Close()
	select {
	case <-ra.Done():
		out, err := ra.Wait() // finished: returns at once
		fmt.Println("a first", out.Names(), err)
	case <-rb.Done():
		out, err := rb.Wait()
		fmt.Println("b first", out.Names(), err)
	case <-ctx.Done():
		// Both calls are cancelled by ctx too; Close frees them.
	}
}
