package main

// The model's chat template: the Jinja template that turns a conversation into the prompt the
// model was trained on, rendered the way Hugging Face's tokenizer.apply_chat_template does
// (messages, add_generation_prompt and the tokenizer's special tokens as variables), by
// github.com/ardanlabs/jinja (pure Go, written for chat templates).
//
// Where it comes from, as in transformers: chat_template.jinja in the model folder, else
// tokenizer_config.json's chat_template (a string, or a list of named templates of which
// "default" is the one used).

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ardanlabs/jinja"
)

// chatTemplate is a compiled template and the special tokens it may refer to.
type chatTemplate struct {
	source string // where it was read, for messages
	tmpl   *jinja.Template
	tokens map[string]string // bos_token, eos_token, ... as tokenizer_config.json names them
}

// chatMessage is one turn of a conversation, its content already flattened to text.
type chatMessage struct {
	Role    string
	Content string
}

// specialTokenNames are tokenizer_config.json's special tokens that templates use by name.
var specialTokenNames = []string{"bos_token", "eos_token", "unk_token", "pad_token"}

// loadChatTemplate reads the folder's chat template; nil without error when it has none.
func loadChatTemplate(modelDir string) (*chatTemplate, error) {
	config := map[string]json.RawMessage{}
	configPath := filepath.Join(modelDir, "tokenizer_config.json")
	data, err := os.ReadFile(configPath)
	switch {
	case err == nil:
		if err := json.Unmarshal(data, &config); err != nil {
			return nil, fmt.Errorf("%s: %w", configPath, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}

	var source, text string
	jinjaPath := filepath.Join(modelDir, "chat_template.jinja")
	if data, err := os.ReadFile(jinjaPath); err == nil {
		source, text = jinjaPath, string(data)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	} else if raw, ok := config["chat_template"]; ok && string(raw) != "null" {
		source = configPath + " (chat_template)"
		if text, err = templateText(raw); err != nil {
			return nil, fmt.Errorf("%s: %w", source, err)
		}
	} else {
		return nil, nil
	}

	tmpl, err := jinja.Compile(text)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", source, err)
	}
	c := &chatTemplate{source: source, tmpl: tmpl, tokens: map[string]string{}}
	for _, name := range specialTokenNames {
		if raw, ok := config[name]; ok {
			if content, ok := tokenContent(raw); ok {
				c.tokens[name] = content
			}
		}
	}
	return c, nil
}

// templateText is tokenizer_config.json's chat_template: a string, or [{"name", "template"}]
// of which "default" is the one for plain chat (the others are for tools or documents).
func templateText(raw json.RawMessage) (string, error) {
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return text, nil
	}
	var named []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", errors.New("neither a string nor a list of named templates")
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", errors.New("a list of named templates without a \"default\" one")
}

// tokenContent is a special token as tokenizer_config.json writes it: a string, or an
// AddedToken object whose "content" is the text.
func tokenContent(raw json.RawMessage) (string, bool) {
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return text, true
	}
	var added struct {
		Content *string `json:"content"`
	}
	if json.Unmarshal(raw, &added) == nil && added.Content != nil {
		return *added.Content, true
	}
	return "", false
}

// Render is the prompt of a conversation, ending where the assistant's reply begins.
func (c *chatTemplate) Render(messages []chatMessage) (string, error) {
	list := make([]any, len(messages))
	for i, m := range messages {
		list[i] = map[string]any{"role": m.Role, "content": m.Content}
	}
	data := map[string]any{"messages": list, "add_generation_prompt": true}
	for name, content := range c.tokens {
		data[name] = content
	}
	return c.tmpl.Render(data)
}
