package main

// Echo (echo.go) against the reference: the prompt's text before the completion's; with logprobs,
// the prompt's tokens first in the logprobs object, null for the first, then each one's
// log-probability given those before it as transformers scores it (the log-softmax of its logits
// over the whole prompt), text offsets from the prompt's start; max_tokens 0 scores the prompt
// alone; streamed, the first chunk carries the prompt.

import (
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
)

// promptLogprobs is the reference's scores of a prompt's positions 1.. (tiny_decoder.expected.json's
// "prompt_logprobs", smollm2.json's).
type promptLogprobs struct {
	Logprob     []float64   `json:"logprob"`
	TopIDs      [][]int64   `json:"top_ids"`
	TopLogprobs [][]float64 `json:"top_logprobs"`
}

// echoCase is a prompt to echo, its tokens and their texts, the reference's scores of them, and its
// greedy continuation.
type echoCase struct {
	prompt      string
	promptIDs   []int64
	tokens      []string // each prompt id's text alone, special tokens kept
	ref         promptLogprobs
	maxTokens   int
	expectedIDs []int64
	// How far a log-probability may be from the reference's: the tiny decoder's are libpipe's
	// binding tests' 1e-4; SmolLM2's fp32 sums over 30 layers in another order one token a step
	// than transformers' forward over the whole prompt (2e-5 apart when written).
	tol float64
}

// tinyEcho is the tiny decoder's longest fixture prompt: transformers' scores of it are in the
// fixture; its greedy continuation holds no end of turn.
func tinyEcho(t *testing.T, e tinyExpected) echoCase {
	t.Helper()
	i := len(e.Prompts) - 1
	p := e.Prompts[i]
	if len(e.PromptLogprobs) != len(e.Prompts) || len(e.PromptLogprobs[i].Logprob) != len(p)-1 {
		t.Fatalf("tiny_decoder.expected.json has no prompt_logprobs of prompt %d (tests/models/decoder_models.py "+
			"writes them)", i)
	}
	if slices.Contains(p, tinyEndOfTurn) || slices.Contains(e.Greedy[i], tinyEndOfTurn) {
		t.Fatalf("tiny_decoder.expected.json's prompt %d or its continuation holds the end of turn %d", i, tinyEndOfTurn)
	}
	tokens := make([]string, len(p))
	for k, id := range p {
		tokens[k] = string(tinyRune(id))
	}
	return echoCase{tinyText(p), p, tokens, e.PromptLogprobs[i], e.MaxNewTokens, e.Greedy[i], 1e-4}
}

// echoLPs is the completions' logprobs object, nulls kept.
type echoLPs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []*float64           `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

type echoChoice struct {
	Text         string   `json:"text"`
	Logprobs     *echoLPs `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
}

