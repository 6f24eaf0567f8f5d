package main

// Log-probabilities of a completion's tokens, as OpenAI's APIs give them:
//
//	chat:        "logprobs": true, "top_logprobs": 0..20 → choices[].logprobs = {"content": [{"token",
//	             "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}
//	completions: "logprobs": 0..5 → choices[].logprobs = {"tokens", "token_logprobs",
//	             "top_logprobs": [{token: logprob, ...}], "text_offset"}; with "echo": true the
//	             prompt's tokens come first, the first with null (echo.go)
//
// libpipe gives each generated token's log-probability under the model's distribution (the
// log-softmax of its logits, before temperature and top_p) and the likeliest tokens there
// (pipe.GenerationOptions.Logprobs). A token's text is its own decoding through the tokenizer,
// special tokens included ("bytes" are its UTF-8 bytes: a byte-level token that holds part of a
// character shows U+FFFD in "token", its real bytes in "bytes"). Streamed chunks carry the entries
// of the tokens whose text they hold; tokens that added no text (still held back, or an end token)
// go with the next chunk that has text, or the last one.

import (
	"encoding/json"
	"unicode/utf8"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// Limits of the requests' fields, as OpenAI's.
const (
	maxChatTopLogprobs       = 20
	maxCompletionTopLogprobs = 5
)

// tokenLogprob is one generated (or echoed prompt) token: its id and what libpipe said of it;
// unscored: nothing (the prompt's first token, which nothing precedes: null in the completions'
// form).
type tokenLogprob struct {
	id       int64
	lp       pipe.TokenLogprobs
	unscored bool
}

// chatLogprobs reads the chat request's logprobs and top_logprobs into opts.
func chatLogprobs(logprobs *bool, top *int, opts *pipe.GenerationOptions) *badRequest {
	on := logprobs != nil && *logprobs
	if top != nil {
		if *top < 0 || *top > maxChatTopLogprobs {
			return bad("top_logprobs", "top_logprobs is %d; give 0 to %d", *top, maxChatTopLogprobs)
		}
		if *top > 0 && !on {
			return bad("top_logprobs", "top_logprobs is %d but logprobs is not true; set \"logprobs\": true as well",
				*top)
		}
	}
	if on {
		opts.Logprobs = true
		if top != nil {
			opts.TopLogprobs = *top
		}
	}
	return nil
}

// completionLogprobs reads the completion request's logprobs (null: none; 0..5: the sampled
// token's and this many alternatives) into opts.
func completionLogprobs(logprobs *int, opts *pipe.GenerationOptions) *badRequest {
	if logprobs == nil {
		return nil
	}
	if *logprobs < 0 || *logprobs > maxCompletionTopLogprobs {
		return bad("logprobs", "logprobs is %d; give 0 to %d (the alternatives per token), or null for none",
			*logprobs, maxCompletionTopLogprobs)
	}
	opts.Logprobs, opts.TopLogprobs = true, *logprobs
	return nil
}

// chatTokenLogprob is an entry of the chat API's logprobs.content, and of its top_logprobs.
type chatTokenLogprob struct {
	Token       string              `json:"token"`
	Logprob     float32             `json:"logprob"`
	Bytes       []int               `json:"bytes"`
	TopLogprobs *[]chatTokenLogprob `json:"top_logprobs,omitempty"`
}

// chatChoiceLogprobs is the chat API's choices[].logprobs.
type chatChoiceLogprobs struct {
	Content []chatTokenLogprob `json:"content"`
	Refusal []chatTokenLogprob `json:"refusal"`
}

// tokenBytes is text's bytes as the JSON array of numbers OpenAI's "bytes" is.
func tokenBytes(text string) []int {
	b := make([]int, len(text))
	for i := range len(text) {
		b[i] = int(text[i])
	}
	return b
}

// chatLogprobsOf is the chat API's logprobs of tokens.
func (s *server) chatLogprobsOf(tokens []tokenLogprob) *chatChoiceLogprobs {
	out := &chatChoiceLogprobs{Content: make([]chatTokenLogprob, len(tokens)), Refusal: nil}
	for i, t := range tokens {
		text := s.text.TokenText(t.id)
		top := make([]chatTokenLogprob, len(t.lp.Top))
		for j, alt := range t.lp.Top {
			alttext := s.text.TokenText(alt.ID)
			top[j] = chatTokenLogprob{Token: alttext, Logprob: alt.Logprob, Bytes: tokenBytes(alttext)}
		}
		out.Content[i] = chatTokenLogprob{Token: text, Logprob: t.lp.Logprob, Bytes: tokenBytes(text), TopLogprobs: &top}
	}
	return out
}

// completionChoiceLogprobs is the completions API's choices[].logprobs; an echoed prompt's first
// token has null in token_logprobs and top_logprobs.
type completionChoiceLogprobs struct {
	Tokens        []string          `json:"tokens"`
	TokenLogprobs []*float32        `json:"token_logprobs"`
	TopLogprobs   []orderedLogprobs `json:"top_logprobs"`
	TextOffset    []int             `json:"text_offset"`
}

// orderedLogprobs is a {token: logprob} object whose keys keep their order (the likeliest first,
// then the sampled token when it is not among them); a token whose text an earlier key has is
// left out. nil is null.
type orderedLogprobs []struct {
	token   string
	logprob float32
}

func (o orderedLogprobs) add(token string, logprob float32) orderedLogprobs {
	for _, e := range o {
		if e.token == token {
			return o
		}
	}
	return append(o, struct {
		token   string
		logprob float32
	}{token, logprob})
}

func (o orderedLogprobs) MarshalJSON() ([]byte, error) {
	if o == nil {
		return []byte("null"), nil
	}
	b := []byte{'{'}
	for i, e := range o {
		if i > 0 {
			b = append(b, ',')
		}
		k, err := json.Marshal(e.token)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(e.logprob)
		if err != nil {
			return nil, err
		}
		b = append(append(append(b, k...), ':'), v...)
	}
	return append(b, '}'), nil
}

// completionLogprobsOf is the completions API's logprobs of tokens; offset is the text_offset of
// the first (the characters of the tokens before it: the completion's, after the echoed prompt's),
// and the result's next.
func (s *server) completionLogprobsOf(tokens []tokenLogprob, offset *int) *completionChoiceLogprobs {
	out := &completionChoiceLogprobs{Tokens: make([]string, len(tokens)), TokenLogprobs: make([]*float32, len(tokens)),
		TopLogprobs: make([]orderedLogprobs, len(tokens)), TextOffset: make([]int, len(tokens))}
	for i, t := range tokens {
		text := s.text.TokenText(t.id)
		out.Tokens[i], out.TextOffset[i] = text, *offset
		*offset += utf8.RuneCountInString(text)
		if t.unscored {
			continue // null, null
		}
		lp := t.lp.Logprob
		out.TokenLogprobs[i] = &lp
		top := orderedLogprobs{}
		for _, alt := range t.lp.Top {
			top = top.add(s.text.TokenText(alt.ID), alt.Logprob)
		}
		out.TopLogprobs[i] = top.add(text, t.lp.Logprob) // the sampled token, always
	}
	return out
}
