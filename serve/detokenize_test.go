package main

// Streaming text (tokenizer.go's textStream over libpipe's decode stream) against the text itself
// and against decoding the whole sequence at once (Hugging Face's decode, which transformers runs),
// with tokenizers whose tokens split characters: byte-level BPE (GPT-2, Qwen2, Llama 3, SmolLM2),
// whose single-byte tokens and merges can cut a CJK character or an emoji anywhere, and
// SentencePiece's byte fallback (Llama 2, Mistral), whose decoder writes U+FFFD while a character's
// bytes are incomplete and drops the text's first space. After every token, what the stream gave
// and what it holds back (Flush's) is the decoding of the tokens so far: a reply cut anywhere (a
// length, a stop string) reads as decoding it whole does.

import (
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"
)

// detokenizeCorpus mixes ASCII, accents, CJK, emoji (one of them a ZWJ sequence, one with a
// variation selector) and runs of each.
var detokenizeCorpus = []string{
	"Hello, world!",
	"The capital of France is Paris.\n\nThe answer is: 2017",
	"café naïve résumé — Ærøskøbing",
	"中文 and 日本語のテキスト, 한국어 텍스트",
	"emoji 😀😃 and 👩‍👩‍👧 and ❤️ in a row: 🎉🎉🎉",
	"中中中😀é😀中",
	"mixed:世界😀x中é文🎉end",
}

// byteRunes is GPT-2's table from bytes to the characters byte-level BPE writes them as.
func byteRunes() [256]rune {
	var table [256]rune
	printable := func(b int) bool { return b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF }
	n := 0
	for b := 0; b < 256; b++ {
		if printable(b) {
			table[b] = rune(b)
		} else {
			table[b] = rune(256 + n)
			n++
		}
	}
	return table
}

// writeByteLevelTokenizer writes a byte-level BPE tokenizer.json into dir: one token per byte
// (ids 0..255), merges of the byte pairs given (ids from 256, in order), and the special added
// tokens given (ids after those); it returns dir.
func writeByteLevelTokenizer(t *testing.T, dir string, merges [][2]byte, specials []string) string {
	t.Helper()
	table := byteRunes()
	vocab := map[string]int{}
	for b := 0; b < 256; b++ {
		vocab[string(table[b])] = b
	}
	mergeList := []string{}
	for _, m := range merges {
		a, b := string(table[m[0]]), string(table[m[1]])
		mergeList = append(mergeList, a+" "+b)
		vocab[a+b] = len(vocab)
	}
	added := []any{}
	for _, s := range specials {
		id := len(vocab)
		vocab[s] = id
		added = append(added, map[string]any{"id": id, "content": s, "single_word": false, "lstrip": false,
			"rstrip": false, "normalized": false, "special": true})
	}
	byteLevel := map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
	tok := map[string]any{
		"version": "1.0", "truncation": nil, "padding": nil, "added_tokens": added,
		"normalizer": nil, "pre_tokenizer": byteLevel, "post_processor": nil, "decoder": byteLevel,
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": mergeList,
		},
	}
	writeJSONFile(t, filepath.Join(dir, "tokenizer.json"), tok)
	return dir
}

// straddlingMerges make tokens that end inside one character and begin inside the next: the end
// of 中 (E4 B8 AD) with the start of 文 (E6 96 87), the end of an emoji with the start of the next.
var straddlingMerges = [][2]byte{{0xAD, 0xE6}, {0xF0, 0x9F}, {0x98, 0x80}, {0x80, 0xF0}, {0xC3, 0xA9}, {0xA9, 0x20}}

// maxPending is how many ids a decode stream holds back at most (pipe_decode_stream_push: after
// 16 ids that complete no character, what they decode to goes out).
const maxPending = 16

