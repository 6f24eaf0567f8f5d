package main

// The service as an abusive or broken client finds it (what makes it safe to expose): a prompt
// flooded with special tokens must not stop other streams; slow senders and a client that stops
// reading are cut off while another stream keeps receiving tokens (load_test.go's witness), and
// their slots are freed, as is that of a client that leaves mid-stream; a request waits for a slot
// no longer than the queue deadline; the API key is asked for; bodies over the limit, unknown
// models and oversized stop strings are refused with OpenAI's statuses.
//
// Every verdict is a state the test observed (a stream received tokens while a flood or a slow
// client was being handled, the server closed a connection the client was still trickling, a
// write failure was counted while the sequence was held at its gate); the timeouts are the
// service's, set small by flags, and the test's own clocks only end a hung test.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// floodLimit bounds how long a flooded request may take to be answered: the old wrapper took 61 s
// for this one; now it takes milliseconds, and a loaded machine gets a generous margin.
const floodLimit = 20 * time.Second

// checkOtherRefusals: a body over the limit gets 413, an unknown model 404 with code
// model_not_found, on both endpoints.
func checkOtherRefusals(t *testing.T, s *service, c completionCase) {
	big := fmt.Sprintf(`{"prompt": %q}`, strings.Repeat("x", 5<<20))
	expectRefusal(t, s, "/v1/completions", "a 5 MiB body", big, http.StatusRequestEntityTooLarge, "", "request_too_large")
	expectRefusal(t, s, "/v1/chat/completions", "chat: a 5 MiB body", big, http.StatusRequestEntityTooLarge, "",
		"request_too_large")
	expectRefusal(t, s, "/v1/completions", "another model",
		fmt.Sprintf(`{"prompt": %q, "model": "gpt-nothing"}`, c.prompt), http.StatusNotFound, "model", "model_not_found")
	expectRefusal(t, s, "/v1/chat/completions", "chat: another model",
		fmt.Sprintf(`{"messages": [{"role": "user", "content": %q}], "model": "gpt-nothing"}`, c.prompt),
		http.StatusNotFound, "model", "model_not_found")
	if h := s.health(t); h.Status != "ok" || h.SlotsInUse != 0 {
		t.Fatalf("after the refusals: %+v", h)
	}
}

// checkSpecialTokenFlood: a chat message of 32,000 end-of-turn tokens is answered within a couple
// of seconds while another stream, started before, goes on receiving tokens during it.
func checkSpecialTokenFlood(t *testing.T, s *service, c completionCase) {
	special := imEnd
	if c.model == "tiny" {
		special = string(tinyRune(tinyEndOfTurn))
	}
	// The other stream: completions of the reference prompt streamed one after the other (a
	// completion ends when the model's cache is full), counting the events received.
	var received atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	streaming := make(chan struct{})
	go func() {
		defer close(streaming)
		for ctx.Err() == nil {
			resp, err := post(ctx, s, map[string]any{"prompt": c.prompt, "max_tokens": 1 << 20, "temperature": 0,
				"stream": true})
			if err != nil {
				return
			}
			scanner := bufio.NewScanner(resp.Body)
			for scanner.Scan() {
				if strings.HasPrefix(scanner.Text(), "data: {") {
					received.Add(1)
				}
			}
			resp.Body.Close()
		}
	}()
	defer func() { cancel(); <-streaming }()
	until(t, "the other stream's first tokens", func() bool { return received.Load() > 0 })

	flood := map[string]any{"messages": []map[string]any{{"role": "user", "content": strings.Repeat(special, 32_000)}},
		"max_tokens": 4}
	for try := 1; ; try++ {
		before := received.Load()
		start := time.Now()
		resp, err := postTo(context.Background(), s, "/v1/chat/completions", flood)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		took, during := time.Since(start), received.Load()-before
		if resp.StatusCode != http.StatusBadRequest && resp.StatusCode != http.StatusOK {
			t.Fatalf("the flood got %s", resp.Status)
		}
		if took > floodLimit {
			t.Fatalf("the flood took %v to be answered", took)
		}
		if during > 0 {
			t.Logf("try %d: the flood was answered %s in %v; the other stream received %d events meanwhile",
				try, resp.Status, took, during)
			break
		}
		if try == 200 {
			t.Fatalf("the other stream received nothing while any of %d floods was handled", try)
		}
	}
	cancel()
	<-streaming
	until(t, "the other stream's slot to be free", func() bool { return s.health(t).SlotsInUse == 0 })
}

// ---- the limits service: small timeouts, an API key ---------------------------------------------