type echoResponse struct {
	Choices []echoChoice `json:"choices"`
	Usage   *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

func checkEcho(t *testing.T, s *service, c completionCase) {
	e := c.echo
	n, k := len(e.promptIDs), 2
	completion := c.ref.decode(t, e.expectedIDs)
	if c.ref.tiny {
		completion = tinyText(e.expectedIDs)
	}

	// checkEntries checks the logprobs of the prompt and then of `generated` greedy tokens.
	checkEntries := func(what string, lp *echoLPs, generated []int64) {
		t.Helper()
		m := n + len(generated)
		if lp == nil || len(lp.Tokens) != m || len(lp.TokenLogprobs) != m || len(lp.TopLogprobs) != m ||
			len(lp.TextOffset) != m {
			t.Fatalf("%s: logprobs %+v, want %d prompt tokens and %d generated", what, lp, n, len(generated))
		}
		if lp.TokenLogprobs[0] != nil || lp.TopLogprobs[0] != nil {
			t.Fatalf("%s: the prompt's first token has %v, %v; want null, null", what, *lp.TokenLogprobs[0],
				lp.TopLogprobs[0])
		}
		offset := 0
		for i, tok := range lp.Tokens {
			var want string
			if i < n {
				want = e.tokens[i]
			} else {
				want = c.ref.token(t, generated[i-n])
			}
			if tok != jsonText(t, want) || lp.TextOffset[i] != offset {
				t.Fatalf("%s: token %d is %q at %d, want %q at %d", what, i, tok, lp.TextOffset[i], want, offset)
			}
			offset += len([]rune(tok))
			if i == 0 {
				continue
			}
			got, top := lp.TokenLogprobs[i], lp.TopLogprobs[i]
			if got == nil || top == nil || len(top) > k+1 || math.Abs(top[tok]-*got) > 1e-6 {
				t.Fatalf("%s: token %d %q: %v, alternatives %v", what, i, tok, got, top)
			}
			best := math.Inf(-1)
			for _, v := range top {
				best = max(best, v)
			}
			if i < n {
				// The prompt's token given those before it, and the likeliest there: transformers'.
				if math.Abs(*got-e.ref.Logprob[i-1]) > e.tol || math.Abs(best-e.ref.TopLogprobs[i-1][0]) > e.tol {
					t.Fatalf("%s: prompt token %d %q: %v (likeliest %v), transformers: %v (likeliest %v)", what, i,
						tok, *got, best, e.ref.Logprob[i-1], e.ref.TopLogprobs[i-1][0])
				}
			} else if best > *got+1e-6 {
				t.Fatalf("%s: token %d %q (%v) was greedy, yet %v is likelier", what, i, tok, *got, top)
			}
		}
	}
	post := func(what string, body map[string]any) echoChoice {
		t.Helper()
		var r echoResponse
		postJSON(t, s, "/v1/completions", body, &r)
		if len(r.Choices) != 1 || r.Choices[0].FinishReason == nil || r.Usage == nil {
			t.Fatalf("%s: %+v", what, r)
		}
		wantGenerated := len(e.expectedIDs)
		if body["max_tokens"] == 0 {
			wantGenerated = 0
		}
		if r.Usage.PromptTokens != n || r.Usage.CompletionTokens != wantGenerated {
			t.Fatalf("%s: usage %+v, want %d prompt tokens and %d completion tokens", what, *r.Usage, n, wantGenerated)
		}
		return r.Choices[0]
	}
	// stream joins a stream's chunks: the first must begin with the prompt.
	stream := func(what string, body map[string]any) echoChoice {
		t.Helper()
		body["stream"] = true
		defer delete(body, "stream")
		var joined echoChoice
		for i, data := range streamEvents(t, s, "/v1/completions", body) {
			var ev struct {
				Choices []echoChoice `json:"choices"`
			}
			if err := json.Unmarshal([]byte(data), &ev); err != nil || len(ev.Choices) != 1 {
				t.Fatalf("%s: event %q: %v", what, data, err)
			}
			ch := ev.Choices[0]
			if i == 0 && !strings.HasPrefix(ch.Text, e.prompt) {
				t.Fatalf("%s: the first chunk is %q, without the prompt %q", what, ch.Text, e.prompt)
			}
			joined.Text += ch.Text
			joined.FinishReason = ch.FinishReason
			if lp := ch.Logprobs; lp != nil {
				if joined.Logprobs == nil {
					joined.Logprobs = &echoLPs{}
				}
				j := joined.Logprobs
				j.Tokens = append(j.Tokens, lp.Tokens...)
				j.TokenLogprobs = append(j.TokenLogprobs, lp.TokenLogprobs...)
				j.TopLogprobs = append(j.TopLogprobs, lp.TopLogprobs...)
				j.TextOffset = append(j.TextOffset, lp.TextOffset...)
			}
		}
		return joined
	}

	// The prompt, then its greedy completion, each with its log-probabilities.
	body := map[string]any{"prompt": e.prompt, "max_tokens": e.maxTokens, "temperature": 0, "echo": true,
		"logprobs": k}
	finish := referenceFinish(e.expectedIDs, e.maxTokens)
	for _, got := range []echoChoice{post("echo", body), stream("echo, streamed", body)} {
		if got.Text != e.prompt+completion || got.FinishReason == nil || *got.FinishReason != finish {
			t.Fatalf("echo: %q (finish %v), want %q then %q", got.Text, got.FinishReason, e.prompt, completion)
		}
		checkEntries("echo", got.Logprobs, e.expectedIDs)
	}
	// max_tokens 0: the prompt scored alone (as lm-evaluation-harness asks), also as token ids.
	body["max_tokens"] = 0
	scored := post("echo, max_tokens 0", body)
	for what, got := range map[string]echoChoice{"echo, max_tokens 0": scored,
		"echo, max_tokens 0, streamed": stream("echo, max_tokens 0, streamed", body)} {
		if got.Text != e.prompt || got.FinishReason == nil || *got.FinishReason != "length" {
			t.Fatalf("%s: %q (finish %v), want %q and length", what, got.Text, got.FinishReason, e.prompt)
		}
		checkEntries(what, got.Logprobs, nil)
	}
	body["prompt"] = e.promptIDs
	if got := post("echo of token ids, max_tokens 0", body); got.Text != e.prompt {
		t.Fatalf("echo of token ids: %q, want %q", got.Text, e.prompt)
	} else {
		checkEntries("echo of token ids", got.Logprobs, nil)
	}
	lps := make([]float64, n-1)
	for i, lp := range scored.Logprobs.TokenLogprobs[1:] {
		lps[i] = *lp
	}
	t.Logf("%s: echo scored %d prompt tokens: %.4f", c.model, n, lps)

	// Echo without logprobs: the text only.
	body = map[string]any{"prompt": e.prompt, "max_tokens": e.maxTokens, "temperature": 0, "echo": true}
	if got := post("echo without logprobs", body); got.Text != e.prompt+completion || got.Logprobs != nil {
		t.Fatalf("echo without logprobs: %q, %+v", got.Text, got.Logprobs)
	}
	// max_tokens 0 without echo: nothing to give.
	data, _ := json.Marshal(e.prompt)
	prompt := string(data)
	expectBadRequest(t, s, "/v1/completions", "max_tokens 0 without echo",
		`{"max_tokens": 0, "prompt": `+prompt+`}`, "max_tokens")
	expectBadRequest(t, s, "/v1/completions", "max_tokens -1 with echo",
		`{"max_tokens": -1, "echo": true, "prompt": `+prompt+`}`, "max_tokens")
}
