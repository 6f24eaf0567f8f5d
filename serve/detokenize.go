package main

// Incremental detokenization: a sequence's tokens, one at a time, become pieces of text whose
// concatenation is the text of all of them, at a constant cost per token however long the reply.
//
// How a token reads can depend on the tokens before it: a byte-level BPE token may hold part of a
// character (its other bytes in the next tokens), a SentencePiece decoder drops the leading space
// of the text's first token, a byte-fallback decoder writes U+FFFD for bytes that do not form a
// character yet. So a token is never decoded alone, nor is the whole sequence decoded again: the
// stream keeps a small window, the tokens of the last piece it gave out (the context) followed by
// those not given out yet (pending), decodes it, and gives out what the pending tokens add to the
// context's text, once that is whole characters. The context always starts where an earlier
// piece began, so at a character boundary; it is what llama.cpp's and vLLM's incremental
// detokenizers, and Hugging Face's DecodeStream, keep too.

import (
	"strings"
	"unicode/utf8"
)

// maxPending bounds the tokens held back: a UTF-8 character spans at most 4 byte tokens, and a
// few skipped special tokens may come between. Beyond it the text is given out as it is, an
// unfinished character as U+FFFD: a model that generates invalid bytes must not grow the window.
const maxPending = 16

// textStream turns a sequence's tokens into text, piece by piece.
type textStream struct {
	codec       *textCodec
	window      []int64 // window[:context]: the tokens of the last piece given out; then the pending ones
	context     int
	contextText string // the text of window[:context] decoded alone
}

// Add takes the next token and returns the text it completes ("" while the pending tokens end
// inside a character, or add no text).
func (s *textStream) Add(id int64) string {
	s.window = append(s.window, id)
	piece, ok := strings.CutPrefix(s.codec.Decode(s.window), s.contextText)
	if ok && piece != "" && utf8.ValidString(piece) && !strings.HasSuffix(piece, "\uFFFD") {
		return s.give(piece)
	}
	if len(s.window)-s.context < maxPending {
		return ""
	}
	if !ok {
		// The context reads differently with the pending tokens after it (a decoder that
		// rewrites text across tokens): their own text is the best there is.
		piece = s.codec.Decode(s.window[s.context:])
	}
	return s.give(strings.ToValidUTF8(piece, "\uFFFD"))
}

// give returns piece, the text of the pending tokens, which become the context of the next.
func (s *textStream) give(piece string) string {
	n := copy(s.window, s.window[s.context:])
	s.window = s.window[:n]
	s.context = n
	s.contextText = s.codec.Decode(s.window)
	return piece
}

// Flush returns what Add held back at the end of the sequence (a character left incomplete shows
// as U+FFFD).
func (s *textStream) Flush() string {
	if len(s.window) == s.context {
		return ""
	}
	piece, ok := strings.CutPrefix(s.codec.Decode(s.window), s.contextText)
	if !ok {
		piece = s.codec.Decode(s.window[s.context:])
	}
	s.give("")
	return strings.ToValidUTF8(piece, "\uFFFD")
}
