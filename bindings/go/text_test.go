package pipe_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/libpipe/libpipe/bindings/go"
)

// The text of tests/models/text_tokenizers.py's C_TEXT and C_CHAT, whose ids and chat text by
// transformers that script writes beside each tokenizer folder.
const referenceText = "Hello, w\u00f6rld! \U0001f44b \u65e5\u672c"

var referenceChat = []pipe.ChatMessage{
	{"system", "Be brief."}, {"user", "Hi \U0001f44b"}, {"assistant", "Hello!"}, {"user", "Bye"},
}

func loadStyle(t *testing.T, style string) (*pipe.Tokenizer, string) {
	t.Helper()
	dir := decoderFixture(t, filepath.Join("text", style))
	tok, err := pipe.LoadTokenizer(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tok.Close() })
	return tok, dir
}

func TestTokenizerMatchesTransformers(t *testing.T) {
	for _, style := range []string{"gpt2", "qwen2", "llama", "mistral"} {
		tok, dir := loadStyle(t, style)
		raw, err := os.ReadFile(filepath.Join(dir, "c-reference-ids.txt"))
		if err != nil {
			t.Fatal(err)
		}
		var want []int64
		for _, f := range strings.Fields(string(raw)) {
			id, _ := strconv.ParseInt(f, 10, 64)
			want = append(want, id)
		}
		ids, err := tok.Encode(referenceText, true)
		if err != nil || len(ids) != len(want) {
			t.Fatalf("%s: Encode = %v, %v; transformers: %v", style, ids, err, want)
		}
		for i := range ids {
			if ids[i] != want[i] {
				t.Fatalf("%s: Encode = %v; transformers: %v", style, ids, want)
			}
		}
		plain, _ := tok.Encode(referenceText, false)
		if text, err := tok.Decode(plain, false); err != nil || text != referenceText {
			t.Fatalf("%s: Decode(Encode(x)) = %q, %v", style, text, err)
		}
		chat, err := tok.ApplyChatTemplate(referenceChat, false)
		wantChat, _ := os.ReadFile(filepath.Join(dir, "c-reference-chat.txt"))
		if err != nil || chat != string(wantChat) {
			t.Fatalf("%s: ApplyChatTemplate = %q, %v; transformers: %q", style, chat, err, wantChat)
		}
		// The stream's pieces are whole characters and add up to the decode.
		stream, err := tok.NewDecodeStream(false)
		if err != nil {
			t.Fatal(err)
		}
		var joined strings.Builder
		for _, id := range plain {
			piece, err := stream.Push(id)
			if err != nil || !utf8.ValidString(piece) {
				t.Fatalf("%s: Push(%d) = %q, %v", style, id, piece, err)
			}
			joined.WriteString(piece)
		}
		if tail, err := stream.Flush(); err != nil || tail != "" {
			t.Fatalf("%s: Flush after whole characters = %q, %v", style, tail, err)
		}
		stream.Close()
		if joined.String() != referenceText {
			t.Fatalf("%s: stream gave %q", style, joined.String())
		}
		if _, err := stream.Flush(); !errors.Is(err, pipe.ErrClosed) {
			t.Fatalf("%s: Flush after Close: %v", style, err)
		}
	}
}

// A reply cut inside a character: the pushes hold its bytes back, Flush gives them out as U+FFFD,
// and together they are the decode of the ids; the stream then goes on.
func TestDecodeStreamFlush(t *testing.T) {
	// U+1F980 is not in the tokenizers' training text: its bytes are tokens of their own.
	const text = "a 🦀 b"
	for _, style := range []string{"gpt2", "qwen2", "llama", "mistral"} {
		tok, _ := loadStyle(t, style)
		ids, err := tok.Encode(text, false)
		if err != nil {
			t.Fatal(err)
		}
		cut := -1 // the ids up to the emoji's last byte, without it
		for n := len(ids); n > 0; n-- {
			if d, _ := tok.Decode(ids[:n], false); strings.HasSuffix(d, "\uFFFD") {
				cut = n
				break
			}
		}
		if cut < 0 {
			t.Fatalf("%s: no prefix of %v ends inside the emoji", style, ids)
		}
		stream, err := tok.NewDecodeStream(false)
		if err != nil {
			t.Fatal(err)
		}
		var joined strings.Builder
		for _, id := range ids[:cut] {
			piece, err := stream.Push(id)
			if err != nil {
				t.Fatal(err)
			}
			joined.WriteString(piece)
		}
		tail, err := stream.Flush()
		if err != nil || !strings.HasSuffix(tail, "\uFFFD") {
			t.Fatalf("%s: Flush = %q, %v; want the cut character as U+FFFD", style, tail, err)
		}
		joined.WriteString(tail)
		if want, _ := tok.Decode(ids[:cut], false); joined.String() != want {
			t.Fatalf("%s: pushes and Flush gave %q; Decode gives %q", style, joined.String(), want)
		}
		if again, err := stream.Flush(); err != nil || again != "" {
			t.Fatalf("%s: a second Flush = %q, %v", style, again, err)
		}
		stream.Close()
	}
}

func TestTokenizerIdsAndErrors(t *testing.T) {
	tok, _ := loadStyle(t, "qwen2")
	ends, err := tok.Encode("<|im_end|><|endoftext|>", false)
	if err != nil || len(ends) != 2 {
		t.Fatalf("Encode of the special tokens = %v, %v", ends, err)
	}
	if bos, eos, pad := tok.SpecialIDs(); bos != -1 || eos != ends[0] || pad != ends[1] {
		t.Fatalf("SpecialIDs = %d %d %d, want -1 %d %d", bos, eos, pad, ends[0], ends[1])
	}
	if stop := tok.StopIDs(); len(stop) != 2 || stop[0] != ends[0] || stop[1] != ends[1] {
		t.Fatalf("StopIDs = %v, want %v", stop, ends)
	}
	if _, err := tok.Encode("caf\xc3", true); !errors.Is(err, pipe.ErrInvalidArgument) || !strings.Contains(err.Error(), "UTF-8") {
		t.Fatalf("Encode of invalid UTF-8: %v", err)
	}
	if _, err := tok.Decode([]int64{1, tok.VocabSize()}, false); !errors.Is(err, pipe.ErrInvalidArgument) {
		t.Fatalf("Decode out of the vocabulary: %v", err)
	}
	if _, err := tok.ApplyChatTemplate([]pipe.ChatMessage{{"user", "a\x00b"}}, true); !errors.Is(err, pipe.ErrInvalidArgument) {
		t.Fatalf("a NUL in a message: %v", err)
	}
	if _, err := pipe.LoadTokenizer(t.TempDir()); !errors.Is(err, pipe.ErrNotFound) {
		t.Fatalf("LoadTokenizer of an empty folder: %v", err)
	}
	// Concurrent use of one tokenizer: each goroutine's lent results are copied on its own thread.
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 100; i++ {
				ids, err := tok.Encode(referenceText, true)
				text, err2 := tok.Decode(ids, true)
				if err != nil || err2 != nil || text != referenceText {
					t.Errorf("concurrent round trip: %q, %v, %v", text, err, err2)
					return
				}
			}
		}()
	}
	wg.Wait()
	tok.Close()
	if _, err := tok.Encode("a", true); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("Encode after Close: %v", err)
	}
}
