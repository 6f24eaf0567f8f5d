//! Token generation from a decoder (pipe.h's "Generation" section): a [`Generator`] owns a
//! session of the decoder's plan and drives it step by step; each [`Generator::generate`] starts
//! one sequence, a [`Generation`], whose tokens are read as they come.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::path::Path;
use std::ptr::{self, NonNull};
use std::time::Duration;

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::generation::Generation;
use crate::plan::Plan;
use crate::session::{duration_ms, Session, SessionOptions, StageStats};

/// How a [`Generator`] schedules its sequences. Zero in a field means libpipe's default (the
/// values `GeneratorOptions::default()` has, read from pipe_generator_options_init).
///
/// ```
/// let options = pipe::GeneratorOptions { max_queued: 8, ..Default::default() };
/// # let _ = options;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeneratorOptions {
    /// Sequences that may wait for a free cache slot; one more makes [`Generator::generate`]
    /// fail with [`Status::Busy`]. 0: 4 x the decoder's slots.
    pub max_queued: usize,
    /// Tokens per step, all rows together (a decoder without skips_padding: padded positions, rows x
    /// the longest chunk): a longer prompt is prefilled in chunks, so that it does not hold up the
    /// others for long. 0: 256.
    pub prefill_chunk: usize,
    /// Steps in the pipeline at once. 0: the stages that compute at once (every stage busy): the
    /// number of stages, or of worker threads when stages share the cores.
    pub steps_in_flight: usize,
    /// Rows (sequences) in one step. 0: the decoder's slots.
    pub max_rows_per_step: usize,
}

impl Default for GeneratorOptions {
    fn default() -> GeneratorOptions {
        // Fails only if the loaded libpipe refuses the size of the pipe.h this crate was built
        // with, i.e. it is not the libpipe that header belongs to.
        let raw = crate::defaults::generator_options()
            .unwrap_or_else(|e| panic!("libpipe does not match the pipe.h this crate was built with: {e}"));
        let count = |n: i64| usize::try_from(n).unwrap_or(0);
        GeneratorOptions {
            max_queued: count(raw.max_queued),
            prefill_chunk: count(raw.prefill_chunk),
            steps_in_flight: count(raw.steps_in_flight),
            max_rows_per_step: count(raw.max_rows_per_step),
        }
    }
}

pub(crate) fn to_i64(what: &str, n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| Error::new(Status::InvalidArgument, format!("{what} = {n} is too large")))
}

impl GeneratorOptions {
    fn to_raw(self) -> Result<sys::pipe_generator_options> {
        let mut raw = crate::defaults::generator_options()?;
        raw.max_queued = to_i64("max_queued", self.max_queued)?;
        raw.prefill_chunk = to_i64("prefill_chunk", self.prefill_chunk)?;
        raw.steps_in_flight = to_i64("steps_in_flight", self.steps_in_flight)?;
        raw.max_rows_per_step = to_i64("max_rows_per_step", self.max_rows_per_step)?;
        Ok(raw)
    }
}

/// One sequence's options. `GenerationOptions::default()` is libpipe's own
/// (pipe_generation_options_init: 16 tokens, greedy, no stop ids, no deadline).
///
/// ```
/// use std::time::Duration;
/// let options = pipe::GenerationOptions {
///     max_new_tokens: 64,
///     temperature: 0.7,
///     top_p: 0.9,
///     seed: 42,
///     stop_ids: vec![2],
///     timeout: Some(Duration::from_secs(30)),
///     ..Default::default()
/// };
/// # let _ = options;
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationOptions {
    /// Tokens to generate at most (>= 1). The sequence also ends once the decoder's
    /// [`GeneratorInfo::max_len`] is full.
    pub max_new_tokens: usize,
    /// 0: greedy (the most likely token). Otherwise the logits are divided by it before sampling.
    pub temperature: f64,
    /// Sample among the `top_k` most likely tokens; 0: all.
    pub top_k: usize,
    /// Sample among the smallest set of most likely tokens whose probability reaches `top_p`, in
    /// (0, 1]; 1: all. Applied after `top_k`.
    pub top_p: f64,
    /// This sequence's random generator: equal seeds and logits give equal tokens.
    pub seed: u64,
    /// Token ids that end the sequence (the stop id is its last token).
    pub stop_ids: Vec<i64>,
    /// The sequence fails with [`Status::DeadlineExceeded`] if it has not finished this long after
    /// [`Generator::generate`] (waiting for a slot included). None: no deadline. Rounded up to
    /// whole milliseconds; `Some(Duration::ZERO)` is refused ([`Status::InvalidArgument`]).
    pub timeout: Option<Duration>,
    /// Keep each token's log-probability under the model's distribution at its position (the
    /// log-softmax of the logits, before `temperature`, `top_k` and `top_p`), read with
    /// [`Generation::logprobs`].
    pub logprobs: bool,
    /// With `logprobs` or `prompt_logprobs`: also the log-probabilities of this many of the
    /// likeliest tokens at each position, 0..=20 ([`GenerationOptions::MAX_TOP_LOGPROBS`], as
    /// OpenAI's API allows).
    pub top_logprobs: usize,
    /// Score the prompt too (libpipe >= 0.15): each prompt token's log-probability given the
    /// tokens before it, with `top_logprobs` alternatives, read with
    /// [`Generation::prompt_logprobs`] (OpenAI's echo with logprobs; perplexity). The prompt then
    /// crosses the pipeline one token a step, like generated tokens, and none of it is taken from
    /// a cache slot (prefix reuse).
    pub prompt_logprobs: bool,
}

