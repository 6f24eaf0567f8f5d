//! Text generation with libpipe from Rust: a language model cut into pipeline stages, text in and
//! text out through the model's own tokenizer, which libpipe loads from the model folder (no
//! tokenizer crate here).
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
//!   tokenizer_config.json    optional: its chat template (for --chat) and special tokens
//!   generation_config.json   optional: its eos_token_id ends an answer
//!
//! Options:
//!   --stages N               cut into N stages of equal numbers of layers (default 2)
//!   --split-at FQN:begin     cut there instead (repeatable)
//!   --max-new-tokens N       tokens per answer at most (default 64)
//!   --temperature T, --top-k K, --top-p P, --seed S   sampling (default greedy)
//!   --chat                   send each prompt as a user turn through the model's chat template,
//!                            ending with the assistant's opening
//!   --system TEXT            with --chat: a system turn first (without one, SmolLM2's template
//!                            adds its own)
//!
//! Statistics go to stderr. Exit status 2 for a bad command line, 1 for any other error.

use std::collections::VecDeque;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use pipe::{
    GenerationOptions, Generator, GeneratorOptions, Model, Plan, PlanOptions, Policy, SessionOptions, StageOptions,
    Status, Tokenizer,
};

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
    let tokenizer = Tokenizer::load(dir)?;
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
    // The model's stop ids: generation_config.json's eos_token_id and the tokenizer's eos token.
    let options = GenerationOptions { stop_ids: tokenizer.stop_ids().to_vec(), ..args.options.clone() };

    // Submit every prompt; when the generator's queue is full (Busy), print the oldest answer
    // first, which makes room, and submit again.
    let mut answers = VecDeque::new();
    for prompt in &args.prompts {
        // A chat template writes the special tokens itself, so its text is encoded without them.
        let ids = if args.chat {
            tokenizer.encode(&chat(&tokenizer, args.system.as_deref(), prompt)?, false)?
        } else {
            tokenizer.encode(prompt, true)?
        };
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

/// Prints one answer as its tokens arrive, then a newline. The decode stream gives whole
/// characters only: a token may end inside one (byte-level tokenizers).
fn print_answer(tokenizer: &Tokenizer, generation: pipe::Generation) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let mut stream = tokenizer.decode_stream(true)?;
    for token in generation {
        out.write_all(stream.push(token?)?.as_bytes())?;
        out.flush()?;
    }
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// The model's chat template over a user turn (after a system turn, if any), ending with the
/// assistant's opening.
fn chat(tokenizer: &Tokenizer, system: Option<&str>, prompt: &str) -> Result<String> {
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(("system", system));
    }
    messages.push(("user", prompt));
    Ok(tokenizer.apply_chat_template(&messages, true)?)
}

/// The checkpoint in MODEL_DIR, if any: sharded (the index) or one file.
fn weights_file(dir: &Path) -> Option<PathBuf> {
    ["model.safetensors.index.json", "model.safetensors"].iter().map(|name| dir.join(name)).find(|p| p.is_file())
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
}
