//! The decoder fixtures (tests/models/decoder_models.py in the libpipe repository, copied into the
//! fixture folder): tiny_decoder.pt, a 2-layer Llama-architecture decoder with random weights (vocab
//! 128, 4 slots, max_len 64); tiny_decoder.expected.json, the greedy tokens transformers generates
//! with the same weights (the independent reference); gated_decoder.pt, the same weights with a
//! test gate at the start of the second stage: a prefill row whose first token is 120..127 holds
//! its step at key id - 119 in stage "stage1", one starting with 119 makes the step fail.

use pipe::{Generator, GeneratorOptions, Model, Plan, PlanOptions, SessionOptions};

use super::fixture;
use super::gate;

/// Where the fixtures' decoders are cut: two stages.
pub const SPLIT: &str = "model.layers.1:begin";
/// The gated decoders' gate: in the second stage.
pub const GATED_STAGE: &str = "stage1";
/// A prefill row starting with this id fails its step.
pub const FAIL_ID: i64 = 119;

/// tiny_decoder.expected.json.
pub struct Expected {
    pub prompts: Vec<Vec<i64>>,
    pub max_new_tokens: usize,
    pub greedy: Vec<Vec<i64>>,
    /// Per prompt: each greedy token's log-probability and the 5 likeliest tokens at its position,
    /// from transformers' logits.
    pub greedy_logprobs: Vec<GreedyLogprobs>,
    /// Per prompt: the same of each prompt token from position 1 on, given those before it.
    pub prompt_logprobs: Vec<GreedyLogprobs>,
    pub vocab: usize,
    pub slots: usize,
    pub max_len: usize,
    /// A prompt that leaves room for few tokens, and every token generated after it until the
    /// cache is full.
    pub max_len_prompt: Vec<i64>,
    pub max_len_greedy: Vec<i64>,
}

/// One prompt's entry of "greedy_logprobs" (or "prompt_logprobs").
pub struct GreedyLogprobs {
    pub logprob: Vec<f64>,
    pub top_ids: Vec<Vec<i64>>,
    pub top_logprobs: Vec<Vec<f64>>,
}

pub fn expected() -> Expected {
    let text = std::fs::read_to_string(fixture("tiny_decoder.expected.json")).unwrap();
    let json = json::parse(&text);
    let lists = |key: &str| json.get(key).as_array().iter().map(|v| v.as_ids()).collect::<Vec<_>>();
    let count = |key: &str| json.get(key).as_i64() as usize;
    let logprobs = |key: &str| {
        json.get(key)
            .as_array()
            .iter()
            .map(|p| {
                let floats = |v: &json::Value| v.as_array().iter().map(json::Value::as_f64).collect::<Vec<_>>();
                GreedyLogprobs {
                    logprob: floats(p.get("logprob")),
                    top_ids: p.get("top_ids").as_array().iter().map(|v| v.as_ids()).collect(),
                    top_logprobs: p.get("top_logprobs").as_array().iter().map(floats).collect(),
                }
            })
            .collect()
    };
    Expected {
        prompts: lists("prompts"),
        max_new_tokens: count("max_new_tokens"),
        greedy: lists("greedy"),
        greedy_logprobs: logprobs("greedy_logprobs"),
        prompt_logprobs: logprobs("prompt_logprobs"),
        vocab: count("vocab"),
        slots: count("slots"),
        max_len: count("max_len"),
        max_len_prompt: json.get("max_len_prompt").as_ids(),
        max_len_greedy: json.get("max_len_greedy").as_ids(),
    }
}

/// A generator of the decoder fixture `name` cut in two stages.
pub fn generator_of(name: &str, options: &GeneratorOptions) -> Generator {
    if name.starts_with("gated") {
        gate::init();
    }
    let model = Model::load(fixture(name)).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point(SPLIT)).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    Generator::new(&plan, &SessionOptions::new(), options).unwrap()
}

/// tiny_decoder.pt cut in two, default options.
pub fn tiny_generator() -> Generator {
    generator_of("tiny_decoder.pt", &GeneratorOptions::default())
}

/// A prompt for the gated decoders that holds its prefill step at `key` (1..=8) in stage1.
pub fn held_prompt(key: &gate::Key, rest: &[i64]) -> Vec<i64> {
    assert!((1..=8).contains(&key.value()), "gate key {} does not fit a token id 120..127", key.value());
    let mut prompt = vec![FAIL_ID + key.value()];
    prompt.extend_from_slice(rest);
    prompt
}

/// Just enough JSON to read the fixture's expectations and libpipe's traces (numbers, arrays,
/// objects, strings, literals), so that the tests need no JSON crate.
pub mod json {
    #[derive(Debug, Clone, PartialEq)]
    pub enum Value {
        Null,
        Bool(bool),
        Number(f64),
        String(String),
        Array(Vec<Value>),
        Object(Vec<(String, Value)>),
    }

