//! Text generation with libpipe from Rust: a language model cut into pipeline stages, text in and
//! text out through the model's own tokenizer (the `tokenizers` crate reading `tokenizer.json`).
//! Every prompt is submitted at once, so their steps share the pipeline; each answer is printed as
//! its tokens arrive, in prompt order, one answer per line.
//!
//!     generate MODEL_DIR [options] PROMPT...
//!
//! MODEL_DIR holds
//!   decoder.pt               the decoder (`python -m libpipe.export_llm MODEL_DIR MODEL_DIR/decoder.pt`
//!                            writes one for a Hugging Face Llama, Qwen2, Mistral or GPT-2 folder)
//!   model.safetensors        its weights (or model.safetensors.index.json; neither: the decoder's own)
//!   tokenizer.json           the tokenizer
//!   generation_config.json   optional: its eos_token_id ends an answer
//!
//! Options:
//!   --stages N               cut into N stages of equal numbers of layers (default 2)
//!   --split-at FQN:begin     cut there instead (repeatable)
//!   --max-new-tokens N       tokens per answer at most (default 64)
//!   --temperature T, --top-k K, --top-p P, --seed S   sampling (default greedy)
//!   --chat                   send each prompt as a user turn of a ChatML conversation (the chat
//!                            format of SmolLM2 and Qwen2), ending with the assistant's turn
//!   --system TEXT            with --chat: a system turn first (SmolLM2's own template adds
//!                            "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
//!
//! Statistics go to stderr. Exit status 2 for a bad command line, 1 for any other error.

use std::collections::VecDeque;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use pipe::{
    GenerationOptions, Generator, GeneratorOptions, Model, Plan, PlanOptions, Policy, SessionOptions, StageOptions,
    Status,
};
use tokenizers::Tokenizer;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

struct Args {
    model_dir: PathBuf,
    stages: usize,
    split_points: Vec<String>,
    options: GenerationOptions,
    chat: bool,
    system: Option<String>,
    prompts: Vec<String>,
}

const USAGE: &str = "usage: generate MODEL_DIR [--stages N | --split-at FQN:begin ...] [--max-new-tokens N] \
                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--chat [--system TEXT]] PROMPT...";

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1).collect()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_args(argv: Vec<String>) -> std::result::Result<Args, String> {
    let mut args = Args {
        model_dir: PathBuf::new(),
        stages: 2,
        split_points: Vec::new(),
        options: GenerationOptions { max_new_tokens: 64, ..Default::default() },
        chat: false,
        system: None,
        prompts: Vec::new(),
    };
    let mut positional = Vec::new();
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        if !arg.starts_with("--") {
            positional.push(arg);
            continue;
        }
        if arg == "--chat" {
            args.chat = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{arg} needs a value"))?;
        let number = |what: &str| format!("{arg} takes {what}, not {value:?}");
        match arg.as_str() {
            "--stages" => args.stages = value.parse().map_err(|_| number("a number of stages"))?,
            "--split-at" => args.split_points.push(value),
            "--max-new-tokens" => args.options.max_new_tokens = value.parse().map_err(|_| number("a count"))?,
            "--temperature" => args.options.temperature = value.parse().map_err(|_| number("a number"))?,
            "--top-k" => args.options.top_k = value.parse().map_err(|_| number("a count"))?,
            "--top-p" => args.options.top_p = value.parse().map_err(|_| number("a number"))?,
            "--seed" => args.options.seed = value.parse().map_err(|_| number("an unsigned integer"))?,
            "--system" => args.system = Some(value),
            _ => return Err(format!("unknown option {arg}")),
        }
    }
    if positional.len() < 2 {
        return Err("give a model folder and at least one prompt".into());
    }
    args.model_dir = PathBuf::from(positional.remove(0));
    args.prompts = positional;
    if args.system.is_some() && !args.chat {
        return Err("--system goes with --chat".into());
    }
    Ok(args)
}

