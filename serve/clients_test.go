package main

// The service as other clients drive it: OpenAI's official Python client (the `openai` package
// of the project's virtualenv, through testdata/openai_client_check.py) and curl. Both must get
// the reference texts.

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// noProxy keeps a client that honours the proxy variables on the loopback.
var noProxy = []string{"NO_PROXY=127.0.0.1,localhost", "no_proxy=127.0.0.1,localhost"}

// Completions and chat replies, streamed and not, through openai.OpenAI(base_url=...); streamed
// with stream_options include_usage, the reference's token counts.
func checkOpenAIClient(t *testing.T, s *service, c completionCase) {
	python := os.Getenv("LIBPIPE_PYTHON")
	if python == "" {
		t.Skip("LIBPIPE_PYTHON is not set (ctest sets it to the project's virtualenv): no openai client to run")
	}
	reply, replyFinish := chatReply(t, c)
	cases := map[string]any{
		"model": c.model,
		"completion": map[string]any{"prompt": c.prompt, "max_tokens": c.maxTokens, "text": c.ref.decode(t, c.expectedIDs),
			"finish_reason": referenceFinish(c.expectedIDs, c.maxTokens), "prompt_tokens": c.promptTokens,
			"completion_tokens": len(c.expectedIDs)},
		"chat": map[string]any{"messages": c.chat.messages, "max_tokens": c.chat.maxTokens, "text": reply,
			"finish_reason": replyFinish, "prompt_tokens": len(c.chat.promptIDs),
			"completion_tokens": len(c.chat.expectedIDs)},
	}
	path := filepath.Join(t.TempDir(), "cases.json")
	writeJSONFile(t, path, cases)
	cmd := exec.Command(python, filepath.Join("testdata", "openai_client_check.py"), s.base+"/v1", path)
	cmd.Env = append(os.Environ(), noProxy...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("testdata/openai_client_check.py: %v (scripts/install-deps.sh installs the openai package)\n%s",
			err, out)
	}
	t.Logf("%s", out)
}

// curl -sN, as the README shows it, streams the reference texts.
func checkCurl(t *testing.T, s *service, c completionCase) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Fatal("curl is not installed (scripts/install-deps.sh installs it)")
	}
	run := func(path string, body map[string]any) []byte {
		data, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(curl, "-sN", "--fail-with-body", s.base+path, "-H", "Content-Type: application/json",
			"-d", string(data))
		cmd.Env = append(os.Environ(), noProxy...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("curl %s: %v\n%s", path, err, out)
		}
		return out
	}
	want := c.ref.decode(t, c.expectedIDs)
	got := readStream(t, bytes.NewReader(run("/v1/completions", map[string]any{"prompt": c.prompt,
		"max_tokens": c.maxTokens, "temperature": 0, "stream": true})))
	if text := strings.Join(got.pieces, ""); text != want || !got.done ||
		got.finish != referenceFinish(c.expectedIDs, c.maxTokens) {
		t.Fatalf("curl, completions: %q, finish %q, [DONE] %v; want %q", text, got.finish, got.done, want)
	}
	reply, finish := chatReply(t, c)
	chat := readChatStream(t, bytes.NewReader(run("/v1/chat/completions", map[string]any{"messages": c.chat.messages,
		"max_tokens": c.chat.maxTokens, "temperature": 0, "stream": true})))
	if text := strings.Join(chat.pieces, ""); text != reply || !chat.leading || chat.finish != finish || !chat.done {
		t.Fatalf("curl, chat: %q, finish %q, [DONE] %v; want %q, finish %q", text, chat.finish, chat.done, reply, finish)
	}
	t.Logf("curl streamed %q and %q", want, reply)
}