const testAPIKey = "sk-test-0123456789"

// limitsService is the gated decoder's service with every limit small, an API key, a chat
// template that renders a conversation as its messages' text alone (so that a conversation can
// start with a held prompt's key), and a model name so long (120 KB) that a few events of a stream
// overflow what the connection buffers for a client that does not read.
func limitsService(t *testing.T) *service {
	t.Helper()
	dir := contentChatModelDir(t)
	keyFile := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(keyFile, []byte(testAPIKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	gateDir := t.TempDir()
	s := startService(t, []string{"LD_PRELOAD=" + fixture(t, "libpipe_test_gate.so"), "LIBPIPE_TEST_GATE_DIR=" + gateDir},
		"-decoder", fixture(t, "gated_decoder.pt"), "-model-dir", dir, "-split", "model.layers.1:begin",
		"-max-queued", "4", "-name", strings.Repeat("m", 120_000), "-api-key-file", keyFile,
		"-read-header-timeout", "1s", "-read-timeout", "1s", "-write-timeout", "1s", "-queue-timeout", "1s")
	s.gateDir = gateDir
	return s
}

// contentChatModelDir is tinyModelDir with a chat template that renders a conversation as its
// messages' text alone: a conversation is then any fixture prompt (or a held one), and no token
// is special.
func contentChatModelDir(t *testing.T) string {
	t.Helper()
	dir := tinyModelDir(t)
	template := "{% for message in messages %}{{ message['content'] }}{% endfor %}"
	if err := os.WriteFile(filepath.Join(dir, "chat_template.jinja"), []byte(template), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// authorized sends a request with the test's API key.
func authorized(ctx context.Context, s *service, method, path, body string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, s.base+path, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+testAPIKey)
	req.Header.Set("Content-Type", "application/json")
	return http.DefaultClient.Do(req)
}

// rawRequest is an HTTP/1.1 request with the key, as bytes, for clients that misbehave on the
// wire.
func rawRequest(s *service, path, body string) string {
	return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"+
		"Content-Length: %d\r\n\r\n%s", path, strings.TrimPrefix(s.base, "http://"), testAPIKey, len(body), body)
}

func dial(t *testing.T, s *service, d *net.Dialer) net.Conn {
	t.Helper()
	conn, err := d.Dial("tcp", strings.TrimPrefix(s.base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// closedByServer reads conn until the server closes it, and closes the returned channel then.
func closedByServer(conn net.Conn) <-chan struct{} {
	closed := make(chan struct{})
	go func() {
		io.Copy(io.Discard, conn)
		close(closed)
	}()
	return closed
}

// trickle writes piece to conn every interval until closed is closed: the server cut it off.
func trickle(t *testing.T, conn net.Conn, piece string, closed <-chan struct{}) int {
	t.Helper()
	giveUp := time.Now().Add(waitLimit)
	for sent := 0; ; sent++ {
		select {
		case <-closed:
			return sent
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(giveUp) {
			t.Fatalf("the server still reads a request trickled for %v", waitLimit)
		}
		if _, err := io.WriteString(conn, piece); err != nil {
			<-closed // the server closed it: the reader sees it too
			return sent
		}
	}
}

func TestLimits(t *testing.T) {
	e := readTinyExpected(t)
	s := limitsService(t)

	t.Run("APIKey", func(t *testing.T) {
		for _, auth := range []string{"", "Bearer wrong-key", "Bearer " + testAPIKey + "x", "Basic " + testAPIKey,
			testAPIKey} {
			req, _ := http.NewRequest(http.MethodGet, s.base+"/v1/models", nil)
			if auth != "" {
				req.Header.Set("Authorization", auth)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			challenge := resp.Header.Get("WWW-Authenticate")
			apiErr, err := readAPIError(resp)
			if resp.StatusCode != http.StatusUnauthorized || challenge != "Bearer" || err != nil ||
				apiErr.Type != "invalid_request_error" || deref(apiErr.Code) != "invalid_api_key" || apiErr.Message == "" {
				t.Fatalf("Authorization %q: %s, WWW-Authenticate %q, %+v (%v); want 401 with an error object",
					auth, resp.Status, challenge, apiErr, err)
			}
		}
		resp, err := authorized(context.Background(), s, http.MethodPost, "/v1/completions",
			fmt.Sprintf(`{"prompt": %q, "max_tokens": %d, "temperature": 0}`, tinyText(e.Prompts[1]), e.MaxNewTokens))
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(data), fmt.Sprintf("%q", tinyText(e.Greedy[1]))) {
			t.Fatalf("with the key: %s %.200s", resp.Status, data)
		}
		if h := s.health(t); h.Status != "ok" { // no key
			t.Fatalf("/health without the key: %+v", h)
		}
		// /metrics is behind the key (no -metrics-public), and counts the refusals.
		resp, err = http.Get(s.base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("/metrics without the key: %s, want 401", resp.Status)
		}
		m := scrape(t, s, testAPIKey)
		if n := m.value("pipe_serve_requests_total", "endpoint", "/v1/models", "code", "401"); n != 5 {
			t.Fatalf("/metrics counts %g requests for /v1/models refused with 401, want 5", n)
		}
	})

	// The slow and stalled clients are each handled while a witness stream goes on: it must
	// receive tokens while the service waits for the abusive client, up to the client's cut-off.
	t.Run("SlowHeaders", func(t *testing.T) {
		w := limitsWitness(t, s, e)
		w.during(t, "a client trickled its headers", func(t *testing.T) {
			conn := dial(t, s, &net.Dialer{})
			closed := closedByServer(conn)
			io.WriteString(conn, "GET /health HTTP/1.1\r\nHost: x\r\n")
			sent := trickle(t, conn, "X-Slow: a\r\n", closed)
			t.Logf("cut off after %d trickled header lines", sent)
		})
	})

	t.Run("SlowBody", func(t *testing.T) {
		w := limitsWitness(t, s, e)
		w.during(t, "a client trickled its body", func(t *testing.T) { checkSlowBody(t, s) })
	})

	t.Run("StalledReader", func(t *testing.T) {
		// A client that sends a streamed chat request and never reads (small receive buffers, and a
		// small segment size so that the server's send buffer stays small too): each event of the
		// reply carries the 120 KB model name, so the writes soon block.
		w := limitsWitness(t, s, e)
		var conns []net.Conn
		w.during(t, "a client did not read its stream", func(t *testing.T) {
			before := s.health(t)
			d := &net.Dialer{Control: func(network, address string, rc syscall.RawConn) error {
				return rc.Control(func(fd uintptr) {
					syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
					syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_MAXSEG, 536)
				})
			}}
			conn := dial(t, s, d)
			conns = append(conns, conn)
			io.WriteString(conn, rawRequest(s, "/v1/chat/completions", fmt.Sprintf(
				`{"messages": [{"role": "user", "content": %q}], "max_tokens": 40, "stream": true}`, tinyText(e.Prompts[0]))))
			// The witness never stops reading: every write failure is the stalled client's.
			until(t, "the stalled stream's write to fail", func() bool {
				return s.health(t).WriteFailures == before.WriteFailures+1
			})
		})
		w.stop(t)
		until(t, "the stalled streams' sequences to end and free their slots", func() bool {
			h := s.health(t)
			return h.SlotsInUse == 0 && h.Queued == 0
		})
		for _, conn := range conns {
			conn.SetReadDeadline(time.Now().Add(waitLimit))
			if n, err := io.Copy(io.Discard, conn); err != nil {
				t.Fatalf("the server did not close the stalled connection: %v after %d bytes", err, n)
			}
		}
	})

	t.Run("DisconnectMidStream", func(t *testing.T) {
		before := s.health(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		content := s.heldPrompt(t, 5, e.Prompts[0])
		resp, err := authorized(ctx, s, http.MethodPost, "/v1/chat/completions",
			fmt.Sprintf(`{"messages": [{"role": "user", "content": %q}], "max_tokens": 8, "stream": true}`, content))
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("streaming: %s", resp.Status)
		}
		// The first event (the assistant's role) has come: the stream is under way.
		if line, err := bufio.NewReaderSize(resp.Body, 1<<18).ReadString('\n'); err != nil ||
			!strings.HasPrefix(line, "data: {") {
			t.Fatalf("the first event: %.100q, %v", line, err)
		}
		until(t, "the sequence at its gate", func() bool { return s.gateArrived(5) })
		cancel()
		resp.Body.Close()
		until(t, "the service to see the disconnect", func() bool {
			h := s.health(t)
			return h.Disconnects+h.WriteFailures == before.Disconnects+before.WriteFailures+1
		})
		s.openGate(t, 5)
		until(t, "the sequence to end cancelled and free its slot", func() bool {
			h := s.health(t)
			return h.Finished["cancelled"] == before.Finished["cancelled"]+1 && h.SlotsInUse == 0
		})
	})

	t.Run("QueueDeadline", func(t *testing.T) {
		checkQueueDeadline(t, s, e)
	})
}

// checkQueueDeadline: with every slot taken (one sequence held at its gate, the others stuck
// behind it), a request that waits for a slot past -queue-timeout gets 503 with Retry-After and
// leaves the queue; the requests that had slots are served once the pipeline moves.
func checkQueueDeadline(t *testing.T, s *service, e tinyExpected) {
	before := s.health(t)
	type answer struct {
		status     int
		retryAfter string
		body       string
		err        error
	}
	ask := func(prompt string) <-chan answer {
		c := make(chan answer, 1)
		go func() {
			resp, err := authorized(context.Background(), s, http.MethodPost, "/v1/completions",
				fmt.Sprintf(`{"prompt": %q, "max_tokens": 4, "temperature": 0}`, prompt))
			if err != nil {
				c <- answer{err: err}
				return
			}
			data, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			c <- answer{resp.StatusCode, resp.Header.Get("Retry-After"), string(data), err}
		}()
		return c
	}
	held := ask(s.heldPrompt(t, 4, e.Prompts[0]))
	until(t, "the held request at the gate", func() bool { return s.gateArrived(4) })
	var admitted []<-chan answer
	for i := 0; ; i++ {
		if i > 8 {
			t.Fatalf("%d requests admitted with the pipeline held: none waited for a slot", i)
		}
		c := ask(tinyText(e.Prompts[1]))
		var a answer
		answered, queued := false, false
		until(t, fmt.Sprintf("request %d answered, or holding a slot, or queued", i), func() bool {
			select {
			case a = <-c:
				answered = true
				return true
			default:
			}
			h := s.health(t)
			queued = h.Queued > 0
			return h.SlotsInUse+h.Queued == len(admitted)+2
		})
		if !answered && !queued {
			admitted = append(admitted, c)
			continue
		}
		if !answered {
			a = <-c // queued: the deadline answers it
		}
		if a.err != nil || a.status != http.StatusServiceUnavailable || a.retryAfter == "" || !strings.Contains(a.body, `"error"`) {
			t.Fatalf("the request that waited for a slot: %d, Retry-After %q, %.300s (%v); want 503 with Retry-After",
				a.status, a.retryAfter, a.body, a.err)
		}
		t.Logf("%d requests admitted besides the held one; the next one waited and got %d: %s", len(admitted),
			a.status, a.body)
		break
	}
	h := s.health(t)
	if h.QueueTimeouts != before.QueueTimeouts+1 || h.RejectedBusy != before.RejectedBusy {
		t.Fatalf("after the queue deadline: %+v", h)
	}
	until(t, "the request past its deadline to leave the queue", func() bool { return s.health(t).Queued == 0 })
	s.openGate(t, 4)
	for i, c := range append(admitted, held) {
		if a := <-c; a.err != nil || a.status != http.StatusOK {
			t.Fatalf("admitted request %d: %d %.300s (%v)", i, a.status, a.body, a.err)
		}
	}
}

// checkSlowBody: a body trickled after its headers is cut off (408, or the connection closed) by
// the read timeout.
func checkSlowBody(t *testing.T, s *service) {
	conn := dial(t, s, &net.Dialer{})
	request := rawRequest(s, "/v1/completions", `{"prompt": "`+strings.Repeat(" ", 100_000)+`"}`)
	io.WriteString(conn, request[:strings.Index(request, "\r\n\r\n")+4+1]) // the headers and one byte
	answered := make(chan *http.Response, 1)
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		reader := bufio.NewReader(conn)
		if resp, err := http.ReadResponse(reader, nil); err == nil {
			answered <- resp
			io.Copy(io.Discard, resp.Body)
		}
		io.Copy(io.Discard, reader)
	}()
	sent := trickle(t, conn, " ", closed)
	select {
	case resp := <-answered:
		if resp.StatusCode != http.StatusRequestTimeout {
			t.Fatalf("a trickled body got %s, want 408", resp.Status)
		}
		t.Logf("cut off with %s after %d trickled bytes", resp.Status, sent)
	default:
		t.Logf("cut off without an answer after %d trickled bytes", sent)
	}
}

// limitsWitness is a witness stream on the limits service: completions of a fixture prompt run
// to the cache's end, one after the other.
func limitsWitness(t *testing.T, s *service, e tinyExpected) *witness {
	t.Helper()
	return startWitness(t, func() *call {
		return ask(context.Background(), s, testAPIKey, "/v1/completions", map[string]any{
			"prompt": tinyText(e.Prompts[1]), "max_tokens": 1 << 20, "temperature": 0, "stream": true})
	})
}