fn run(args: &Args) -> Result<()> {
    let dir = &args.model_dir;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| format!("cannot read {}: {e}", dir.join("tokenizer.json").display()))?;
    let model = Model::load(dir.join("decoder.pt"))?;
    let plan_options = if args.split_points.is_empty() {
        PlanOptions::new().stages(args.stages, Policy::Uniform)
    } else {
        args.split_points.iter().fold(PlanOptions::new(), |o, s| o.split_point(s.as_str()))
    };
    let plan = Plan::new(&model, &plan_options)?;
    let mut session_options = SessionOptions::new();
    if let Some(weights) = weights_file(dir) {
        session_options = session_options.stage_options(StageOptions { weights: Some(weights), ..Default::default() });
    }
    let generator = Generator::new(&plan, &session_options, &GeneratorOptions::default())?;
    let info = generator.info()?;
    let options = GenerationOptions { stop_ids: stop_ids(dir)?, ..args.options.clone() };

    // Submit every prompt; when the generator's queue is full (Busy), print the oldest answer
    // first, which makes room, and submit again.
    let mut answers = VecDeque::new();
    for prompt in &args.prompts {
        let text = if args.chat { chat(args.system.as_deref(), prompt) } else { prompt.clone() };
        let ids: Vec<i64> = tokenizer
            .encode(text.as_str(), !args.chat)
            .map_err(|e| format!("cannot tokenize {prompt:?}: {e}"))?
            .get_ids()
            .iter()
            .map(|&id| i64::from(id))
            .collect();
        loop {
            match generator.generate(&ids, &options) {
                Ok(generation) => break answers.push_back(generation),
                Err(e) if e.status == Status::Busy && !answers.is_empty() => {
                    print_answer(&tokenizer, answers.pop_front().unwrap())?
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    while let Some(generation) = answers.pop_front() {
        print_answer(&tokenizer, generation)?;
    }

    let stats = generator.stats()?;
    eprintln!(
        "libpipe {}: {} stages, {} sequences ({} slots), {} tokens, {:.1} tokens/s, first token after {:.1} ms",
        pipe::version(),
        plan.num_stages()?,
        stats.sequences_finished,
        info.slots,
        stats.generated_tokens,
        stats.tokens_per_s,
        stats.mean_time_to_first_token_ms
    );
    Ok(())
}

/// Prints one answer as its tokens arrive, then a newline. The text so far is decoded again after
/// every token and only what it adds is printed: a token may end inside a character (byte-level
/// tokenizers), which decodes to U+FFFD until the next token completes it.
fn print_answer(tokenizer: &Tokenizer, generation: pipe::Generation) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let mut ids: Vec<u32> = Vec::new();
    let mut printed = String::new();
    for token in generation {
        let token = token?;
        ids.push(u32::try_from(token).map_err(|_| format!("token id {token} is not a tokenizer id"))?);
        let text = tokenizer.decode(&ids, true).map_err(|e| format!("cannot decode {ids:?}: {e}"))?;
        if text.starts_with(printed.as_str()) && !text.ends_with('\u{FFFD}') {
            out.write_all(&text.as_bytes()[printed.len()..])?;
            out.flush()?;
            printed = text;
        }
    }
    let text = tokenizer.decode(&ids, true).map_err(|e| format!("cannot decode {ids:?}: {e}"))?;
    if let Some(rest) = text.strip_prefix(printed.as_str()) {
        out.write_all(rest.as_bytes())?;
    }
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// ChatML: a user turn (after a system turn, if any) and the start of the assistant's.
fn chat(system: Option<&str>, prompt: &str) -> String {
    let mut text = String::new();
    if let Some(system) = system {
        text += &format!("<|im_start|>system\n{system}<|im_end|>\n");
    }
    text + &format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// The checkpoint in MODEL_DIR, if any: sharded (the index) or one file.
fn weights_file(dir: &Path) -> Option<PathBuf> {
    ["model.safetensors.index.json", "model.safetensors"].iter().map(|name| dir.join(name)).find(|p| p.is_file())
}

/// generation_config.json's eos_token_id (a number or a list), if the file is there.
fn stop_ids(dir: &Path) -> Result<Vec<i64>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path)?).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(match &config["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(ids) => ids.iter().filter_map(serde_json::Value::as_i64).collect(),
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn command_line() {
        let a = parse_args(argv("dir --split-at a:begin --max-new-tokens 5 --seed 3 --top-p 0.5 hello there")).unwrap();
        assert_eq!(a.model_dir, PathBuf::from("dir"));
        assert_eq!(a.split_points, vec!["a:begin"]);
        assert_eq!((a.options.max_new_tokens, a.options.seed, a.options.top_p), (5, 3, 0.5));
        assert_eq!(a.prompts, vec!["hello", "there"]);
        assert_eq!(a.stages, 2);
        for bad in ["dir", "dir --top-k x p", "dir --bogus 1 p", "dir --system s p", "dir p --seed"] {
            assert!(parse_args(argv(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn chatml() {
        assert_eq!(chat(None, "hi"), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(
            chat(Some("be brief"), "hi"),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
