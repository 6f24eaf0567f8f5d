//! Chat with a language model from Rust: text in and out through libpipe alone. The model
//! folder's own tokenizer and chat template (libpipe reads tokenizer.json and
//! tokenizer_config.json; no tokenizer crate here) turn the question into token ids; the decoder,
//! cut into 2 pipeline stages, generates greedily until one of the model's stop ids; a decode
//! stream prints the reply as its tokens arrive.
//!
//!     chat [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]
//!
//! MODEL_DIR is a Hugging Face model folder (tokenizer.json, tokenizer_config.json,
//! generation_config.json, model.safetensors) holding decoder.pt, which
//! `python -m libpipe.export_llm MODEL_DIR MODEL_DIR/decoder.pt --max-batch 1` writes.
//! --prompt-ids first prints the prompt's token ids on a line of their own.

use std::error::Error;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use pipe::{
    GenerationOptions, Generator, GeneratorOptions, Model, Plan, PlanOptions, Policy, SessionOptions, StageOptions,
    Tokenizer,
};

const USAGE: &str = "usage: chat [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]";

fn main() -> ExitCode {
    let (mut max_new_tokens, mut print_ids, mut positional) = (64, false, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--max-new-tokens" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) => max_new_tokens = n,
                None => return usage(),
            },
            "--prompt-ids" => print_ids = true,
            _ if arg.starts_with('-') => return usage(),
            _ => positional.push(arg),
        }
    }
    let (dir, question) = match positional.as_slice() {
        [dir] => (dir, "What is the capital of France?"),
        [dir, question] => (dir, question.as_str()),
        _ => return usage(),
    };
    match chat(Path::new(dir), question, max_new_tokens, print_ids) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

fn chat(dir: &Path, question: &str, max_new_tokens: usize, print_ids: bool) -> Result<(), Box<dyn Error>> {
    let tokenizer = Tokenizer::load(dir)?;
    // The conversation through the model's chat template (SmolLM2's adds its default system
    // turn), encoded without added special tokens: the template writes them as text.
    let text = tokenizer.apply_chat_template(&[("user", question)], true)?;
    let prompt = tokenizer.encode(&text, false)?;
    if print_ids {
        println!("{}", prompt.iter().map(i64::to_string).collect::<Vec<_>>().join(" "));
    }

    // The decoder in 2 stages of equal layers; its weights are the checkpoint's, unchanged.
    let model = Model::load(dir.join("decoder.pt"))?;
    let plan = Plan::new(&model, &PlanOptions::new().stages(2, Policy::Uniform))?;
    let weights = StageOptions { weights: Some(dir.join("model.safetensors")), ..Default::default() };
    let generator = Generator::new(&plan, &SessionOptions::new().stage_options(weights), &GeneratorOptions::default())?;

    // Greedy (the default), ending at the model's stop ids (generation_config.json's eos).
    let options = GenerationOptions { max_new_tokens, stop_ids: tokenizer.stop_ids().to_vec(), ..Default::default() };
    let generation = generator.generate(&prompt, &options)?;
    // Whole characters only (a token may end inside one), without <|im_end|>.
    let mut stream = tokenizer.decode_stream(true)?;
    let mut out = std::io::stdout().lock();
    for token in generation {
        // ids as they come; an error ends the loop with it
        out.write_all(stream.push(token?)?.as_bytes())?;
        out.flush()?;
    }
    writeln!(out)?;
    Ok(())
}
