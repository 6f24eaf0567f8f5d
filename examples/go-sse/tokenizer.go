package main

// Text in and out through the model's tokenizer.json, read by github.com/sugarme/tokenizer (pure
// Go: Hugging Face's `tokenizers` format, BPE with byte-level pre-tokenization as Llama-family
// models use, WordPiece, Unigram).
//
// Two things that library does not do are done here:
//   - Special tokens written in the prompt ("<|im_start|>" of a chat template) are dropped by its
//     encoder; Hugging Face's matches them in the raw text first. So the prompt is cut at every
//     special token of tokenizer.json's added_tokens, each becomes its id, and only the text
//     between them goes through the library.
//   - Streaming: one token may be part of a character (byte-level BPE splits UTF-8 sequences), so
//     text goes out only up to where the decoded ids form whole characters.

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/sugarme/tokenizer"
	"github.com/sugarme/tokenizer/pretrained"
)

// textCodec turns text into token ids and back.
type textCodec struct {
	mu      sync.Mutex // the library does not say that a Tokenizer may be used concurrently
	tk      *tokenizer.Tokenizer
	special []specialToken // longest first, so that a longer one wins where two start together
}

type specialToken struct {
	content string
	id      int64
}

// loadTokenizer reads a tokenizer.json (Hugging Face's `tokenizers` format).
func loadTokenizer(path string) (*textCodec, error) {
	tk, err := pretrained.FromFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var file struct {
		AddedTokens []struct {
			ID      int64  `json:"id"`
			Content string `json:"content"`
			Special bool   `json:"special"`
		} `json:"added_tokens"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	c := &textCodec{tk: tk}
	for _, a := range file.AddedTokens {
		if a.Special && a.Content != "" {
			c.special = append(c.special, specialToken{a.Content, a.ID})
		}
	}
	sort.SliceStable(c.special, func(i, j int) bool { return len(c.special[i].content) > len(c.special[j].content) })
	return c, nil
}

// Encode is the prompt's token ids, without special tokens added around it (as OpenAI's
// completions take the prompt as it is); special tokens written in it become their ids.
func (c *textCodec) Encode(text string) (ids []int64, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer func() {
		// The library panics on text its vocabulary cannot cover (a BPE model without an unknown
		// token): for a server that is a bad prompt, not a crash.
		if r := recover(); r != nil {
			ids, err = nil, fmt.Errorf("%v", r)
		}
	}()
	for text != "" {
		at, tok := c.nextSpecial(text)
		if at > 0 {
			enc, err := c.tk.EncodeSingle(text[:at], false)
			if err != nil {
				return nil, err
			}
			for _, id := range enc.Ids {
				ids = append(ids, int64(id))
			}
		}
		if tok == nil {
			break
		}
		ids = append(ids, tok.id)
		text = text[at+len(tok.content):]
	}
	return ids, nil
}

// nextSpecial is where the first special token in text starts (len(text) and nil if none).
func (c *textCodec) nextSpecial(text string) (int, *specialToken) {
	best, found := len(text), (*specialToken)(nil)
	for i := range c.special {
		if at := strings.Index(text, c.special[i].content); at >= 0 && at < best {
			best, found = at, &c.special[i]
		}
	}
	return best, found
}

// Decode is the text of ids, special tokens left out.
func (c *textCodec) Decode(ids []int64) string {
	ints := make([]int, len(ids))
	for i, id := range ids {
		ints[i] = int(id)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tk.Decode(ints, true)
}

// textStream turns a sequence's tokens, one at a time, into pieces of text whose concatenation is
// the text of all the tokens.
type textStream struct {
	codec *textCodec
	ids   []int64
	sent  string // the text given out so far
}

// Add takes the next token and returns the text it completes ("" while it ends inside a
// character). The whole sequence is decoded each time: how a token reads can depend on the ones
// before it (a leading space, a byte of a character), so decoding it alone is not enough.
func (s *textStream) Add(id int64) string {
	s.ids = append(s.ids, id)
	text := s.codec.Decode(s.ids)
	if !utf8.ValidString(text) || !strings.HasPrefix(text, s.sent) {
		return ""
	}
	piece := text[len(s.sent):]
	s.sent = text
	return piece
}

// Flush returns what Add held back at the end of the sequence (a character left incomplete shows
// as U+FFFD).
func (s *textStream) Flush() string {
	text := s.codec.Decode(s.ids)
	if !strings.HasPrefix(text, s.sent) {
		return ""
	}
	piece := strings.ToValidUTF8(text[len(s.sent):], "\uFFFD")
	s.sent = text
	return piece
}