impl Default for GenerationOptions {
    fn default() -> GenerationOptions {
        // As GeneratorOptions::default: fails only for a libpipe that is not this pipe.h's.
        let raw = crate::defaults::generation_options()
            .unwrap_or_else(|e| panic!("libpipe does not match the pipe.h this crate was built with: {e}"));
        GenerationOptions {
            max_new_tokens: usize::try_from(raw.max_new_tokens).unwrap_or(0),
            temperature: raw.temperature,
            top_k: usize::try_from(raw.top_k).unwrap_or(0),
            top_p: raw.top_p,
            seed: raw.seed,
            stop_ids: Vec::new(),
            timeout: None,
            logprobs: raw.logprobs != 0,
            top_logprobs: usize::try_from(raw.top_logprobs).unwrap_or(0),
            prompt_logprobs: raw.prompt_logprobs != 0,
        }
    }
}

impl GenerationOptions {
    /// The most alternatives [`GenerationOptions::top_logprobs`] may ask for.
    pub const MAX_TOP_LOGPROBS: usize = 20;

    /// libpipe's form; `stop_ids` points into `self`, which must outlive its use (libpipe copies
    /// the ids during pipe_generator_submit).
    fn to_raw(&self) -> Result<sys::pipe_generation_options> {
        let mut raw = crate::defaults::generation_options()?;
        raw.max_new_tokens = to_i64("max_new_tokens", self.max_new_tokens)?;
        raw.temperature = self.temperature;
        raw.top_k = to_i64("top_k", self.top_k)?;
        raw.top_p = self.top_p;
        raw.seed = self.seed;
        if !self.stop_ids.is_empty() {
            raw.stop_ids = self.stop_ids.as_ptr();
            raw.num_stop_ids = self.stop_ids.len();
        }
        raw.timeout_ms = match self.timeout {
            None => 0,
            // libpipe reads 0 as "no deadline": refuse it rather than turn it into none.
            Some(d) if d.is_zero() => {
                return Err(Error::new(
                    Status::InvalidArgument,
                    "timeout must be positive; use None for a generation without a deadline",
                ))
            }
            Some(d) => duration_ms(d),
        };
        if self.top_logprobs > Self::MAX_TOP_LOGPROBS {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("top_logprobs is {}; give 0..={}", self.top_logprobs, Self::MAX_TOP_LOGPROBS),
            ));
        }
        raw.logprobs = i32::from(self.logprobs);
        raw.prompt_logprobs = i32::from(self.prompt_logprobs);
        // In range (above); libpipe refuses top_logprobs without logprobs or prompt_logprobs,
        // naming them.
        raw.top_logprobs = self.top_logprobs as i32;
        Ok(raw)
    }
}

/// What the decoder offers, read when the generator was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GeneratorInfo {
    /// Sequences that can hold a cache slot at once.
    pub slots: usize,
    /// Tokens per sequence, prompt and generated together.
    pub max_len: usize,
    /// Token ids are 0 .. vocab - 1.
    pub vocab: usize,
    /// Bytes of K and V of every layer for one slot, all stages together.
    pub cache_bytes_per_slot: u64,
}

/// What a generator has done since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GeneratorStats {
    /// Sequences holding a cache slot now.
    pub slots_in_use: usize,
    /// Sequences waiting for a slot now.
    pub queued: usize,
    /// Sequences that ended, for any reason.
    pub sequences_finished: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens sampled and delivered.
    pub generated_tokens: u64,
    /// Steps run through the pipeline.
    pub steps: u64,
    /// Generated tokens per second while a sequence held a slot.
    pub tokens_per_s: f64,
    /// Over the sequences that got a first token; 0 before any.
    pub mean_time_to_first_token_ms: f64,
    /// Over every gap between two tokens of a sequence; 0 before any.
    pub mean_inter_token_ms: f64,
    /// Sequences per step.
    pub mean_rows_per_step: f64,
    /// Time spent sampling, all steps together.
    pub sampling_ms: f64,
    /// The engine's limit of steps in flight now: one per stage, or 1 where it measured that one
    /// step at a time with every core on it is faster (stages sharing this process's cores).
    pub steps_in_flight: usize,
    /// Steps launched while the limit was 1.
    pub steps_one_at_a_time: u64,
    /// Steps launched while it was more.
    pub steps_pipelined: u64,
    /// Prompt tokens found in cache slots instead of prefilled (prefix reuse).
    pub cached_prompt_tokens: u64,
}

