package main

// OpenAI's "echo" of /v1/completions (chat completions have none), as OpenAI and vLLM give it:
//
//   - The prompt's text goes before the completion's: in the whole text of a response; in a
//     stream, in the first chunk, before the completion's first piece (or in the last chunk when
//     the completion gives no text). The text is the request's own prompt string; a prompt of
//     token ids echoes as those ids decode, special tokens kept.
//   - With "logprobs": k, the logprobs object covers the prompt's tokens first: each one's text,
//     its log-probability given the tokens before it (null for the first, which nothing
//     precedes), its k likeliest alternatives and itself (null for the first), and text_offset
//     counting from the prompt's start; then the completion's tokens, their offsets going on from
//     there. libpipe scores the prompt when asked (pipe.GenerationOptions.PromptLogprobs): the
//     prompt then crosses the pipeline one token a step, and nothing of it comes from the cache,
//     so echo with logprobs costs a step per prompt token.
//   - "max_tokens": 0 with echo scores the prompt without completing it (how lm-evaluation-harness
//     asks for log-likelihoods). libpipe generates at least one token: the service generates one
//     and drops it, so the text is the prompt's, completion_tokens is 0 and finish_reason is
//     "length" (/metrics counts the dropped token as generated: it was). Without echo,
//     max_tokens 0 is refused (400).

import pipe "github.com/libpipe/libpipe/bindings/go"

// echo is a completion request's echoed prompt.
type echo struct {
	text string  // the prompt's text
	ids  []int64 // its tokens
	// scored: the prompt's log-probabilities go before the completion's (logprobs with echo).
	scored bool
	sent   bool // a chunk carried it (streaming)
}

// newEcho is the echo of a prompt of ids whose text the request gave ("": token ids were given),
// asking libpipe to score the prompt when the completion has log-probabilities.
func (s *server) newEcho(ids []int64, text string, opts *pipe.GenerationOptions) *echo {
	if text == "" {
		text = s.text.DecodeKeepingSpecial(ids)
	}
	opts.PromptLogprobs = opts.Logprobs
	return &echo{text: text, ids: ids, scored: opts.Logprobs}
}

// entries is the prompt's tokens with what libpipe said of each (scores indexed by position, as
// pipe.Generation.PromptLogprobs gives them): the first, or any libpipe did not score, unscored.
func (e *echo) entries(scores []pipe.TokenLogprobs) []tokenLogprob {
	out := make([]tokenLogprob, len(e.ids))
	for i, id := range e.ids {
		out[i] = tokenLogprob{id: id, unscored: i == 0 || i >= len(scores)}
		if !out[i].unscored {
			out[i].lp = scores[i]
		}
	}
	return out
}

// prepend puts the prompt before a stream's first chunk: its text before piece and, when scored,
// its entries before lps. Later chunks (and a nil echo) pass through.
func (e *echo) prepend(gen *pipe.Generation, piece string, lps []tokenLogprob) (string, []tokenLogprob) {
	if e == nil || e.sent {
		return piece, lps
	}
	e.sent = true
	if e.scored {
		lps = append(e.entries(gen.PromptLogprobs()), lps...)
	}
	return e.text + piece, lps
}
