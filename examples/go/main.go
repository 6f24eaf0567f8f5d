// The Go version of examples/c: load a TorchScript model, cut it into 2 stages before
// blocks.2, run the inputs from a safetensors file through the pipeline as 4 micro-batches, and
// compare the result with the reference output the model generator wrote (eager PyTorch).
//
//	example_go MODEL.pt INPUTS.safetensors REFERENCE.safetensors
package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintf(os.Stderr, "usage: %s MODEL.pt INPUTS.safetensors REFERENCE.safetensors\n", os.Args[0])
		os.Exit(2)
	}
	ok, err := run(os.Args[1], os.Args[2], os.Args[3])
	if err != nil {
		// A *pipe.Error prints the failing call, libpipe's message and the status name.
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

func run(modelPath, inputsPath, referencePath string) (bool, error) {
	const microbatches = 4

	model, err := pipe.LoadModel(modelPath)
	if err != nil {
		return false, err
	}
	defer model.Close()
	plan, err := model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.2:begin"}})
	if err != nil {
		return false, err
	}
	defer plan.Close()
	session, err := plan.NewSession(&pipe.SessionOptions{Microbatches: microbatches})
	if err != nil {
		return false, err
	}
	defer session.Close()

	// Forward arguments in order, looked up by name in the input file.
	file, err := pipe.ReadSafetensors(inputsPath)
	if err != nil {
		return false, err
	}
	var inputs []*pipe.Tensor
	for _, name := range model.InputNames() {
		t := file.Get(name)
		if t == nil {
			return false, fmt.Errorf("%s has no tensor %q", inputsPath, name)
		}
		inputs = append(inputs, t)
	}

	// The context's deadline becomes the call's deadline; cancelling it cancels the call.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	outputs, err := session.Run(ctx, inputs...)
	if err != nil {
		return false, err
	}

	reference, err := pipe.ReadSafetensors(referencePath)
	if err != nil {
		return false, err
	}
	got, want := outputs.Get("output"), reference.Get("output")
	if got == nil || want == nil || got.DType() != pipe.Float32 || got.NumElements() != want.NumElements() {
		return false, fmt.Errorf("output %v does not match the reference %v", got, want)
	}
	a, b := got.Float32s(), want.Float32s()
	maxDiff := 0.0
	for i := range a {
		maxDiff = math.Max(maxDiff, math.Abs(float64(a[i])-float64(b[i])))
	}

	fmt.Printf("libpipe %s: %d stages, %d micro-batches, %d values, max |diff| vs PyTorch = %.3g\n",
		pipe.Version(), session.NumStages(), microbatches, len(a), maxDiff)
	ok := maxDiff <= 1e-4
	if ok {
		fmt.Println("output matches PyTorch")
	} else {
		fmt.Println("output DIFFERS from PyTorch")
	}
	return ok, nil
}