    impl Value {
        pub fn get(&self, key: &str) -> &Value {
            match self {
                Value::Object(entries) => {
                    entries.iter().find(|(k, _)| k == key).map(|(_, v)| v).unwrap_or_else(|| panic!("no key {key:?}"))
                }
                other => panic!("{other:?} is not an object"),
            }
        }

        pub fn as_array(&self) -> &[Value] {
            match self {
                Value::Array(items) => items,
                other => panic!("{other:?} is not an array"),
            }
        }

        pub fn as_i64(&self) -> i64 {
            match self {
                Value::Number(n) if n.fract() == 0.0 => *n as i64,
                other => panic!("{other:?} is not an integer"),
            }
        }

        pub fn as_ids(&self) -> Vec<i64> {
            self.as_array().iter().map(Value::as_i64).collect()
        }

        pub fn as_f64(&self) -> f64 {
            match self {
                Value::Number(n) => *n,
                other => panic!("{other:?} is not a number"),
            }
        }

        pub fn as_str(&self) -> &str {
            match self {
                Value::String(s) => s,
                other => panic!("{other:?} is not a string"),
            }
        }

        pub fn as_object(&self) -> &[(String, Value)] {
            match self {
                Value::Object(entries) => entries,
                other => panic!("{other:?} is not an object"),
            }
        }

        /// The value of `key`, if this object has one.
        pub fn find(&self, key: &str) -> Option<&Value> {
            self.as_object().iter().find(|(k, _)| k == key).map(|(_, v)| v)
        }
    }

    pub fn parse(text: &str) -> Value {
        let mut p = Parser { s: text.as_bytes(), i: 0 };
        let v = p.value();
        p.ws();
        assert_eq!(p.i, p.s.len(), "trailing characters after the JSON value");
        v
    }

    struct Parser<'a> {
        s: &'a [u8],
        i: usize,
    }

    impl Parser<'_> {
        fn ws(&mut self) {
            while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
                self.i += 1;
            }
        }

        fn peek(&mut self) -> u8 {
            self.ws();
            *self.s.get(self.i).unwrap_or_else(|| panic!("JSON ends early"))
        }

        fn expect(&mut self, c: u8) {
            assert_eq!(self.peek(), c, "JSON: expected {:?} at byte {}", c as char, self.i);
            self.i += 1;
        }

        fn value(&mut self) -> Value {
            match self.peek() {
                b'{' => {
                    self.i += 1;
                    let mut entries = Vec::new();
                    if self.peek() == b'}' {
                        self.i += 1;
                        return Value::Object(entries);
                    }
                    loop {
                        let key = self.string();
                        self.expect(b':');
                        entries.push((key, self.value()));
                        match self.peek() {
                            b',' => self.i += 1,
                            _ => break,
                        }
                    }
                    self.expect(b'}');
                    Value::Object(entries)
                }
                b'[' => {
                    self.i += 1;
                    let mut items = Vec::new();
                    if self.peek() == b']' {
                        self.i += 1;
                        return Value::Array(items);
                    }
                    loop {
                        items.push(self.value());
                        match self.peek() {
                            b',' => self.i += 1,
                            _ => break,
                        }
                    }
                    self.expect(b']');
                    Value::Array(items)
                }
                b'"' => Value::String(self.string()),
                b't' => self.literal("true", Value::Bool(true)),
                b'f' => self.literal("false", Value::Bool(false)),
                b'n' => self.literal("null", Value::Null),
                _ => self.number(),
            }
        }

        fn literal(&mut self, word: &str, value: Value) -> Value {
            assert!(self.s[self.i..].starts_with(word.as_bytes()), "JSON: bad literal at byte {}", self.i);
            self.i += word.len();
            value
        }

        fn number(&mut self) -> Value {
            let start = self.i;
            while self.i < self.s.len() && matches!(self.s[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                self.i += 1;
            }
            let text = std::str::from_utf8(&self.s[start..self.i]).unwrap();
            Value::Number(text.parse().unwrap_or_else(|_| panic!("JSON: bad number {text:?} at byte {start}")))
        }

        /// A string without escapes beyond \" and \\ (the fixture's keys).
        fn string(&mut self) -> String {
            self.expect(b'"');
            let mut out = Vec::new();
            while self.s[self.i] != b'"' {
                if self.s[self.i] == b'\\' {
                    self.i += 1;
                }
                out.push(self.s[self.i]);
                self.i += 1;
            }
            self.i += 1;
            String::from_utf8(out).unwrap()
        }
    }
}
