package main

// The API key: with -api-key or -api-key-file, every request must carry
// `Authorization: Bearer <key>`, as OpenAI's clients send their api_key; one without it, or with
// another key, gets 401 with OpenAI's error object and `WWW-Authenticate: Bearer` (RFC 6750).
// GET /health stays open, for load balancers and orchestrators that probe without credentials;
// GET /metrics is behind the key unless -metrics-public (a scraper that cannot send a key, on a
// network that is trusted).
//
// The key is compared in constant time (crypto/subtle), and the SHA-256 sums of both keys are
// what is compared, so that neither a key's content nor its length shows in the time a refusal
// takes.

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// apiKey guards the API with a key.
type apiKey struct {
	sum    [sha256.Size]byte
	public map[string]bool // paths served without the key
}

// loadAPIKey is the key of -api-key or -api-key-file (its content, without the whitespace around
// it, such as the file's last newline); "" when neither is given.
func loadAPIKey(key, file string) (string, error) {
	switch {
	case key != "" && file != "":
		return "", errors.New("give -api-key or -api-key-file, not both")
	case file != "":
		data, err := os.ReadFile(file)
		if err != nil {
			return "", err
		}
		if key = strings.TrimSpace(string(data)); key == "" {
			return "", fmt.Errorf("-api-key-file %s is empty", file)
		}
	}
	return key, nil
}

// newAPIKey guards with key; nil (nothing guarded) for "".
func newAPIKey(key string, metricsPublic bool) *apiKey {
	if key == "" {
		return nil
	}
	a := &apiKey{sum: sha256.Sum256([]byte(key)), public: map[string]bool{"/health": true}}
	if metricsPublic {
		a.public["/metrics"] = true
	}
	return a
}

// guard lets through requests with the key, and those for public paths.
func (a *apiKey) guard(next http.Handler) http.Handler {
	if a == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.public[r.URL.Path] {
			next.ServeHTTP(w, r)
			return
		}
		// The scheme is case-insensitive (RFC 7235); the key is what follows it.
		scheme, key, found := strings.Cut(r.Header.Get("Authorization"), " ")
		sum := sha256.Sum256([]byte(strings.TrimSpace(key)))
		if !found || !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare(sum[:], a.sum[:]) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			writeJSON(w, http.StatusUnauthorized, errorBody("invalid_request_error", "", "invalid_api_key",
				"no API key or a wrong one: send the service's key as \"Authorization: Bearer KEY\""))
			return
		}
		next.ServeHTTP(w, r)
	})
}
