package main

// Text in and out: libpipe's tokenizer (pipe.h's "Text", the Go binding's pipe.Tokenizer), which
// runs Hugging Face's own `tokenizers` library on the model folder's tokenizer.json and renders the
// folder's chat template with minijinja as transformers renders it. What this file adds is what
// the service needs around it:
//   - prompts are encoded as OpenAI's endpoints take them, without special tokens added around
//     them; special tokens written in the text (a client's "<|im_end|>", or the chat template's)
//     become their ids, as transformers' encode does. Hugging Face's matching of added tokens
//     takes time linear in the text.
//   - streaming: a textStream feeds a sequence's tokens to a decode stream (constant work per
//     token: it decodes a window of the last few ids, never the whole reply) and flushes it at the
//     end for what it still held back (a character left incomplete, as U+FFFD).
//   - ids the tokenizer does not know (a model's vocabulary may be larger than its tokenizer's) have
//     no text: the service never fails a reply over them.
//
// Nothing here takes a lock that another request waits for: the tokenizer is immutable and its
// calls run at once from any number of goroutines (the binding's read lock only keeps Close out),
// and each stream has its own decode stream.

import (
	"errors"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// textCodec turns text into token ids and back. It is safe for concurrent use.
type textCodec struct {
	tk    *pipe.Tokenizer
	vocab int64
	// noChat says why the folder's chat template cannot be used (there is none, or it does not
	// compile); nil: chat templates render.
	noChat error
}

// errTooManyTokens is EncodeAtMost's answer for a text of more tokens than it was allowed.
var errTooManyTokens = errors.New("more tokens than allowed")

// loadText loads the tokenizer and chat template of a Hugging Face model folder.
func loadText(modelDir string) (*textCodec, error) {
	tk, err := pipe.LoadTokenizer(modelDir)
	if err != nil {
		return nil, err
	}
	c := &textCodec{tk: tk, vocab: tk.VocabSize()}
	// An empty conversation tells whether the folder has a template that compiles
	// (ErrInvalidFormat: it has none, or it does not compile). A template that raises for an
	// empty conversation (ErrInvalidArgument) is there all the same.
	if _, err := tk.ApplyChatTemplate(nil, true); errors.Is(err, pipe.ErrInvalidFormat) {
		c.noChat = errors.New(message(err))
	}
	return c, nil
}

// Close frees the tokenizer (streams made from it stay usable).
func (c *textCodec) Close() { c.tk.Close() }

// StopIDs are the ids that end a generation: generation_config.json's eos_token_id (else
// config.json's) and the tokenizer's end token, which is also the chat template's end of a turn.
func (c *textCodec) StopIDs() []int64 { return c.tk.StopIDs() }

// Encode is the token ids of text, without special tokens added around it (as OpenAI's
// completions take the prompt as it is); special tokens written in it become their ids.
func (c *textCodec) Encode(text string) ([]int64, error) { return c.EncodeAtMost(text, 0) }

// EncodeAtMost is Encode, failing with errTooManyTokens when the text has more than limit tokens
// (limit 0: no limit). The time it takes is linear in the length of the text (at most the body
// limit's 4 MiB).
func (c *textCodec) EncodeAtMost(text string, limit int) ([]int64, error) {
	ids, err := c.tk.Encode(text, false)
	if err != nil {
		return nil, errors.New(message(err))
	}
	if limit > 0 && len(ids) > limit {
		return nil, errTooManyTokens
	}
	return ids, nil
}

// known is ids without those outside the tokenizer's vocabulary, which have no text.
func (c *textCodec) known(ids []int64) []int64 {
	for i, id := range ids {
		if id < 0 || id >= c.vocab {
			out := append([]int64(nil), ids[:i]...)
			for _, id := range ids[i+1:] {
				if id >= 0 && id < c.vocab {
					out = append(out, id)
				}
			}
			return out
		}
	}
	return ids
}

// Decode is the text of ids, special tokens left out (Hugging Face's decode with
// skip_special_tokens): bytes that form no character become U+FFFD.
func (c *textCodec) Decode(ids []int64) string {
	text, err := c.tk.Decode(c.known(ids), true)
	if err != nil {
		return ""
	}
	return text
}

// DecodeKeepingSpecial is the text of ids with special tokens kept (an echoed prompt of token
// ids, as vLLM decodes it).
func (c *textCodec) DecodeKeepingSpecial(ids []int64) string {
	text, err := c.tk.Decode(c.known(ids), false)
	if err != nil {
		return ""
	}
	return text
}

// TokenText is the text of one token alone, special tokens included (a log-probability's "token"):
// Hugging Face's decode([id]); a token that holds part of a character reads U+FFFD.
func (c *textCodec) TokenText(id int64) string {
	if id < 0 || id >= c.vocab {
		return ""
	}
	text, err := c.tk.Decode([]int64{id}, false)
	if err != nil {
		return ""
	}
	return text
}

// RenderChat is the prompt of a conversation through the model's chat template, ending where the
// assistant's reply begins (transformers' apply_chat_template with add_generation_prompt).
func (c *textCodec) RenderChat(messages []pipe.ChatMessage) (string, error) {
	if c.noChat != nil {
		return "", c.noChat
	}
	text, err := c.tk.ApplyChatTemplate(messages, true)
	if err != nil {
		return "", errors.New(message(err))
	}
	return text, nil
}

// textStream turns a sequence's tokens into text, piece by piece, whose concatenation is the
// text of all of them: a character cut over several tokens comes out once its last byte came, and
// what the decode stream still holds back at the end comes out of Flush.
// One goroutine at a time; Close it at the end.
type textStream struct {
	codec  *textCodec
	stream *pipe.DecodeStream // nil: the tokenizer was closed; each token then reads alone
}

func (c *textCodec) newStream() *textStream {
	s := &textStream{codec: c}
	s.stream, _ = c.tk.NewDecodeStream(true)
	return s
}

// Add takes the next token and returns the text it completes ("" while the held-back tokens end
// inside a character, or add no text).
func (s *textStream) Add(id int64) string {
	if id < 0 || id >= s.codec.vocab {
		return ""
	}
	if s.stream == nil {
		return s.codec.Decode([]int64{id})
	}
	piece, err := s.stream.Push(id)
	if err != nil {
		return ""
	}
	return piece
}

// Flush returns what Add held back at the end of the sequence (pipe_decode_stream_flush: a
// character left incomplete reads U+FFFD, as decoding the whole sequence gives it).
func (s *textStream) Flush() string {
	if s.stream == nil {
		return ""
	}
	text, err := s.stream.Flush()
	if err != nil {
		return ""
	}
	return text
}

// Close frees the decode stream.
func (s *textStream) Close() {
	if s.stream != nil {
		s.stream.Close()
	}
}
