package pipe_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// exportedFixture is the staged torch.export program exported/multi_mlp.pt2 (tests/bindings/
// stage.cmake copies it from the build's test models), or skips the test when it is not staged.
func exportedFixture(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("LIBPIPE_FIXTURES")
	if dir == "" {
		t.Fatal("LIBPIPE_FIXTURES is not set: point it at the directory holding demo.pt " +
			"(bindings/go/run-tests.sh does)")
	}
	path := filepath.Join(dir, "exported", "multi_mlp.pt2")
	if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
		t.Skipf("no exported fixture %s: the staged fixtures have no torch.export program "+
			"(tests/bindings/stage.cmake copies exported/multi_mlp.pt2 once the build makes it)", path)
	} else if err != nil {
		t.Fatalf("fixture: %v", err)
	}
	return path
}

func TestModelFormatTorchScript(t *testing.T) {
	model := must(pipe.LoadModel(fixture(t, "demo.pt")))(t)
	if got := model.Format(); got != pipe.ModelTorchScript {
		t.Fatalf("demo.pt: Format() = %v, want %v", got, pipe.ModelTorchScript)
	}
	model.Close()
	if got := model.Format(); got != pipe.ModelTorchScript {
		t.Fatalf("after Close: Format() = %v, want %v", got, pipe.ModelTorchScript)
	}

	// The content decides, not the name: a TorchScript archive called .pt2 is still TorchScript.
	data := must(os.ReadFile(fixture(t, "demo.pt")))(t)
	renamed := filepath.Join(t.TempDir(), "demo.pt2")
	if err := os.WriteFile(renamed, data, 0o644); err != nil {
		t.Fatal(err)
	}
	model = must(pipe.LoadModel(renamed))(t)
	defer model.Close()
	if got := model.Format(); got != pipe.ModelTorchScript {
		t.Fatalf("demo.pt saved as demo.pt2: Format() = %v, want %v", got, pipe.ModelTorchScript)
	}
}

func TestModelFormatExported(t *testing.T) {
	path := exportedFixture(t)
	model := must(pipe.LoadModel(path))(t)
	defer model.Close()
	if got := model.Format(); got != pipe.ModelExported {
		t.Fatalf("%s: Format() = %v, want %v", path, got, pipe.ModelExported)
	}
	if model.NumInputs() == 0 {
		t.Fatalf("%s: the exported program reports no inputs", path)
	}
}

func TestModelFormatString(t *testing.T) {
	for _, c := range []struct {
		f    pipe.ModelFormat
		want string
	}{
		{pipe.ModelTorchScript, "torchscript"},
		{pipe.ModelExported, "exported"},
		{pipe.ModelFormat(7), "ModelFormat(7)"},
	} {
		if got := c.f.String(); got != c.want {
			t.Errorf("ModelFormat(%d).String() = %q, want %q", int32(c.f), got, c.want)
		}
	}
	if pipe.ModelTorchScript == pipe.ModelExported {
		t.Fatal("ModelTorchScript and ModelExported are the same value")
	}
}