/// A decoder's session driven step by step: sequences ([`Generator::generate`]) are admitted
/// while cache slots are free and queue otherwise (at most [`GeneratorOptions::max_queued`]);
/// the prefill and decode steps of many sequences are batched and pipelined across the stages.
///
/// The model must follow pipe.h's decoder contract (`python -m libpipe.export_llm` writes one
/// for Hugging Face Llama, Qwen2, Mistral and GPT-2 models). Dropping the generator cancels
/// every generation still going (they end with [`Status::Cancelled`]) and waits for the steps in
/// flight; the [`Generation`]s themselves stay usable.
///
/// ```no_run
/// use pipe::{GenerationOptions, Generator, GeneratorOptions, Model, Plan, PlanOptions, SessionOptions};
///
/// # fn main() -> pipe::Result<()> {
/// let model = Model::load("decoder.pt")?;
/// let plan = Plan::new(&model, &PlanOptions::new().split_point("model.layers.1:begin"))?;
/// let generator = Generator::new(&plan, &SessionOptions::new(), &GeneratorOptions::default())?;
/// let options = GenerationOptions { max_new_tokens: 8, ..Default::default() };
/// for token in generator.generate(&[1, 2, 3], &options)? {
///     println!("{}", token?);
/// }
/// # Ok(())
/// # }
/// ```
pub struct Generator {
    ptr: NonNull<sys::pipe_generator>,
}

// SAFETY: pipe.h marks pipe_generator_create thread-safe on the plan, and get_info, session,
// submit and get_stats thread-safe; every &self method here calls only those.
// pipe_generator_destroy is exclusive and runs in Drop, with sole ownership. Nothing ties a
// generator to the thread that created it.
unsafe impl Send for Generator {}
unsafe impl Sync for Generator {}

