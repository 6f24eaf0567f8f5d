package main

// The service as a client sees it: the pipe-serve binary (PIPE_SERVE_BIN, the one installed at
// run.sh's PREFIX) is started on a free port and queried with net/http.
//
// The completion test serves SmolLM2-135M-Instruct (PIPE_SERVE_SMOLLM2 names the description
// testdata/smollm2.py wrote: the exported decoder and transformers' greedy continuation of a
// prompt). Where there is none (run.sh then reports the test SKIPPED, whatever passed), it serves
// the tiny decoder fixture with a tokenizer.json written here (one character per token id), whose
// greedy continuations transformers computed (tiny_decoder.expected.json). Either way the streamed
// text must be the reference's text: transformers' tokenizer's decoding of the reference's tokens
// (testdata/smollm2.py writes it), or the tiny tokenizer's one character per token. The same service answers the
// chat, stop-string, client and metrics checks (chat_test.go, clients_test.go, metrics_test.go): SmolLM2's chat reference is transformers' greedy reply to a
// conversation rendered by apply_chat_template; the tiny model's folder gets a chat template
// (tinyChatModelDir) under which a conversation renders as one of the fixture's prompts.
//
// Busy (503) and disconnect tests run on the gated decoder (same weights, a test gate between its
// layers that holds the prefill step of a prompt whose first token is 119 + key until the test
// opens the key), so that "every slot is taken" and "the client left while its sequence was in
// the pipeline" are states the test has seen, not guesses about timing. The service process loads
// the gate's operator library through LD_PRELOAD and finds its gate folder in
// LIBPIPE_TEST_GATE_DIR.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// waitLimit bounds every wait for something the test has made sure will happen: it only ends a
// hung test, it never decides a verdict.
const waitLimit = 300 * time.Second

// until returns once cond holds, failing the test after waitLimit.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	giveUp := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(giveUp) {
			t.Fatalf("gave up after %v waiting for %s", waitLimit, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func fixture(t *testing.T, name string) string {
	t.Helper()
	for _, env := range []string{"LIBPIPE_FIXTURES", "PIPE_TEST_MODELS"} {
		if dir := os.Getenv(env); dir != "" {
			if path := filepath.Join(dir, name); fileExists(path) {
				return path
			}
		}
	}
	t.Fatalf("%s is in neither LIBPIPE_FIXTURES nor PIPE_TEST_MODELS (run.sh sets them)", name)
	return ""
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// ---- the tiny decoder and its one-character-per-token tokenizer ---------------------------------

// tinyRune is the character of token id i in the tiny tokenizer: Latin Extended-A letters, so
// that every id is one printable character (and no id is a control character or a space).
func tinyRune(id int64) rune { return rune(0x100 + id) }

func tinyText(ids []int64) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteRune(tinyRune(id))
	}
	return b.String()
}

// tinyModelDir is a model folder for the tiny decoders: only a tokenizer.json, in Hugging Face's
// format (a BPE model without merges over 128 one-character tokens, joined back by the Fuse
// decoder). No generation_config.json: no end token, so completions end by length.
func tinyModelDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tiny")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeTinyTokenizer(t, dir, nil)
	return dir
}

// writeTinyTokenizer writes the tiny tokenizer.json into dir, with the ids of specials as special
// added tokens (their text becomes their id in a prompt, and decoding leaves them out).
func writeTinyTokenizer(t *testing.T, dir string, specials []int64) {
	t.Helper()
	vocab := map[string]int64{}
	for id := int64(0); id < 128; id++ {
		vocab[string(tinyRune(id))] = id
	}
	added := []any{}
	for _, id := range specials {
		added = append(added, map[string]any{"id": id, "content": string(tinyRune(id)), "single_word": false,
			"lstrip": false, "rstrip": false, "normalized": false, "special": true})
	}
	tok := map[string]any{
		"version": "1.0", "truncation": nil, "padding": nil, "added_tokens": added,
		"normalizer": nil, "pre_tokenizer": nil, "post_processor": nil,
		"decoder": map[string]any{"type": "Fuse"},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []any{},
		},
	}
	writeJSONFile(t, filepath.Join(dir, "tokenizer.json"), tok)
}

