package main

// Errors as OpenAI's API gives them: {"error": {"message", "type", "param", "code"}} with the HTTP
// status OpenAI (and llama-server, vLLM) use for the case, so that clients' retry and error
// handling works unchanged: 400 a request the service cannot take, 401 no or a wrong API key, 404
// a model not served here, 408 a body that did not arrive in time, 413 a body over the limit, 503
// busy (with Retry-After), 500 and 504 the service's own failures.
//
// A failure of the service says what failed, never its internals: the error itself (libpipe's
// message, which may name stages, files or exceptions) goes to the service's log.

import (
	"encoding/json"
	"fmt"
	"log"
	"net/http"
)

// apiError is OpenAI's error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(v); err != nil {
		log.Printf("writing a response: %v", err)
	}
}

// errorBody is the error object of typ on param (none: "") with code (none: "").
func errorBody(typ, param, code, format string, args ...any) map[string]apiError {
	e := apiError{Message: fmt.Sprintf(format, args...), Type: typ}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	return map[string]apiError{"error": e}
}

func writeError(w http.ResponseWriter, status int, typ, param, format string, args ...any) {
	writeJSON(w, status, errorBody(typ, param, "", format, args...))
}

// badRequest is a request the service refuses: which field, why, and the status (400 unless
// said otherwise) and OpenAI's code for it.
type badRequest struct {
	param, message string
	status         int    // 0: 400
	code           string // "": none
}

func (b *badRequest) Error() string { return b.message }

func bad(param, format string, args ...any) *badRequest {
	return &badRequest{param: param, message: fmt.Sprintf(format, args...)}
}

// refuse answers a request the service cannot take with OpenAI's error object.
func (s *server) refuse(w http.ResponseWriter, b *badRequest) {
	s.badRequests.Add(1)
	status := b.status
	if status == 0 {
		status = http.StatusBadRequest
	}
	writeJSON(w, status, errorBody("invalid_request_error", b.param, b.code, "%s", b.message))
}

// internalError answers a failure of the service: the client learns what failed (what, e.g.
// "the generation failed"), the log learns why.
func internalError(w http.ResponseWriter, status int, what string, err error) {
	log.Printf("%s: %v", what, err)
	writeError(w, status, "server_error", "", "%s; the service's log says why", what)
}
