package main

// Text in and out through the model's tokenizer.json, read by github.com/sugarme/tokenizer (pure
// Go: Hugging Face's `tokenizers` format, BPE with byte-level pre-tokenization as Llama-family
// models use, WordPiece, Unigram).
//
// Three things that library does not do, or does in a way a public service cannot afford, are
// done here:
//   - Added tokens written in the prompt ("<|im_start|>" of a chat template) are dropped by its
//     encoder when special; Hugging Face's matches them in the raw text first. Its own search for
//     added tokens is also quadratic in their number (it sorts the rest of the matches at each
//     one). So the prompt is cut here at every added token of tokenizer.json, in one pass of a
//     regular expression (Go's regexp runs in time linear in the text), each becomes its id, and
//     only the text between them goes through the library.
//   - Its BPE model caches every distinct word it has merged, of any length, up to 10,000 of
//     them: clients sending long, distinct words would grow the service's memory by hundreds of
//     megabytes. The cache is turned off; merging a prompt's words again costs little.
//   - Streaming text token by token is detokenize.go.
//
// Nothing here takes a lock: the library's Tokenizer only reads its vocabulary, merges and
// decoders while encoding and decoding (its BPE cache, the one thing it writes, has its own
// mutex and is off), so encodes and decodes of any number of requests run at once, and a long
// prompt being encoded never holds up the streams of others.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"

	"github.com/sugarme/tokenizer"
	"github.com/sugarme/tokenizer/model/bpe"
	"github.com/sugarme/tokenizer/pretrained"
)

// textCodec turns text into token ids and back. It is safe for concurrent use.
type textCodec struct {
	tk *tokenizer.Tokenizer
	// added matches the text of every added token, longest first, so that the longer of two that
	// start at the same place wins (Go's regexp prefers the earlier alternative); nil: none.
	added   *regexp.Regexp
	addedID map[string]int64
}

// errTooManyTokens is EncodeAtMost's answer for a text of more tokens than it was allowed.
var errTooManyTokens = errors.New("more tokens than allowed")

// loadTokenizer reads a tokenizer.json (Hugging Face's `tokenizers` format).
func loadTokenizer(path string) (*textCodec, error) {
	tk, err := pretrained.FromFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if m, ok := tk.GetModel().(*bpe.BPE); ok && m.Cache != nil {
		m.Cache.Capacity = 0 // nothing is stored once the cache is "full" (see above)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var file struct {
		AddedTokens []struct {
			ID      int64  `json:"id"`
			Content string `json:"content"`
		} `json:"added_tokens"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	c := &textCodec{tk: tk, addedID: map[string]int64{}}
	var contents []string
	for _, a := range file.AddedTokens {
		if _, seen := c.addedID[a.Content]; a.Content != "" && !seen {
			c.addedID[a.Content] = a.ID
			contents = append(contents, a.Content)
		}
	}
	if len(contents) > 0 {
		sort.SliceStable(contents, func(i, j int) bool { return len(contents[i]) > len(contents[j]) })
		quoted := make([]string, len(contents))
		for i, s := range contents {
			quoted[i] = regexp.QuoteMeta(s)
		}
		if c.added, err = regexp.Compile(strings.Join(quoted, "|")); err != nil {
			return nil, fmt.Errorf("%s: added tokens: %w", path, err)
		}
	}
	return c, nil
}

// Encode is the token ids of text, without special tokens added around it (as OpenAI's
// completions take the prompt as it is); added tokens written in it become their ids.
func (c *textCodec) Encode(text string) ([]int64, error) { return c.EncodeAtMost(text, 0) }

// EncodeAtMost is Encode, except that it gives up with errTooManyTokens once the text is known
// to have more than limit tokens (limit 0: no limit): a prompt that cannot fit the model is not
// worth encoding to its end. The time it takes is linear in the length of the text.
func (c *textCodec) EncodeAtMost(text string, limit int) (ids []int64, err error) {
	defer func() {
		// The library panics on text its vocabulary cannot cover (a BPE model without an unknown
		// token): for a server that is a bad prompt, not a crash.
		if r := recover(); r != nil {
			ids, err = nil, fmt.Errorf("%v", r)
		}
	}()
	for text != "" {
		at, end := len(text), len(text)
		if c.added != nil {
			if loc := c.added.FindStringIndex(text); loc != nil {
				at, end = loc[0], loc[1]
			}
		}
		if at > 0 {
			enc, err := c.tk.EncodeSingle(text[:at], false)
			if err != nil {
				return nil, err
			}
			for _, id := range enc.Ids {
				ids = append(ids, int64(id))
			}
		}
		if end > at {
			ids = append(ids, c.addedID[text[at:end]])
		}
		if limit > 0 && len(ids) > limit {
			return nil, errTooManyTokens
		}
		text = text[end:]
	}
	return ids, nil
}

// Decode is the text of ids, special tokens left out.
func (c *textCodec) Decode(ids []int64) (text string) {
	defer func() {
		// Some of the library's decoders panic on no text at all (its Strip indexes the first
		// character of the empty string that Fuse makes of no token): ids that are all special
		// tokens. Their text is "".
		if r := recover(); r != nil {
			text = ""
		}
	}()
	ints := make([]int, len(ids))
	for i, id := range ids {
		ints[i] = int(id)
	}
	return c.tk.Decode(ints, true)
}

// TokenText is the text of one token alone, special tokens included (a log-probability's "token"):
// a byte-level token that holds part of a character gives its bytes as they are.
func (c *textCodec) TokenText(id int64) (text string) {
	defer func() {
		if r := recover(); r != nil { // as Decode
			text = ""
		}
	}()
	return c.tk.Decode([]int{int(id)}, false)
}