func writeJSONFile(t *testing.T, path string, v any) {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// The tiny model's chat: a template that writes bos_token, then each message as a character for
// its role and its content, then a character that opens the reply; eos_token (a special token)
// ends a turn. tinyChat's conversation renders as fixture prompt tinyChatPrompt, so transformers'
// greedy continuation of that prompt, up to its first tinyEndOfTurn, is the reference reply.
const (
	tinyBOS        = 114
	tinyEndOfTurn  = 16
	tinyChatPrompt = 3
)

var tinyRoleIDs = map[string]int64{"system": 36, "user": 58, "assistant": 0}

const tinyReplyID = 9

// tinyChatModelDir is tinyModelDir with a chat template in chat_template.jinja and the special
// tokens in tokenizer_config.json.
func tinyChatModelDir(t *testing.T) string {
	t.Helper()
	dir := tinyModelDir(t)
	writeTinyTokenizer(t, dir, []int64{tinyEndOfTurn})
	role := func(name string) string { return string(tinyRune(tinyRoleIDs[name])) }
	template := "{{ bos_token }}{% for message in messages %}" +
		"{% if message['role'] == 'system' %}" + role("system") +
		"{% elif message['role'] == 'user' %}" + role("user") +
		"{% else %}" + role("assistant") + "{% endif %}" +
		"{{ message['content'] }}{% endfor %}" +
		"{% if add_generation_prompt %}" + string(tinyRune(tinyReplyID)) + "{% endif %}"
	if err := os.WriteFile(filepath.Join(dir, "chat_template.jinja"), []byte(template), 0o644); err != nil {
		t.Fatal(err)
	}
	writeJSONFile(t, filepath.Join(dir, "tokenizer_config.json"), map[string]any{
		"bos_token": string(tinyRune(tinyBOS)),
		"eos_token": map[string]any{"content": string(tinyRune(tinyEndOfTurn)), "special": true},
	})
	return dir
}

// tinyChat is the conversation whose rendering is fixture prompt tinyChatPrompt: bos, the system
// message, the user's, the reply's opening.
func tinyChat(t *testing.T, e tinyExpected) chatCase {
	t.Helper()
	p := e.Prompts[tinyChatPrompt]
	if len(p) != 20 || p[0] != tinyBOS || p[1] != tinyRoleIDs["system"] || p[7] != tinyRoleIDs["user"] ||
		p[19] != tinyReplyID {
		t.Fatalf("tiny_decoder.expected.json's prompt %d is not the tiny chat's rendering: %v", tinyChatPrompt, p)
	}
	greedy := e.Greedy[tinyChatPrompt]
	end := slices.Index(greedy, tinyEndOfTurn)
	if end < 1 || slices.Contains(p, tinyEndOfTurn) {
		t.Fatalf("the reference reply %v has no end of turn (%d) after its first token", greedy, tinyEndOfTurn)
	}
	return chatCase{
		messages: []map[string]any{
			{"role": "system", "content": tinyText(p[2:7])},
			{"role": "user", "content": tinyText(p[8:19])},
		},
		promptIDs:   p,
		maxTokens:   e.MaxNewTokens,
		expectedIDs: greedy[:end+1], // transformers' greedy search, stopped at the end of turn
	}
}

type tinyExpected struct {
	Prompts        [][]int64        `json:"prompts"`
	MaxNewTokens   int              `json:"max_new_tokens"`
	Greedy         [][]int64        `json:"greedy"`
	PromptLogprobs []promptLogprobs `json:"prompt_logprobs"`
}

func readTinyExpected(t *testing.T) tinyExpected {
	t.Helper()
	var e tinyExpected
	data, err := os.ReadFile(fixture(t, "tiny_decoder.expected.json"))
	if err == nil {
		err = json.Unmarshal(data, &e)
	}
	if err != nil || len(e.Prompts) < 2 || len(e.Greedy) != len(e.Prompts) {
		t.Fatalf("tiny_decoder.expected.json: %v (%d prompts, %d continuations)", err, len(e.Prompts), len(e.Greedy))
	}
	return e
}

// ---- the service process ------------------------------------------------------------------------

type service struct {
	base    string // http://HOST:PORT
	pid     int    // the service's process
	gateDir string // the gated service's gate folder
	stderr  *syncBuffer
}

// syncBuffer collects the service's log while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startService runs the binary with args on a free port of the loopback, and stops it when the
// test ends (after the cleanups registered later, such as opening gates, have run).
func startService(t *testing.T, env []string, args ...string) *service {
	t.Helper()
	bin := os.Getenv("PIPE_SERVE_BIN")
	if bin == "" {
		t.Fatal("PIPE_SERVE_BIN is not set: run.sh sets it to the installed pipe-serve")
	}
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	s := &service{stderr: &syncBuffer{}}
	cmd.Stderr = s.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s.pid = cmd.Process.Pid
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM) // graceful: the requests in progress finish
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("the service ended with %v; its log:\n%s", err, s.stderr.String())
			}
		case <-time.After(waitLimit):
			cmd.Process.Kill()
			t.Errorf("the service did not stop within %v; its log:\n%s", waitLimit, s.stderr.String())
		}
	})
	lines := make(chan string, 1)
	go func() {
		scanner := bufio.NewScanner(stdout)
		for scanner.Scan() {
			if after, ok := strings.CutPrefix(scanner.Text(), "pipe-serve: listening on "); ok {
				lines <- after
			}
		}
		io.Copy(io.Discard, stdout)
	}()
	select {
	case s.base = <-lines:
	case err := <-exited:
		t.Fatalf("the service exited (%v) before listening; its log:\n%s", err, s.stderr.String())
	case <-time.After(waitLimit):
		t.Fatalf("the service did not listen within %v; its log:\n%s", waitLimit, s.stderr.String())
	}
	return s
}