impl Generator {
    /// Build a session of `plan` as [`Session::new`] does (the micro-batch settings of
    /// `session_options` are ignored: a step is one micro-batch) and check that the model follows
    /// the decoder contract by running one step of one token. [`Status::InvalidArgument`] when it
    /// does not (the message says what differs) or for bad options; otherwise
    /// [`Session::new`]'s errors.
    pub fn new(plan: &Plan, session_options: &SessionOptions, options: &GeneratorOptions) -> Result<Generator> {
        let session = session_options.to_raw()?;
        let raw = options.to_raw()?;
        let mut generator = ptr::null_mut();
        // SAFETY: thread-safe on the plan; the options and what they point into outlive the call.
        check(unsafe { sys::pipe_generator_create(plan.as_ptr(), &session.raw, &raw, &mut generator) })?;
        NonNull::new(generator)
            .map(|ptr| Generator { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL generator"))
    }

    /// What the decoder offers: slots, maximum length, vocabulary, cache bytes per slot.
    pub fn info(&self) -> Result<GeneratorInfo> {
        let mut raw = crate::defaults::generator_info()?;
        // SAFETY: thread-safe; fills the fields struct_size covers.
        check(unsafe { sys::pipe_generator_get_info(self.ptr.as_ptr(), &mut raw) })?;
        let count = |n: i64| usize::try_from(n).unwrap_or(0);
        Ok(GeneratorInfo {
            slots: count(raw.slots),
            max_len: count(raw.max_len),
            vocab: count(raw.vocab),
            cache_bytes_per_slot: raw.cache_bytes_per_slot,
        })
    }

    /// What the generator has done since it was created.
    pub fn stats(&self) -> Result<GeneratorStats> {
        let mut raw = crate::defaults::generator_stats()?;
        // SAFETY: thread-safe; fills the fields struct_size covers.
        check(unsafe { sys::pipe_generator_get_stats(self.ptr.as_ptr(), &mut raw) })?;
        let count = |n: i64| usize::try_from(n).unwrap_or(0);
        Ok(GeneratorStats {
            slots_in_use: count(raw.slots_in_use),
            queued: count(raw.queued),
            sequences_finished: raw.sequences_finished,
            prompt_tokens: raw.prompt_tokens,
            generated_tokens: raw.generated_tokens,
            steps: raw.steps,
            tokens_per_s: raw.tokens_per_s,
            mean_time_to_first_token_ms: raw.mean_time_to_first_token_ms,
            mean_inter_token_ms: raw.mean_inter_token_ms,
            mean_rows_per_step: raw.mean_rows_per_step,
            sampling_ms: raw.sampling_ms,
            steps_in_flight: count(raw.steps_in_flight),
            steps_one_at_a_time: raw.steps_one_at_a_time,
            steps_pipelined: raw.steps_pipelined,
            cached_prompt_tokens: raw.cached_prompt_tokens,
        })
    }

    /// The generator's session, for its stage statistics, traces and health check.
    pub fn session(&self) -> Result<GeneratorSession<'_>> {
        let mut session = ptr::null_mut();
        // SAFETY: thread-safe; the session is borrowed from the generator.
        check(unsafe { sys::pipe_generator_session(self.ptr.as_ptr(), &mut session) })?;
        let ptr =
            NonNull::new(session).ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL session"))?;
        // SAFETY: valid until pipe_generator_destroy, which runs in Drop of the generator that
        // the result borrows.
        Ok(GeneratorSession { session: unsafe { Session::borrowed(ptr) }, _generator: PhantomData })
    }

    /// Start generating after `prompt` (token ids, copied) and return at once: the sequence
    /// queues when no cache slot is free. Read its tokens from the [`Generation`] (an iterator,
    /// or [`Generation::next_async`]).
    ///
    /// Errors: [`Status::InvalidArgument`] for an empty prompt, an id outside 0 .. vocab - 1, a
    /// prompt that leaves no room for one token in the decoder's maximum length, or bad options
    /// (the message names them); [`Status::Busy`] when [`GeneratorOptions::max_queued`]
    /// sequences already wait for a slot (nothing was started: retry once a generation has
    /// finished); [`Status::Communication`] when the session is broken.
    pub fn generate(&self, prompt: &[i64], options: &GenerationOptions) -> Result<Generation> {
        let raw = options.to_raw()?;
        let mut generation = ptr::null_mut();
        // SAFETY: thread-safe; libpipe copies the prompt and the stop ids (which `options` holds)
        // before returning.
        check(unsafe {
            sys::pipe_generator_submit(self.ptr.as_ptr(), prompt.as_ptr(), prompt.len(), &raw, &mut generation)
        })?;
        let ptr = NonNull::new(generation)
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL generation"))?;
        // SAFETY: a generation libpipe just made, owned by nothing else.
        let generation = unsafe { Generation::from_raw(ptr) };
        let generation = if options.logprobs { generation.keeping_logprobs(options.top_logprobs) } else { generation };
        Ok(if options.prompt_logprobs {
            generation.keeping_prompt_logprobs(options.top_logprobs, prompt.len())
        } else {
            generation
        })
    }
}

impl Drop for Generator {
    fn drop(&mut self) {
        // SAFETY: exclusive (we own it, so no &self call is running). Generations still going
        // are cancelled and stay valid until their own Drop.
        unsafe { sys::pipe_generator_destroy(self.ptr.as_ptr()) }
    }
}

/// A [`Generator`]'s session, borrowed from it ([`Generator::session`]): what libpipe allows on
/// it, the stage statistics, traces and health check. Running or submitting calls on it is not
/// offered: the generator alone drives it.
pub struct GeneratorSession<'a> {
    session: ManuallyDrop<Session>,
    _generator: PhantomData<&'a Generator>,
}

impl GeneratorSession<'_> {
    /// [`Session::check`].
    pub fn check(&self) -> Result<()> {
        self.session.check()
    }

    /// [`Session::num_stages`].
    pub fn num_stages(&self) -> Result<usize> {
        self.session.num_stages()
    }

    /// [`Session::stage_stats`]: a stage's micro-batches are the generator's steps.
    pub fn stage_stats(&self, stage: usize) -> Result<StageStats> {
        self.session.stage_stats(stage)
    }

    /// [`Session::stats`].
    pub fn stats(&self) -> Result<Vec<StageStats>> {
        self.session.stats()
    }

    /// [`Session::trace_start`].
    pub fn trace_start(&self) -> Result<()> {
        self.session.trace_start()
    }

    /// [`Session::trace_start_with_operators`]: also the engine's steps (launch, collect, sample,
    /// deliver) on the `"engine"` track.
    pub fn trace_start_with_operators(&self) -> Result<()> {
        self.session.trace_start_with_operators()
    }

    /// [`Session::trace_stop`].
    pub fn trace_stop(&self, path: Option<&Path>) -> Result<()> {
        self.session.trace_stop(path)
    }
}