// streamText is the text a textStream gives for ids, piece by piece, and its Flush at the end; it
// fails the test if a piece is not whole characters, the stream holds back more than maxPending
// tokens, or (checkPrefixes) what it gave and holds back after a token that ends a character is not
// the decoding of the tokens so far.
func streamText(t *testing.T, codec *textCodec, ids []int64, checkPrefixes bool) string {
	t.Helper()
	s := codec.newStream()
	defer s.Close()
	var out strings.Builder
	var held []int64 // the known ids pushed since the stream last gave text
	for i, id := range ids {
		piece := s.Add(id)
		if !utf8.ValidString(piece) {
			t.Fatalf("token %d gave %q, not whole characters", i, piece)
		}
		if id >= 0 && id < codec.vocab {
			if piece != "" || len(held)+1 >= maxPending {
				held = held[:0]
			} else {
				held = append(held, id)
			}
		}
		if len(held) >= maxPending {
			t.Fatalf("after token %d the stream holds back %d tokens: the work per token grows with the text", i,
				len(held))
		}
		out.WriteString(piece)
		// Where the tokens so far end inside a character, a byte-fallback decoder's whole decoding
		// makes U+FFFD of every byte of the run of byte tokens, characters already whole included
		// (Hugging Face's ByteFallback): there the stream is only checked at the end.
		if want := codec.Decode(ids[:i+1]); checkPrefixes && !strings.HasSuffix(want, "\uFFFD") {
			if got := out.String() + codec.Decode(held); got != want {
				t.Fatalf("after token %d of %v the stream gave %q and holds back %q; the %d tokens decode to %q", i, ids,
					out.String(), codec.Decode(held), i+1, want)
			}
		}
	}
	out.WriteString(s.Flush())
	if again := s.Flush(); again != "" {
		t.Fatalf("a second Flush gave %q", again)
	}
	return out.String()
}

func TestIncrementalDetokenizationEqualsFullDecoding(t *testing.T) {
	t.Run("ByteLevel", func(t *testing.T) {
		for _, merges := range [][][2]byte{nil, straddlingMerges} {
			codec := loadTextFolder(t, writeByteLevelTokenizer(t, t.TempDir(), merges, []string{imEnd}))
			checkCorpus(t, codec, imEnd, fmt.Sprintf("%d merges", len(merges)))
		}
	})
	t.Run("ByteFallback", func(t *testing.T) {
		codec, vocab := byteFallbackCodec(t)
		for _, text := range detokenizeCorpus {
			ids := byteFallbackIDs(vocab, text)
			if got := streamText(t, codec, ids, true); got != text {
				t.Fatalf("%q streamed as %q", text, got)
			}
		}
	})
	t.Run("Families", func(t *testing.T) {
		// Tokenizers trained and saved by transformers in the layouts of GPT-2, Qwen2, Llama 2
		// (byte fallback, a normalizer that writes the spaces) and Mistral (Metaspace):
		// tests/models/text_tokenizers.py, staged with the bindings' fixtures.
		for _, family := range []string{"gpt2", "qwen2", "llama", "mistral"} {
			codec := loadTextFolder(t, fixture(t, filepath.Join("text", family)))
			_, eos, _ := codec.tk.SpecialIDs()
			checkCorpus(t, codec, codec.TokenText(eos), family)
		}
	})
	t.Run("ModelTokenizer", func(t *testing.T) {
		// SmolLM2's tokenizer, when this machine has it (server_test.go's referenceCase).
		if c := os.Getenv("PIPE_SERVE_SMOLLM2"); c == "" || !fileExists(c) {
			t.Skip("no SmolLM2 on this machine (PIPE_SERVE_SMOLLM2)")
		}
		checkCorpus(t, loadTextFolder(t, referenceCase(t).modelDir), "<|im_end|>", "SmolLM2")
	})
	t.Run("InvalidBytesKeepTheWindowSmall", func(t *testing.T) {
		// Random bytes are rarely UTF-8: the stream must give them out as U+FFFD after a while,
		// never hold them all back.
		codec := loadTextFolder(t, writeByteLevelTokenizer(t, t.TempDir(), nil, nil))
		r := rand.New(rand.NewSource(1))
		ids := make([]int64, 1000)
		for i := range ids {
			ids[i] = int64(0x80 + r.Intn(0x40)) // continuation bytes: never a character
		}
		if got := streamText(t, codec, ids, true); !strings.Contains(got, "\uFFFD") || got != codec.Decode(ids) {
			t.Fatalf("continuation bytes streamed as %q, decoded as %q", got, codec.Decode(ids))
		}
	})
	t.Run("IdsOutsideTheVocabularyHaveNoText", func(t *testing.T) {
		// A model's vocabulary may be larger than its tokenizer's: such ids read as nothing.
		codec := loadTextFolder(t, writeByteLevelTokenizer(t, t.TempDir(), nil, nil))
		if got := streamText(t, codec, []int64{'a', 256, 0xE4, 0xB8, -1, 0xAD, 1 << 40, 'b'}, false); got != "a中b" {
			t.Fatalf("streamed as %q", got)
		}
	})
}

