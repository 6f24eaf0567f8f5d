package pipe

import (
	"runtime"
	"strings"
	"sync"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// Tokenizer is a Hugging Face model folder's tokenizer, its special and stop ids and its chat
// template (pipe.h's "Text", libpipe >= 0.14), run by Hugging Face's tokenizers library inside
// libpipe. It is safe for concurrent use; [Tokenizer.Close] waits for calls in progress.
type Tokenizer struct {
	mu            sync.RWMutex // read: a call on ptr is in progress; write: Close
	ptr           capi.SwigcptrPipe_tokenizer
	cleanup       runtime.Cleanup
	vocab         int64
	bos, eos, pad int64
	stop          []int64
}

// ChatMessage is one turn of a conversation for [Tokenizer.ApplyChatTemplate].
type ChatMessage struct {
	Role    string // "system", "user", "assistant", ...
	Content string
}

// LoadTokenizer loads the tokenizer of the Hugging Face model folder dir (tokenizer.json, with
// tokenizer_config.json, chat_template.jinja, generation_config.json and config.json when
// present). ErrNotFound without tokenizer.json; ErrInvalidFormat for a file that does not parse.
func LoadTokenizer(dir string) (*Tokenizer, error) {
	var ptr capi.SwigcptrPipe_tokenizer
	if err := call("pipe_tokenizer_load", func() int { return capi.Pipe_tokenizer_load(dir, &ptr) }); err != nil {
		return nil, err
	}
	t := &Tokenizer{ptr: ptr}
	t.cleanup = runtime.AddCleanup(t, func(p capi.SwigcptrPipe_tokenizer) { capi.Pipe_tokenizer_destroy(p) }, ptr)
	var stop []int64
	err := call("pipe_tokenizer_vocab_size", func() int { return capi.Pipe_tokenizer_vocab_size(ptr, &t.vocab) })
	if err == nil {
		err = call("pipe_tokenizer_special_ids", func() int {
			return capi.Pipe_tokenizer_special_ids(ptr, &t.bos, &t.eos, &t.pad)
		})
	}
	if err == nil {
		err = call("pipe_tokenizer_stop_ids", func() int {
			var address uintptr
			var n int64
			st := capi.Pipe_tokenizer_stop_ids(ptr, &address, &n)
			if st == capi.PIPE_OK {
				stop = make([]int64, n)
				capi.Pipego_copy_ids(address, stop)
			}
			return st
		})
	}
	if err != nil {
		t.Close()
		return nil, err
	}
	t.stop = stop
	return t, nil
}

// Close frees the tokenizer; decode streams made from it stay usable. Closing twice is a no-op.
func (t *Tokenizer) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ptr != 0 {
		t.cleanup.Stop()
		capi.Pipe_tokenizer_destroy(t.ptr)
		t.ptr = 0
	}
	return nil
}

func (t *Tokenizer) acquire(op string) (capi.SwigcptrPipe_tokenizer, error) {
	t.mu.RLock()
	if t.ptr == 0 {
		t.mu.RUnlock()
		return 0, closedError(op, "tokenizer")
	}
	return t.ptr, nil
}

func flag(b bool) int {
	if b {
		return 1
	}
	return 0
}

// VocabSize is one past the largest token id: ids are 0 .. VocabSize()-1.
func (t *Tokenizer) VocabSize() int64 { return t.vocab }

// SpecialIDs are the bos, eos and pad token ids, -1 for each the folder does not name.
func (t *Tokenizer) SpecialIDs() (bos, eos, pad int64) { return t.bos, t.eos, t.pad }

// StopIDs are the ids that end a generation (generation_config.json's eos_token_id, one or
// several, and the tokenizer's eos token), for [GenerationOptions] stop ids.
func (t *Tokenizer) StopIDs() []int64 { return append([]int64(nil), t.stop...) }

// Encode gives the token ids of text, with the special tokens the tokenizer adds (a leading BOS,
// ...) when addSpecial is true: Hugging Face's encode(text, add_special_tokens). ErrInvalidArgument
// for text that is not valid UTF-8.
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]int64, error) {
	ptr, err := t.acquire("Tokenizer.Encode")
	if err != nil {
		return nil, err
	}
	defer t.mu.RUnlock()
	var ids []int64
	err = call("pipe_tokenizer_encode", func() int {
		var address uintptr
		var n int64
		st := capi.Pipe_tokenizer_encode(ptr, []byte(text), flag(addSpecial), &address, &n)
		if st == capi.PIPE_OK { // lent until this thread's next libpipe call: copy now
			ids = make([]int64, n)
			capi.Pipego_copy_ids(address, ids)
		}
		return st
	})
	return ids, err
}

func lentText(address uintptr, n int64) string {
	buf := make([]byte, n)
	capi.Pipego_copy_bytes(address, buf)
	return string(buf)
}