// gatedService is the gated decoder's service, with its own gate folder; maxQueued requests may
// wait for a slot before it answers 503.
func gatedService(t *testing.T, maxQueued int) *service {
	t.Helper()
	gateDir := t.TempDir()
	s := startService(t, []string{"LD_PRELOAD=" + fixture(t, "libpipe_test_gate.so"), "LIBPIPE_TEST_GATE_DIR=" + gateDir},
		"-decoder", fixture(t, "gated_decoder.pt"), "-model-dir", tinyModelDir(t), "-split", "model.layers.1:begin",
		"-max-queued", fmt.Sprint(maxQueued), "-name", "gated")
	s.gateDir = gateDir
	return s
}

// heldPrompt is a prompt the gated decoder holds at key's gate (its first token is 119 + key);
// the gate opens when the test ends, before the service stops.
func (s *service) heldPrompt(t *testing.T, key int64, rest []int64) string {
	t.Helper()
	t.Cleanup(func() { s.openGate(t, key) })
	return tinyText(append([]int64{119 + key}, rest...))
}

func (s *service) gateArrived(key int64) bool {
	entries, _ := os.ReadDir(s.gateDir)
	prefix := fmt.Sprintf("gate-%d.stage1.arrived.", key)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			return true
		}
	}
	return false
}

func (s *service) openGate(t *testing.T, key int64) {
	if err := os.WriteFile(filepath.Join(s.gateDir, fmt.Sprintf("gate-%d.open", key)), nil, 0o644); err != nil {
		t.Error(err)
	}
}

type health struct {
	Status       string `json:"status"`
	SlotsInUse   int    `json:"slots_in_use"`
	Queued       int    `json:"queued"`
	Requests     uint64 `json:"requests"`
	RejectedBusy uint64 `json:"rejected_busy"`
	Disconnects  uint64 `json:"client_disconnects"`
	// Writes that failed (a client that stopped reading, or left), requests past the queue deadline.
	WriteFailures uint64            `json:"write_failures"`
	QueueTimeouts uint64            `json:"queue_timeouts"`
	Rebuilds      uint64            `json:"pipeline_rebuilds"` // after a worker process died
	Finished      map[string]uint64 `json:"finished"`
}

func (s *service) health(t *testing.T) health {
	t.Helper()
	code, h := s.healthStatus(t)
	if code != http.StatusOK {
		t.Fatalf("/health: %d, %+v", code, h)
	}
	return h
}

// healthStatus is /health's status code and body, whatever the code.
func (s *service) healthStatus(t *testing.T) (int, health) {
	t.Helper()
	resp, err := http.Get(s.base + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatalf("/health: %d, %v", resp.StatusCode, err)
	}
	return resp.StatusCode, h
}

// ---- requests -----------------------------------------------------------------------------------

func post(ctx context.Context, s *service, body any) (*http.Response, error) {
	return postTo(ctx, s, "/v1/completions", body)
}

func postTo(ctx context.Context, s *service, path string, body any) (*http.Response, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+path, bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return http.DefaultClient.Do(req)
}