func loadTextFolder(t *testing.T, dir string) *textCodec {
	t.Helper()
	codec, err := loadText(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(codec.Close)
	return codec
}

// checkCorpus encodes each text of the corpus, alone and twice with the special token special
// between, and streams its ids back: the stream must be the text itself (alone) and decoding all
// the ids at once, as it must be after every token.
func checkCorpus(t *testing.T, codec *textCodec, special, what string) {
	t.Helper()
	split := 0
	for _, text := range detokenizeCorpus {
		for i, text := range []string{text, text + special + text} {
			ids, err := codec.Encode(text)
			if err != nil {
				t.Fatalf("%s: %q: %v", what, text, err)
			}
			got := streamText(t, codec, ids, true)
			if i == 0 && got != text {
				t.Fatalf("%s: %q streamed as %q", what, text, got)
			}
			if want := codec.Decode(ids); got != want {
				t.Fatalf("%s: %q: streamed %q, decoded %q", what, text, got, want)
			}
			for _, id := range ids {
				if strings.Contains(codec.TokenText(id), "\uFFFD") {
					split++
				}
			}
		}
	}
	if split == 0 {
		t.Fatalf("%s: no token of the corpus holds part of a character: the test tests nothing", what)
	}
	t.Logf("%s: %d tokens hold part of a character", what, split)
}

// byteFallbackCodec is a SentencePiece-style tokenizer.json (Llama 2's decoder: "▁" for spaces,
// <0xXX> tokens for bytes, the first space stripped) and its vocabulary.
func byteFallbackCodec(t *testing.T) (*textCodec, map[string]int) {
	t.Helper()
	vocab := map[string]int{"<unk>": 0, "<s>": 1, "</s>": 2}
	for b := 0; b < 256; b++ {
		vocab[fmt.Sprintf("<0x%02X>", b)] = len(vocab)
	}
	for _, w := range []string{"▁Hello", "▁world", "▁", "中", "é", "▁and", "a", "e", "t"} {
		vocab[w] = len(vocab)
	}
	tok := map[string]any{
		"version": "1.0", "truncation": nil, "padding": nil, "normalizer": nil, "pre_tokenizer": nil,
		"post_processor": nil,
		"added_tokens": []any{map[string]any{"id": 2, "content": "</s>", "single_word": false, "lstrip": false,
			"rstrip": false, "normalized": false, "special": true}},
		"decoder": map[string]any{"type": "Sequence", "decoders": []any{
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": "▁"}, "content": " "},
			map[string]any{"type": "ByteFallback"},
			map[string]any{"type": "Fuse"},
			map[string]any{"type": "Strip", "content": " ", "start": 1, "stop": 0},
		}},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": "<unk>", "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": true, "byte_fallback": true, "vocab": vocab, "merges": []any{},
		},
	}
	dir := t.TempDir()
	writeJSONFile(t, filepath.Join(dir, "tokenizer.json"), tok)
	return loadTextFolder(t, dir), vocab
}

// byteFallbackIDs is text as SentencePiece with byte fallback cuts it (greedily here: a word of the
// vocabulary when one starts at the place, else the character's bytes), with an end token </s>
// (skipped by decoding) after every emoji.
func byteFallbackIDs(vocab map[string]int, text string) []int64 {
	text = "▁" + strings.ReplaceAll(text, " ", "▁")
	var ids []int64
	for text != "" {
		best := ""
		for w := range vocab {
			if !strings.HasPrefix(w, "<") && strings.HasPrefix(text, w) && len(w) > len(best) {
				best = w
			}
		}
		if best != "" {
			ids = append(ids, int64(vocab[best]))
			text = text[len(best):]
			continue
		}
		_, n := utf8.DecodeRuneInString(text)
		for _, b := range []byte(text[:n]) {
			ids = append(ids, int64(vocab[fmt.Sprintf("<0x%02X>", b)]))
		}
		if n == 4 {
			ids = append(ids, int64(vocab["</s>"]))
		}
		text = text[n:]
	}
	return ids
}