// Decode gives the text of ids, leaving special tokens out when skipSpecial is true: Hugging
// Face's decode. ErrInvalidArgument for an id outside the vocabulary.
func (t *Tokenizer) Decode(ids []int64, skipSpecial bool) (string, error) {
	ptr, err := t.acquire("Tokenizer.Decode")
	if err != nil {
		return "", err
	}
	defer t.mu.RUnlock()
	var text string
	err = call("pipe_tokenizer_decode", func() int {
		var address uintptr
		var n int64
		st := capi.Pipe_tokenizer_decode(ptr, ids, flag(skipSpecial), &address, &n)
		if st == capi.PIPE_OK {
			text = lentText(address, n)
		}
		return st
	})
	return text, err
}

// ApplyChatTemplate renders the folder's chat template over messages, with the assistant's opening
// appended when addGenerationPrompt is true: transformers' apply_chat_template(messages,
// tokenize=False). Encode the result with addSpecial false. ErrInvalidFormat when the folder has no
// template; ErrInvalidArgument when the template raises for this conversation or a message holds
// a NUL byte.
func (t *Tokenizer) ApplyChatTemplate(messages []ChatMessage, addGenerationPrompt bool) (string, error) {
	var joined strings.Builder
	for i, m := range messages {
		if strings.IndexByte(m.Role, 0) >= 0 || strings.IndexByte(m.Content, 0) >= 0 {
			return "", errorf("Tokenizer.ApplyChatTemplate", StatusInvalidArgument, "message %d holds a NUL byte", i)
		}
		joined.WriteString(m.Role)
		joined.WriteByte(0)
		joined.WriteString(m.Content)
		joined.WriteByte(0)
	}
	ptr, err := t.acquire("Tokenizer.ApplyChatTemplate")
	if err != nil {
		return "", err
	}
	defer t.mu.RUnlock()
	var text string
	err = call("pipe_tokenizer_apply_chat_template", func() int {
		var address uintptr
		var n int64
		st := capi.Pipego_apply_chat_template(ptr, []byte(joined.String()), int64(len(messages)),
			flag(addGenerationPrompt), &address, &n)
		if st == capi.PIPE_OK {
			text = lentText(address, n)
		}
		return st
	})
	return text, err
}

// DecodeStream turns ids fed one at a time into whole UTF-8 characters
// (pipe_decode_stream_push), and gives what it holds back at the end (Flush). Its methods
// serialize their callers.
type DecodeStream struct {
	mu      sync.Mutex
	ptr     capi.SwigcptrPipe_decode_stream
	cleanup runtime.Cleanup
}

// NewDecodeStream starts a decode stream, leaving special tokens out when skipSpecial is true.
// It outlives the tokenizer.
func (t *Tokenizer) NewDecodeStream(skipSpecial bool) (*DecodeStream, error) {
	ptr, err := t.acquire("Tokenizer.NewDecodeStream")
	if err != nil {
		return nil, err
	}
	defer t.mu.RUnlock()
	var sp capi.SwigcptrPipe_decode_stream
	if err := call("pipe_decode_stream_create", func() int {
		return capi.Pipe_decode_stream_create(ptr, flag(skipSpecial), &sp)
	}); err != nil {
		return nil, err
	}
	s := &DecodeStream{ptr: sp}
	s.cleanup = runtime.AddCleanup(s, func(p capi.SwigcptrPipe_decode_stream) { capi.Pipe_decode_stream_destroy(p) }, sp)
	return s, nil
}

// Push feeds the next id and gives the characters it completes: "" while a character waits for
// its last bytes. ErrInvalidArgument for an id outside the vocabulary.
func (s *DecodeStream) Push(id int64) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == 0 {
		return "", closedError("DecodeStream.Push", "decode stream")
	}
	var text string
	err := call("pipe_decode_stream_push", func() int {
		var address uintptr
		var n int64
		st := capi.Pipe_decode_stream_push(s.ptr, id, &address, &n)
		if st == capi.PIPE_OK {
			text = lentText(address, n)
		}
		return st
	})
	return text, err
}

// Flush gives what the stream holds back, as the end of the text (pipe_decode_stream_flush): the
// ids that complete no character yet, with U+FFFD for their bytes; "" when it holds nothing. Call
// it when the ids end: Push's pieces and Flush's text put together are the decode of every id. The
// stream may go on after it (the ids so far stay the context of the next ones).
func (s *DecodeStream) Flush() (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == 0 {
		return "", closedError("DecodeStream.Flush", "decode stream")
	}
	var text string
	err := call("pipe_decode_stream_flush", func() int {
		var address uintptr
		var n int64
		st := capi.Pipe_decode_stream_flush(s.ptr, &address, &n)
		if st == capi.PIPE_OK {
			text = lentText(address, n)
		}
		return st
	})
	return text, err
}

// Close frees the stream. Closing twice is a no-op.
func (s *DecodeStream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr != 0 {
		s.cleanup.Stop()
		capi.Pipe_decode_stream_destroy(s.ptr)
		s.ptr = 0
	}
	return nil
}