type chunk struct {
	Object  string `json:"object"`
	Choices []struct {
		Text         string  `json:"text"`
		Index        int     `json:"index"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// streamed reads a server-sent event stream to its end: the text of every event, the finish
// reason of the last, whether `data: [DONE]` closed it, and what it said about usage.
type streamed struct {
	pieces []string
	finish string
	done   bool
	usage  usageSeen
}

func readStream(t *testing.T, body io.Reader) streamed {
	t.Helper()
	var out streamed
	scanner := bufio.NewScanner(body)
	for scanner.Scan() {
		line := scanner.Text()
		if line == "" {
			continue // the blank line between events
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("not an event line: %q", line)
		}
		if out.done {
			t.Fatalf("an event after [DONE]: %q", line)
		}
		if data == "[DONE]" {
			out.done = true
			continue
		}
		if out.usage.add(t, data) {
			continue
		}
		var c chunk
		if err := json.Unmarshal([]byte(data), &c); err != nil || len(c.Choices) != 1 || c.Object != "text_completion" {
			t.Fatalf("event %q: %v", data, err)
		}
		if out.finish != "" {
			t.Fatalf("an event after the one with finish_reason %q: %q", out.finish, data)
		}
		if f := c.Choices[0].FinishReason; f != nil {
			out.finish = *f
		} else {
			out.pieces = append(out.pieces, c.Choices[0].Text)
		}
	}
	if err := scanner.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// completionCase is a prompt and the reference continuation the service must stream.
type completionCase struct {
	model, modelDir, decoder, split string
	prompt                          string
	promptTokens                    int
	maxTokens                       int
	expectedIDs                     []int64
	chat                            chatCase
	ref                             reference
	echo                            echoCase // echo.go's reference (echo_test.go)
}

// reference is the reference's text of token ids: transformers' tokenizer's decoding of each start
// of the reference's replies (special tokens skipped) and of each of their tokens alone (special
// tokens kept), or the tiny tokenizer's one character per id.
type reference struct {
	texts  map[string]string // by idsKey
	tokens map[int64]string
	// tiny: one character per id, ids in skip left out of texts
	tiny bool
	skip []int64
}

func idsKey(ids []int64) string { return fmt.Sprint(ids) }

// add records texts[k] as the text of ids[:k] and tokens[i] as that of ids[i] alone.
func (r *reference) add(t *testing.T, ids []int64, texts, tokens []string) {
	t.Helper()
	if len(texts) != len(ids)+1 || len(tokens) != len(ids) {
		t.Fatalf("the reference has %d texts and %d token texts for %d ids: testdata/smollm2.py wrote an old "+
			"description", len(texts), len(tokens), len(ids))
	}
	for k := range texts {
		r.texts[idsKey(ids[:k])] = texts[k]
	}
	for i, id := range ids {
		r.tokens[id] = tokens[i]
	}
}

// decode is the reference's text of ids, special tokens left out.
func (r *reference) decode(t *testing.T, ids []int64) string {
	t.Helper()
	if r.tiny {
		var kept []int64
		for _, id := range ids {
			if !slices.Contains(r.skip, id) {
				kept = append(kept, id)
			}
		}
		return tinyText(kept)
	}
	text, ok := r.texts[idsKey(ids)]
	if !ok {
		t.Fatalf("the reference has no text for %v (only for the starts of its replies)", ids)
	}
	return text
}

// token is the reference's text of id alone, special tokens included.
func (r *reference) token(t *testing.T, id int64) string {
	t.Helper()
	if r.tiny {
		return string(tinyRune(id))
	}
	text, ok := r.tokens[id]
	if !ok {
		t.Fatalf("the reference has no text for token %d (only for those of its replies)", id)
	}
	return text
}

// chatCase is a conversation and the reference reply the chat endpoint must give.
type chatCase struct {
	messages    []map[string]any
	promptIDs   []int64 // the rendered conversation: transformers' apply_chat_template, or the fixture's
	maxTokens   int
	expectedIDs []int64 // the greedy reply, its end of turn included when it has one
}

// referenceCase is SmolLM2 when testdata/smollm2.py described it, else the tiny decoder.
func referenceCase(t *testing.T) completionCase {
	t.Helper()
	if path := os.Getenv("PIPE_SERVE_SMOLLM2"); path != "" && fileExists(path) {
		var d struct {
			ModelDir       string   `json:"model_dir"`
			Decoder        string   `json:"decoder"`
			Split          string   `json:"split"`
			Prompt         string   `json:"prompt"`
			PromptIDs      []int64  `json:"prompt_ids"`
			MaxTokens      int      `json:"max_tokens"`
			ExpectedIDs    []int64  `json:"expected_ids"`
			ExpectedTexts  []string `json:"expected_texts"`
			ExpectedTokens []string `json:"expected_tokens"`
			Chat           struct {
				Messages       []map[string]any `json:"messages"`
				PromptIDs      []int64          `json:"prompt_ids"`
				MaxTokens      int              `json:"max_tokens"`
				ExpectedIDs    []int64          `json:"expected_ids"`
				ExpectedTexts  []string         `json:"expected_texts"`
				ExpectedTokens []string         `json:"expected_tokens"`
			} `json:"chat"`
			PromptTokens   []string       `json:"prompt_tokens"`
			PromptLogprobs promptLogprobs `json:"prompt_logprobs"`
		}
		data, err := os.ReadFile(path)
		if err == nil {
			err = json.Unmarshal(data, &d)
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(d.Chat.Messages) == 0 {
			t.Fatalf("%s has no chat reference: testdata/smollm2.py did not write it", path)
		}
		t.Logf("serving SmolLM2 from %s", d.ModelDir)
		ref := reference{texts: map[string]string{}, tokens: map[int64]string{}}
		ref.add(t, d.ExpectedIDs, d.ExpectedTexts, d.ExpectedTokens)
		ref.add(t, d.Chat.ExpectedIDs, d.Chat.ExpectedTexts, d.Chat.ExpectedTokens)
		if len(d.PromptTokens) != len(d.PromptIDs) || len(d.PromptLogprobs.Logprob) != len(d.PromptIDs)-1 {
			t.Fatalf("%s has no prompt_tokens or prompt_logprobs of its prompt: testdata/smollm2.py wrote an old "+
				"description", path)
		}
		return completionCase{"smollm2", d.ModelDir, d.Decoder, d.Split, d.Prompt, len(d.PromptIDs), d.MaxTokens,
			d.ExpectedIDs, chatCase{d.Chat.Messages, d.Chat.PromptIDs, d.Chat.MaxTokens, d.Chat.ExpectedIDs}, ref,
			echoCase{d.Prompt, d.PromptIDs, d.PromptTokens, d.PromptLogprobs, d.MaxTokens, d.ExpectedIDs, 5e-4}}
	}
	t.Log("no SmolLM2 description (PIPE_SERVE_SMOLLM2): serving the tiny decoder; run.sh reports SKIPPED")
	e := readTinyExpected(t)
	return completionCase{"tiny", tinyChatModelDir(t), fixture(t, "tiny_decoder.pt"), "model.layers.1:begin",
		tinyText(e.Prompts[0]), len(e.Prompts[0]), e.MaxNewTokens, e.Greedy[0], tinyChat(t, e),
		reference{tiny: true, skip: []int64{tinyEndOfTurn}}, tinyEcho(t, e)}
}

// The streamed completion is the reference's greedy continuation, as text through the model's
// tokenizer, in several events, then a finish reason and [DONE]; the same request without
// streaming gives the same text in one object with the token counts.
func TestCompletionMatchesTheReference(t *testing.T) {
	c := referenceCase(t)
	want := c.ref.decode(t, c.expectedIDs)
	wantFinish := "length"
	if len(c.expectedIDs) < c.maxTokens {
		wantFinish = "stop" // transformers stopped at the model's end token
	}
	s := startService(t, nil, "-decoder", c.decoder, "-model-dir", c.modelDir, "-split", c.split, "-name", c.model)

	body := map[string]any{"model": c.model, "prompt": c.prompt, "max_tokens": c.maxTokens, "temperature": 0,
		"top_p": 1, "seed": 3, "stream": true}
	resp, err := post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("streaming: %s, Content-Type %q", resp.Status, resp.Header.Get("Content-Type"))
	}
	got := readStream(t, resp.Body)
	if text := strings.Join(got.pieces, ""); text != want {
		t.Fatalf("streamed %q (in %d events), want %q", text, len(got.pieces), want)
	}
	if len(got.pieces) < 2 || got.finish != wantFinish || !got.done {
		t.Fatalf("%d text events, finish_reason %q (want %q), [DONE] %v", len(got.pieces), got.finish, wantFinish, got.done)
	}
	t.Logf("%s streamed %q in %d events", c.model, want, len(got.pieces))

	body["stream"] = false
	resp, err = post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var whole chunk
	if err := json.NewDecoder(resp.Body).Decode(&whole); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("not streaming: %s, %v", resp.Status, err)
	}
	if len(whole.Choices) != 1 || whole.Choices[0].Text != want || whole.Choices[0].FinishReason == nil ||
		*whole.Choices[0].FinishReason != wantFinish || whole.Usage == nil ||
		whole.Usage.PromptTokens != c.promptTokens || whole.Usage.CompletionTokens != len(c.expectedIDs) {
		t.Fatalf("not streaming: %+v, want text %q, finish %q, %d+%d tokens", whole, want, wantFinish,
			c.promptTokens, len(c.expectedIDs))
	}

	t.Run("Stop", func(t *testing.T) { checkStop(t, s, c) })
	t.Run("Chat", func(t *testing.T) { checkChat(t, s, c) })
	t.Run("OpenAIClient", func(t *testing.T) { checkOpenAIClient(t, s, c) })
	t.Run("Curl", func(t *testing.T) { checkCurl(t, s, c) })
	t.Run("StreamUsage", func(t *testing.T) { checkStreamUsage(t, s, c) })
	t.Run("Metrics", func(t *testing.T) { checkMetrics(t, s, c) })
	t.Run("BadRequests", func(t *testing.T) { checkBadRequests(t, s, c) })
	t.Run("OtherRefusals", func(t *testing.T) { checkOtherRefusals(t, s, c) })
	t.Run("SpecialTokenFlood", func(t *testing.T) { checkSpecialTokenFlood(t, s, c) })
	t.Run("Logprobs", func(t *testing.T) { checkLogprobs(t, s, c) })
	t.Run("Echo", func(t *testing.T) { checkEcho(t, s, c) })
}

// Bad requests get 400 with an OpenAI-style error object naming the field, and the service goes
// on serving.
func checkBadRequests(t *testing.T, s *service, c completionCase) {
	long := strings.Repeat(c.prompt, 200)
	cases := []struct {
		what, body, param string
	}{
		{"not JSON", `{"prompt": `, ""},
		{"two values", `{"prompt": "a"} {}`, ""},
		{"no prompt", `{"max_tokens": 4}`, "prompt"},
		{"empty prompt", `{"prompt": ""}`, "prompt"},
		{"a prompt of a number", `{"prompt": 5}`, "prompt"},
		{"two prompts", `{"prompt": ["a", "b"]}`, "prompt"},
		{"a token id outside the vocabulary", `{"prompt": [1, 1000000]}`, "prompt"},
		{"a prompt longer than the model takes", fmt.Sprintf(`{"prompt": %q}`, long), "prompt"},
		{"max_tokens 0", fmt.Sprintf(`{"prompt": %q, "max_tokens": 0}`, c.prompt), "max_tokens"},
		{"max_tokens a string", fmt.Sprintf(`{"prompt": %q, "max_tokens": "4"}`, c.prompt), ""},
		{"temperature 3", fmt.Sprintf(`{"prompt": %q, "temperature": 3}`, c.prompt), "temperature"},
		{"top_p 0", fmt.Sprintf(`{"prompt": %q, "top_p": 0}`, c.prompt), "top_p"},
		{"n 2", fmt.Sprintf(`{"prompt": %q, "n": 2}`, c.prompt), "n"},
		{"five stop strings", fmt.Sprintf(`{"prompt": %q, "stop": ["a", "b", "c", "d", "e"]}`, c.prompt), "stop"},
		{"a stop string too long", fmt.Sprintf(`{"prompt": %q, "stop": %q}`, c.prompt, strings.Repeat("x", maxStopBytes+1)),
			"stop"},
		{"a stop string in a list too long", fmt.Sprintf(`{"prompt": %q, "stop": ["a", %q]}`, c.prompt,
			strings.Repeat("é", maxStopBytes/2+1)), "stop"},
		{"an empty stop string", fmt.Sprintf(`{"prompt": %q, "stop": ""}`, c.prompt), "stop"},
		{"a stop number", fmt.Sprintf(`{"prompt": %q, "stop": 5}`, c.prompt), "stop"},
		{"stream_options without stream", fmt.Sprintf(`{"prompt": %q, "stream_options": {"include_usage": true}}`,
			c.prompt), "stream_options"},
		{"stream_options with stream false", fmt.Sprintf(`{"prompt": %q, "stream": false, "stream_options": {}}`,
			c.prompt), "stream_options"},
		{"stream_options a bool", fmt.Sprintf(`{"prompt": %q, "stream": true, "stream_options": true}`, c.prompt),
			"stream_options"},
		{"include_usage a string", fmt.Sprintf(`{"prompt": %q, "stream": true, "stream_options": {"include_usage": `+
			`"true"}}`, c.prompt), "stream_options.include_usage"},
		{"include_usage 1", fmt.Sprintf(`{"prompt": %q, "stream": true, "stream_options": {"include_usage": 1}}`,
			c.prompt), "stream_options.include_usage"},
	}
	if c.model == "tiny" {
		// Its tokenizer has one character per id and no unknown token (SmolLM2's covers every byte).
		cases = append(cases, struct{ what, body, param string }{"text the tokenizer cannot cover",
			`{"prompt": "a b"}`, "prompt"})
	}
	for _, bc := range cases {
		expectBadRequest(t, s, "/v1/completions", bc.what, bc.body, bc.param)
	}
	user := fmt.Sprintf(`{"role": "user", "content": %q}`, c.prompt) // text the tokenizer covers
	chat := func(fields string) string { return `{"messages": [` + user + `], ` + fields + `}` }
	for _, bc := range []struct{ what, body, param string }{
		{"not JSON", `{"messages": `, ""},
		{"no messages", `{"max_tokens": 4}`, "messages"},
		{"messages null", `{"messages": null}`, "messages"},
		{"no message", `{"messages": []}`, "messages"},
		{"messages a string", `{"messages": "Hi"}`, "messages"},
		{"a message without a role", `{"messages": [{"content": "Hi"}]}`, "messages[0].role"},
		{"a wizard's message", `{"messages": [` + user + `, {"role": "wizard", "content": "Hi"}]}`, "messages[1].role"},
		{"a message without content", `{"messages": [{"role": "user"}]}`, "messages[0].content"},
		{"content a number", `{"messages": [{"role": "user", "content": 5}]}`, "messages[0].content"},
		{"an image part", `{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}`,
			"messages[0].content"},
		{"a text part without text", `{"messages": [{"role": "user", "content": [{"type": "text"}]}]}`,
			"messages[0].content"},
		{"a conversation longer than the model takes", fmt.Sprintf(`{"messages": [{"role": "user", "content": %q}]}`,
			strings.Repeat(c.prompt, 200)), "messages"},
		{"max_tokens 0", chat(`"max_tokens": 0`), "max_tokens"},
		{"max_completion_tokens 0", chat(`"max_tokens": 5, "max_completion_tokens": 0`), "max_completion_tokens"},
		{"temperature -1", chat(`"temperature": -1`), "temperature"},
		{"n 3", chat(`"n": 3`), "n"},
		{"five stop strings", chat(`"stop": ["a", "b", "c", "d", "e"]`), "stop"},
		{"a stop string too long", chat(fmt.Sprintf(`"stop": [%q]`, strings.Repeat("x", maxStopBytes+1))), "stop"},
		{"stream_options without stream", chat(`"stream_options": {"include_usage": true}`), "stream_options"},
		{"stream_options a list", chat(`"stream": true, "stream_options": [true]`), "stream_options"},
		{"include_usage a string", chat(`"stream": true, "stream_options": {"include_usage": "yes"}`),
			"stream_options.include_usage"},
	} {
		expectBadRequest(t, s, "/v1/chat/completions", "chat: "+bc.what, bc.body, bc.param)
	}
	resp, err := http.Get(s.base + "/v1/completions")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("GET /v1/completions: %s", resp.Status)
	}
	if h := s.health(t); h.Status != "ok" || h.SlotsInUse != 0 {
		t.Fatalf("after the bad requests: %+v", h)
	}
}

// expectBadRequest posts body to path and expects 400 with an OpenAI-style error object on param;
// it returns the error's message.
func expectBadRequest(t *testing.T, s *service, path, what, body, param string) string {
	t.Helper()
	return expectRefusal(t, s, path, what, body, http.StatusBadRequest, param, "")
}

// expectRefusal posts body to path and expects status with an invalid_request_error object on
// param with code (when not ""); it returns the error's message.
func expectRefusal(t *testing.T, s *service, path, what, body string, status int, param, code string) string {
	t.Helper()
	resp, err := http.Post(s.base+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	e, err := readAPIError(resp)
	if resp.StatusCode != status || err != nil || e.Message == "" || e.Type != "invalid_request_error" ||
		deref(e.Param) != param || code != "" && deref(e.Code) != code {
		t.Fatalf("%s: %s, %+v (%v); want %d, an invalid_request_error on %q (code %q) with a message",
			what, resp.Status, e, err, status, param, code)
	}
	t.Logf("%s: %s", what, e.Message)
	return e.Message
}

// readAPIError reads (and closes) a response holding OpenAI's error object.
func readAPIError(resp *http.Response) (apiError, error) {
	defer resp.Body.Close()
	var e struct {
		Error apiError `json:"error"`
	}
	err := json.NewDecoder(resp.Body).Decode(&e)
	return e.Error, err
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// A model folder without a chat template: the chat endpoint answers 400 saying so.
func TestChatWithoutATemplate(t *testing.T) {
	s := gatedService(t, 1)
	msg := expectBadRequest(t, s, "/v1/chat/completions", "chat without a template",
		`{"messages": [{"role": "user", "content": "Hi"}]}`, "model")
	if !strings.Contains(msg, "no chat template") {
		t.Fatalf("the error says %q; want it to say the model has no chat template", msg)
	}
}

// With one sequence held in the pipeline, requests are accepted while a slot or a place in the
// queue is free, then refused with 503 and an error object; once the pipeline moves, every
// accepted request completes with its reference continuation.
func TestBusyGets503(t *testing.T) {
	e := readTinyExpected(t)
	const maxQueued = 1
	s := gatedService(t, maxQueued)
	type answer struct {
		status int
		text   string
		err    error
	}
	ask := func(prompt string) <-chan answer {
		c := make(chan answer, 1)
		go func() {
			resp, err := post(context.Background(), s, map[string]any{"prompt": prompt, "max_tokens": e.MaxNewTokens,
				"temperature": 0})
			if err != nil {
				c <- answer{err: err}
				return
			}
			defer resp.Body.Close()
			var whole chunk
			data, err := io.ReadAll(resp.Body)
			if err == nil && resp.StatusCode == http.StatusOK {
				err = json.Unmarshal(data, &whole)
			}
			a := answer{status: resp.StatusCode, err: err, text: string(data)}
			if err == nil && resp.StatusCode == http.StatusOK && len(whole.Choices) == 1 {
				a.text = whole.Choices[0].Text
			}
			if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
				a.err = errors.New("503 without Retry-After")
			}
			c <- a
		}()
		return c
	}
	held := ask(s.heldPrompt(t, 1, e.Prompts[0]))
	until(t, "the held request at the gate", func() bool { return s.gateArrived(1) })

	// One request at a time, each settled before the next: refused, or in the generator (holding
	// a slot or queued).
	type accepted struct {
		answer <-chan answer
		prompt int
	}
	var ok []accepted
	var refused answer
	for i := 0; ; i++ {
		if i > 8 {
			t.Fatalf("%d requests accepted with one held: never 503", i)
		}
		p := i % len(e.Prompts)
		c := ask(tinyText(e.Prompts[p]))
		var a answer
		var gotAnswer bool
		until(t, fmt.Sprintf("request %d refused or in the generator", i), func() bool {
			select {
			case a = <-c:
				gotAnswer = true
				return true
			default:
			}
			h := s.health(t)
			return h.SlotsInUse+h.Queued == len(ok)+2
		})
		if gotAnswer {
			refused = a
			break
		}
		ok = append(ok, accepted{c, p})
	}
	if refused.err != nil || refused.status != http.StatusServiceUnavailable ||
		!strings.Contains(refused.text, `"error"`) {
		t.Fatalf("after %d accepted: %d %q (%v), want 503 with an error object", len(ok), refused.status,
			refused.text, refused.err)
	}
	t.Logf("%d requests accepted besides the held one, then 503: %s", len(ok), refused.text)

	s.openGate(t, 1)
	if a := <-held; a.err != nil || a.status != http.StatusOK {
		t.Fatalf("the held request: %d %q %v", a.status, a.text, a.err)
	}
	for i, acc := range ok {
		a := <-acc.answer
		if want := tinyText(e.Greedy[acc.prompt]); a.err != nil || a.status != http.StatusOK || a.text != want {
			t.Fatalf("accepted request %d: %d %q (%v), want %q", i, a.status, a.text, a.err, want)
		}
	}
	if h := s.health(t); h.RejectedBusy != 1 {
		t.Fatalf("health after one 503: %+v", h)
	}
}

// A client that disconnects while its sequence is held in the pipeline cancels it: the service
// sees the disconnect, the sequence ends cancelled without a token once its step returns, its slot
// is free, and the next request is served.
func TestDisconnectCancelsTheSequence(t *testing.T) {
	e := readTinyExpected(t)
	s := gatedService(t, 4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := post(ctx, s, map[string]any{"prompt": s.heldPrompt(t, 1, e.Prompts[0]), "max_tokens": 8,
		"temperature": 0, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("streaming: %s", resp.Status)
	}
	until(t, "the streamed request at the gate", func() bool { return s.gateArrived(1) })
	cancel() // the client goes away: its connection closes
	resp.Body.Close()
	until(t, "the service to see the disconnect", func() bool { return s.health(t).Disconnects == 1 })

	s.openGate(t, 1)
	until(t, "the sequence to end cancelled", func() bool {
		h := s.health(t)
		return h.Finished["cancelled"] == 1 && h.SlotsInUse == 0
	})
	h := s.health(t)
	if h.Finished["length"] != 0 || h.Finished["stop"] != 0 || h.Finished["error"] != 0 {
		t.Fatalf("health after the disconnect: %+v", h)
	}

	resp, err = post(context.Background(), s, map[string]any{"prompt": tinyText(e.Prompts[1]),
		"max_tokens": e.MaxNewTokens, "temperature": 0, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := readStream(t, resp.Body)
	if text := strings.Join(got.pieces, ""); text != tinyText(e.Greedy[1]) || got.finish != "length" || !got.done {
		t.Fatalf("after the disconnect: %q (%q, %v), want %q", text, got.finish, got.done, tinyText(e.Greedy[1]))
	}
	if h := s.health(t); h.Finished["length"] != 1 || h.Finished["cancelled"] != 1 {
		t.Fatalf("health at the end: %+v", h)
	}
}
