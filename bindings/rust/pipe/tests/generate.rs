//! Token generation (Generator, Generation) on the decoder fixtures (common/decoder.rs): greedy
//! tokens equal transformers' for the same weights, through the blocking iterator, the futures and
//! the descriptor; seeded sampling is reproducible; cancel, deadlines, a failing step, a full queue
//! (Busy) and bad prompts give their errors and the generator keeps serving. Each test that needs a
//! sequence to still be going holds its prefill step at the gated decoder's gate and acts on that
//! observed state, so no verdict depends on how long some work takes.
mod common;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use common::decoder::{expected, generator_of, held_prompt, tiny_generator, FAIL_ID, GATED_STAGE};
use common::executor::{join_all, poll_once, Signal};
use common::gate::{wait_until, Key, ARRIVED, WAIT_LIMIT};
use common::*;
use pipe::{
    FinishReason, Generation, GenerationOptions, Generator, GeneratorOptions, Model, Plan, PlanOptions, SessionOptions,
    Status,
};

fn greedy(max_new_tokens: usize) -> GenerationOptions {
    GenerationOptions { max_new_tokens, ..Default::default() }
}

/// Every item of the iterator: the tokens, and the error it ended with, if any.
fn drain(generation: &mut Generation) -> (Vec<i64>, Option<pipe::Error>) {
    let mut tokens = Vec::new();
    for item in generation.by_ref() {
        match item {
            Ok(token) => tokens.push(token),
            Err(e) => return (tokens, Some(e)),
        }
    }
    (tokens, None)
}

/// Joins `thread`, failing the test if it has not finished within the gate's bound (for a hung
/// test only: the test has made sure that it finishes).
fn join_bounded<T>(thread: thread::JoinHandle<T>, what: &str) -> T {
    wait_until(|| thread.is_finished(), || format!("{what} has not returned"));
    thread.join().unwrap()
}

/// With logprobs, each greedy token's log-probability and the 5 likeliest tokens at its position
/// equal the log-softmax of transformers' logits, the greedy token first; without, logprobs() is
/// refused; top_logprobs above 20, or without logprobs, is refused.
#[test]
fn logprobs_equal_transformers() {
    let want = expected();
    assert_eq!(want.greedy_logprobs.len(), want.prompts.len());
    let generator = tiny_generator();
    let near = |got: f32, want: f64| (f64::from(got) - want).abs() <= 1e-4;
    let options = GenerationOptions { logprobs: true, top_logprobs: 5, ..greedy(want.max_new_tokens) };
    let mut generations: Vec<Generation> =
        want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    for (i, generation) in generations.iter_mut().enumerate() {
        let (tokens, error) = drain(generation);
        assert!(error.is_none(), "prompt {i}: {error:?}");
        assert_eq!(tokens, want.greedy[i], "prompt {i}");
        let (got, reference) = (generation.logprobs().unwrap(), &want.greedy_logprobs[i]);
        assert_eq!((got.len(), reference.logprob.len()), (tokens.len(), tokens.len()), "prompt {i}");
        for (k, lp) in got.iter().enumerate() {
            assert!(
                near(lp.logprob, reference.logprob[k]),
                "prompt {i} token {k}: {lp:?}, want {}",
                reference.logprob[k]
            );
            assert_eq!(lp.top.len(), 5, "prompt {i} token {k}: {lp:?}");
            assert_eq!(lp.top[0].id, tokens[k], "prompt {i} token {k}: the greedy token is the likeliest: {lp:?}");
            for (j, alt) in lp.top.iter().enumerate() {
                assert!(
                    near(alt.logprob, reference.top_logprobs[k][j]),
                    "prompt {i} token {k}: {lp:?}, want {:?} (ids {:?})",
                    reference.top_logprobs[k],
                    reference.top_ids[k]
                );
            }
            assert!(near(lp.top[0].logprob, f64::from(lp.logprob)), "prompt {i} token {k}: {lp:?}");
        }
    }

    // Collected as the iterator reads: every token returned has its entry.
    let mut generation =
        generator.generate(&want.prompts[0], &GenerationOptions { logprobs: true, ..greedy(2) }).unwrap();
    let first = generation.next().unwrap().unwrap();
    assert_eq!(first, want.greedy[0][0]);
    let lp = generation.logprobs().unwrap()[0].clone();
    assert!(lp.top.is_empty() && near(lp.logprob, want.greedy_logprobs[0].logprob[0]), "{lp:?}");
    assert_eq!(drain(&mut generation).0.len(), 1);
    assert_eq!(generation.logprobs().unwrap().len(), 2);

    let mut plain = generator.generate(&want.prompts[0], &greedy(1)).unwrap();
    drain(&mut plain);
    assert_eq!(plain.logprobs().unwrap_err().status, Status::InvalidArgument);
    for bad in [
        GenerationOptions { logprobs: true, top_logprobs: 21, ..greedy(1) },
        GenerationOptions { top_logprobs: 3, ..greedy(1) },
    ] {
        let e = generator.generate(&want.prompts[0], &bad).err().expect("refused");
        assert_eq!(e.status, Status::InvalidArgument, "{bad:?}: {e}");
        assert!(e.to_string().contains("top_logprobs"), "{e}");
    }
}

/// With prompt_logprobs, each prompt token's log-probability given those before it, and the 5
/// likeliest tokens there, equal the log-softmax of transformers' logits of the whole prompt; entry
/// 0 is None; the tokens that follow stay transformers' greedy ones. Several scored prompts at once,
/// beside a plain one, so that their one-token rows share steps. Without the option
/// prompt_logprobs() is refused; top_logprobs with prompt_logprobs alone is allowed.
#[test]
fn prompt_logprobs_equal_transformers() {
    let want = expected();
    assert_eq!(
        want.prompt_logprobs.len(),
        want.prompts.len(),
        "an old fixture: tests/models/decoder_models.py writes prompt_logprobs"
    );
    let generator = tiny_generator();
    let near = |got: f32, want: f64| (f64::from(got) - want).abs() <= 1e-4;
    let options = GenerationOptions { prompt_logprobs: true, top_logprobs: 5, ..greedy(want.max_new_tokens) };
    let mut generations: Vec<Generation> =
        want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    let mut plain = generator.generate(&want.prompts[0], &greedy(want.max_new_tokens)).unwrap();
    for (i, generation) in generations.iter_mut().enumerate() {
        let (tokens, error) = drain(generation);
        assert!(error.is_none(), "prompt {i}: {error:?}");
        assert_eq!(tokens, want.greedy[i], "prompt {i}");
        assert_eq!(generation.info().unwrap().cached_tokens, 0, "prompt {i}: scored, yet taken from the cache");
        assert_eq!(generation.logprobs().unwrap_err().status, Status::InvalidArgument);
        let (got, reference, prompt) =
            (generation.prompt_logprobs().unwrap(), &want.prompt_logprobs[i], &want.prompts[i]);
        assert_eq!((got.len(), reference.logprob.len() + 1), (prompt.len(), prompt.len()), "prompt {i}");
        assert!(got[0].is_none(), "prompt {i}: position 0 is scored: {:?}", got[0]);
        for (k, lp) in got.iter().enumerate().skip(1) {
            let lp = lp.as_ref().unwrap_or_else(|| panic!("prompt {i} position {k}: not scored"));
            let (want_lp, want_top) = (reference.logprob[k - 1], &reference.top_logprobs[k - 1]);
            assert!(near(lp.logprob, want_lp), "prompt {i} position {k}: {lp:?}, want {want_lp}");
            assert_eq!(lp.top.len(), 5, "prompt {i} position {k}: {lp:?}");
            for (j, alt) in lp.top.iter().enumerate() {
                assert!(
                    near(alt.logprob, want_top[j]),
                    "prompt {i} position {k}: {lp:?}, want {want_top:?} (ids {:?})",
                    reference.top_ids[k - 1]
                );
            }
        }
    }
    assert_eq!(drain(&mut plain).0, want.greedy[0]);
    assert_eq!(plain.prompt_logprobs().unwrap_err().status, Status::InvalidArgument);

    // Read with the first token the iterator returns; both kinds at once, no alternatives.
    let i = want.prompts.len() - 1;
    let options = GenerationOptions { logprobs: true, prompt_logprobs: true, ..greedy(2) };
    let mut generation = generator.generate(&want.prompts[i], &options).unwrap();
    assert_eq!(generation.next().unwrap().unwrap(), want.greedy[i][0]);
    let got = generation.prompt_logprobs().unwrap();
    assert_eq!(got.len(), want.prompts[i].len());
    let first = got[1].as_ref().unwrap();
    assert!(first.top.is_empty() && near(first.logprob, want.prompt_logprobs[i].logprob[0]), "{first:?}");
    assert!(near(generation.logprobs().unwrap()[0].logprob, want.greedy_logprobs[i].logprob[0]));
    assert_eq!(drain(&mut generation).0.len(), 1);

    let e = generator
        .generate(&want.prompts[0], &GenerationOptions { prompt_logprobs: true, top_logprobs: 21, ..greedy(1) })
        .err()
        .expect("refused");
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
}

#[test]
fn greedy_equals_transformers() {
    let want = expected();
    let generator = tiny_generator();
    let info = generator.info().unwrap();
    assert_eq!((info.slots, info.max_len, info.vocab), (want.slots, want.max_len, want.vocab));
    assert!(info.cache_bytes_per_slot > 0, "{info:?}");

    // Every prompt at once: more prompts than slots, so one waits for a slot and joins later.
    assert!(want.prompts.len() > info.slots);
    let options = greedy(want.max_new_tokens);
    let mut generations: Vec<Generation> =
        want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    for ((generation, prompt), reference) in generations.iter_mut().zip(&want.prompts).zip(&want.greedy) {
        let tokens: Vec<i64> = generation.by_ref().collect::<pipe::Result<_>>().unwrap();
        assert_eq!(&tokens, reference, "prompt {prompt:?}");
        assert!(generation.next().is_none(), "the iterator is fused");
        let info = generation.info().unwrap();
        assert_eq!(info.finish_reason, Some(FinishReason::Length));
        assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Length));
        assert_eq!((info.prompt_tokens, info.generated_tokens), (prompt.len(), reference.len()));
        assert!(info.queued_ms.is_some() && info.time_to_first_token_ms.is_some(), "{info:?}");
        assert!(info.mean_inter_token_ms.is_some(), "{info:?}");
        generation.wait(Some(Duration::ZERO)).unwrap();
    }

    // The engine counts a sequence and frees its slot as it ends, which the reader may see first.
    let n = want.prompts.len() as u64;
    let settled = || {
        let s = generator.stats().unwrap();
        s.sequences_finished == n && s.slots_in_use == 0
    };
    wait_until(settled, || format!("{:?}", generator.stats()));
    let stats = generator.stats().unwrap();
    assert_eq!(stats.generated_tokens, n * want.max_new_tokens as u64, "{stats:?}");
    assert_eq!(stats.prompt_tokens, want.prompts.iter().map(|p| p.len() as u64).sum::<u64>(), "{stats:?}");
    assert_eq!((stats.slots_in_use, stats.queued), (0, 0), "{stats:?}");
    assert!(stats.steps > 0 && stats.tokens_per_s > 0.0 && stats.mean_rows_per_step >= 1.0, "{stats:?}");
    assert!(stats.steps_in_flight >= 1, "{stats:?}");
    assert_eq!(stats.steps_one_at_a_time + stats.steps_pipelined, stats.steps, "{stats:?}");
}

#[test]
fn greedy_until_the_cache_is_full() {
    let want = expected();
    let generator = tiny_generator();
    // More tokens asked for than the cache has room for: it ends by its length.
    let mut generation = generator.generate(&want.max_len_prompt, &greedy(want.max_len)).unwrap();
    let (tokens, error) = drain(&mut generation);
    assert!(error.is_none(), "{error:?}");
    assert_eq!(tokens, want.max_len_greedy);
    assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Length));
}

#[test]
fn a_stop_id_ends_the_sequence_and_is_its_last_token() {
    let want = expected();
    let generator = tiny_generator();
    let reference = &want.greedy[1];
    let stop = reference[reference.len() / 2];
    let end = reference.iter().position(|&t| t == stop).unwrap();
    let options = GenerationOptions { stop_ids: vec![stop, -5], ..greedy(want.max_new_tokens) };
    let mut generation = generator.generate(&want.prompts[1], &options).unwrap();
    let tokens: Vec<i64> = generation.by_ref().collect::<pipe::Result<_>>().unwrap();
    assert_eq!(tokens, reference[..=end]);
    assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Stop));
}

#[test]
fn next_async_awaits_every_generation_on_one_thread() {
    let want = expected();
    let generator = tiny_generator();
    let options = greedy(want.max_new_tokens);
    let generations: Vec<Generation> = want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    let futures = generations.into_iter().map(|mut generation| async move {
        let mut tokens = Vec::new();
        while let Some(token) = generation.next_async().await {
            tokens.push(token?);
        }
        assert!(generation.next_async().await.is_none(), "the end repeats");
        Ok::<_, pipe::Error>(tokens)
    });
    for (result, reference) in join_all(futures.collect()).into_iter().zip(&want.greedy) {
        assert_eq!(&result.unwrap(), reference);
    }
}

#[test]
fn an_event_loop_polls_the_descriptors_and_reads_without_blocking() {
    let want = expected();
    let generator = tiny_generator();
    let options = greedy(want.max_new_tokens);
    let mut generations: Vec<Generation> =
        want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); generations.len()];
    let mut open: Vec<usize> = (0..generations.len()).collect();
    let give_up = Instant::now() + WAIT_LIMIT;
    while !open.is_empty() {
        let mut fds: Vec<libc::pollfd> = open
            .iter()
            .map(|&i| libc::pollfd { fd: generations[i].as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        // SAFETY: valid pollfds; bounded so that a hung test ends.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
        assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
        assert!(Instant::now() < give_up, "no generation finished within {WAIT_LIMIT:?}");
        let ready: Vec<usize> = open.iter().zip(&fds).filter(|(_, f)| f.revents != 0).map(|(&i, _)| i).collect();
        for i in ready {
            // Readable: read what is there; Pending means every token so far was read, which
            // clears the descriptor until the next one.
            loop {
                match generations[i].try_next() {
                    Poll::Ready(Some(token)) => tokens[i].push(token.unwrap()),
                    Poll::Ready(None) => {
                        open.retain(|&j| j != i);
                        break;
                    }
                    Poll::Pending => break,
                }
            }
        }
    }
    assert_eq!(tokens, want.greedy);
}

#[test]
fn threads_share_one_generator() {
    let want = Arc::new(expected());
    let generator = Arc::new(tiny_generator());
    let threads: Vec<_> = (0..want.prompts.len())
        .map(|i| {
            let (generator, want) = (Arc::clone(&generator), Arc::clone(&want));
            thread::spawn(move || {
                let generation = generator.generate(&want.prompts[i], &greedy(want.max_new_tokens)).unwrap();
                generation.collect::<pipe::Result<Vec<i64>>>().unwrap()
            })
        })
        .collect();
    for (i, thread) in threads.into_iter().enumerate() {
        assert_eq!(join_bounded(thread, "a generating thread"), want.greedy[i]);
    }
}

#[test]
fn a_generation_outlives_its_generator() {
    let want = expected();
    let generator = tiny_generator();
    let mut generation = generator.generate(&want.prompts[2], &greedy(want.max_new_tokens)).unwrap();
    generation.wait(None).unwrap();
    drop(generator);
    // Every token was generated before the generator went; they stay readable.
    let (tokens, error) = drain(&mut generation);
    assert!(error.is_none(), "{error:?}");
    assert_eq!(tokens, want.greedy[2]);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let want = expected();
    let generator = tiny_generator();
    let sampled =
        |seed: u64| GenerationOptions { temperature: 0.9, top_k: 40, top_p: 0.95, seed, ..greedy(want.max_new_tokens) };
    let prompt = &want.prompts[3];
    let alone: Vec<i64> = generator.generate(prompt, &sampled(7)).unwrap().collect::<pipe::Result<_>>().unwrap();
    assert_eq!(alone.len(), want.max_new_tokens);
    assert!(alone.iter().all(|&t| (0..want.vocab as i64).contains(&t)), "{alone:?}");

    // The same seed again, this time batched with other sequences (other seeds): the same tokens.
    let mut others: Vec<Generation> = want
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| generator.generate(p, &sampled(100 + i as u64)).unwrap())
        .collect();
    let again: Vec<i64> = generator.generate(prompt, &sampled(7)).unwrap().collect::<pipe::Result<_>>().unwrap();
    assert_eq!(again, alone);
    for other in &mut others {
        assert_eq!(other.by_ref().count(), want.max_new_tokens);
    }

    // Another seed draws other tokens (fixed seeds: the same verdict on every run), and greedy
    // ignores the seed.
    let other: Vec<i64> = generator.generate(prompt, &sampled(8)).unwrap().collect::<pipe::Result<_>>().unwrap();
    assert_ne!(other, alone);
    let seeded_greedy = GenerationOptions { seed: 7, ..greedy(want.max_new_tokens) };
    let tokens: Vec<i64> = generator.generate(prompt, &seeded_greedy).unwrap().collect::<pipe::Result<_>>().unwrap();
    assert_eq!(tokens, want.greedy[3]);
}

#[test]
fn cancel_ends_a_blocked_iterator_with_cancelled() {
    let want = expected();
    let generator = generator_of("gated_decoder.pt", &GeneratorOptions::default());
    let key = Key::new();
    let generation = generator.generate(&held_prompt(&key, &[5, 6, 7]), &greedy(4)).unwrap();
    key.wait(GATED_STAGE, ARRIVED, 1);
    assert_eq!(generation.finish_reason().unwrap(), None);
    assert_eq!(generation.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Timeout);

    // Nothing to read while the prefill step is held: the iterator blocks in poll(2) until the
    // cancel. Whether the cancel lands before it blocks or while it does, it ends the same way.
    let canceller = generation.cancel_handle();
    let reader = thread::spawn(move || {
        let mut generation = generation;
        let items = drain(&mut generation);
        (items, generation)
    });
    canceller.cancel().unwrap();
    key.open();
    let ((tokens, error), generation) = join_bounded(reader, "the cancelled iterator");
    // The only step it was in was held, and its token dropped.
    assert!(tokens.is_empty(), "{tokens:?}");
    let error = error.expect("a cancelled generation ends with an error");
    assert_eq!(error.status, Status::Cancelled, "{error}");
    assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Cancelled));
    assert_eq!(generation.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Cancelled);
    // Cancelling a finished generation leaves it as it is.
    canceller.cancel().unwrap();
    generation.cancel().unwrap();
    assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Cancelled));

    // The generator goes on serving (same weights as the tiny decoder: same tokens).
    assert_eq!(run(&generator, &want.prompts[1], &greedy(want.max_new_tokens)), want.greedy[1]);
}

/// Every token of one generation; panics on an error.
fn run(generator: &Generator, prompt: &[i64], options: &GenerationOptions) -> Vec<i64> {
    generator.generate(prompt, options).unwrap().collect::<pipe::Result<_>>().unwrap()
}

#[test]
fn cancel_completes_a_pending_next_async() {
    let generator = generator_of("gated_decoder.pt", &GeneratorOptions::default());
    let key = Key::new();
    let mut generation = generator.generate(&held_prompt(&key, &[9]), &greedy(4)).unwrap();
    key.wait(GATED_STAGE, ARRIVED, 1);
    let canceller = generation.cancel_handle();

    let signal = Signal::new();
    let mut next = generation.next_async();
    assert!(poll_once(&mut next, &signal).is_pending());
    assert_eq!(signal.wakes(), 0, "woken while the step is held");
    canceller.cancel().unwrap();
    key.open();
    // libpipe calls back when the sequence finishes, which wakes the task.
    let item = common::executor::block_on(next);
    let error = item.expect("an item").expect_err("a cancelled generation ends with an error");
    assert_eq!(error.status, Status::Cancelled, "{error}");
    assert!(common::executor::block_on(generation.next_async()).is_none());
}

/// The gated decoder's 4 slots taken by sequences whose prefill steps hold at `key` (one of them
/// is held at the gate of stage 1: nothing of them can finish before the gate opens).
fn hold_every_slot(generator: &Generator, key: &Key) -> Vec<Generation> {
    let slots = generator.info().unwrap().slots;
    let held: Vec<Generation> =
        (0..slots).map(|i| generator.generate(&held_prompt(key, &[4 + i as i64]), &greedy(2)).unwrap()).collect();
    key.wait(GATED_STAGE, ARRIVED, 1);
    wait_until(|| generator.stats().unwrap().slots_in_use == slots, || format!("{:?}", generator.stats()));
    held
}

#[test]
fn dropping_held_generations_frees_their_slots() {
    let want = expected();
    let generator = generator_of("gated_decoder.pt", &GeneratorOptions::default());
    let key = Key::new();
    let held = hold_every_slot(&generator, &key);
    // No slot is free: this one waits until one of the held sequences lets go of its own.
    let waiting = generator.generate(&want.prompts[2], &greedy(want.max_new_tokens)).unwrap();
    wait_until(|| generator.stats().unwrap().queued == 1, || format!("{:?}", generator.stats()));

    // Dropped before the gate opens, so they end cancelled, not by their length: only that frees
    // the slots (once their steps return).
    drop(held);
    key.open();
    let tokens: Vec<i64> = waiting.collect::<pipe::Result<_>>().unwrap();
    assert_eq!(tokens, want.greedy[2]);
    let settled = || {
        let s = generator.stats().unwrap();
        (s.slots_in_use, s.queued, s.sequences_finished) == (0, 0, 5)
    };
    wait_until(settled, || format!("{:?}", generator.stats()));
}

#[test]
fn a_deadline_that_passes_while_held() {
    let generator = generator_of("gated_decoder.pt", &GeneratorOptions::default());
    let key = Key::new();
    let timeout = Duration::from_millis(50);
    let options = GenerationOptions { timeout: Some(timeout), ..greedy(4) };
    let mut generation = generator.generate(&held_prompt(&key, &[3]), &options).unwrap();
    // Its deadline is at most this long after now: generate has returned.
    let submitted = Instant::now();
    key.wait(GATED_STAGE, ARRIVED, 1);
    // Held until the deadline has passed (a bounded wait for a clock condition), so the step
    // returns too late whatever the machine's speed.
    wait_until(|| submitted.elapsed() > timeout, || "the clock does not move".into());
    key.open();
    let (tokens, error) = drain(&mut generation);
    assert!(tokens.is_empty(), "{tokens:?}");
    let error = error.expect("an expired generation ends with an error");
    assert_eq!(error.status, Status::DeadlineExceeded, "{error}");
    assert_eq!(generation.finish_reason().unwrap(), Some(FinishReason::Deadline));
}

#[test]
fn busy_when_the_queue_is_full() {
    let want = expected();
    let options = GeneratorOptions { max_queued: 1, ..Default::default() };
    let generator = generator_of("gated_decoder.pt", &options);
    let key = Key::new();
    let held = hold_every_slot(&generator, &key);
    let queued = generator.generate(&want.prompts[0], &greedy(want.max_new_tokens)).unwrap();
    wait_until(|| generator.stats().unwrap().queued == 1, || format!("{:?}", generator.stats()));

    // Every slot is held and max_queued sequences wait: refused, nothing started.
    let e = generator.generate(&want.prompts[1], &greedy(want.max_new_tokens)).err().expect("Busy");
    assert_eq!(e.status, Status::Busy, "{e}");
    assert!(!e.message.is_empty());
    assert_eq!(generator.stats().unwrap().queued, 1);

    key.open();
    for generation in held {
        assert_eq!(generation.collect::<pipe::Result<Vec<i64>>>().unwrap().len(), 2);
    }
    assert_eq!(queued.collect::<pipe::Result<Vec<i64>>>().unwrap(), want.greedy[0]);
    // Room again.
    assert_eq!(run(&generator, &want.prompts[1], &greedy(want.max_new_tokens)), want.greedy[1]);
}

#[test]
fn a_failing_step_fails_its_sequence_and_the_generator_goes_on() {
    let want = expected();
    let generator = generator_of("gated_decoder.pt", &GeneratorOptions::default());
    let mut failing = generator.generate(&[FAIL_ID, 1, 2], &greedy(4)).unwrap();
    let (tokens, error) = drain(&mut failing);
    assert!(tokens.is_empty(), "{tokens:?}");
    let error = error.expect("a failed step ends its generation with an error");
    assert_eq!(error.status, Status::Execution, "{error}");
    assert!(!error.message.is_empty());
    assert_eq!(failing.finish_reason().unwrap(), Some(FinishReason::Error));
    assert_eq!(failing.wait(None).unwrap_err().status, Status::Execution);
    assert!(failing.next().is_none(), "the error is the last item");

    assert_eq!(run(&generator, &want.prompts[3], &greedy(want.max_new_tokens)), want.greedy[3]);
    assert!(generator.session().unwrap().check().is_ok());
}

#[test]
fn bad_prompts_and_options_are_refused() {
    let want = expected();
    let generator = tiny_generator();
    let vocab = want.vocab as i64;
    let too_long = vec![1i64; want.max_len];
    let ok = greedy(4);
    let cases: Vec<(&str, Vec<i64>, GenerationOptions)> = vec![
        ("an empty prompt", vec![], ok.clone()),
        ("an id = vocab", vec![1, vocab, 2], ok.clone()),
        ("a negative id", vec![-1], ok.clone()),
        ("a prompt that fills max_len", too_long, ok.clone()),
        ("max_new_tokens 0", vec![1], greedy(0)),
        ("a negative temperature", vec![1], GenerationOptions { temperature: -1.0, ..ok.clone() }),
        ("top_p 0", vec![1], GenerationOptions { top_p: 0.0, ..ok.clone() }),
        ("top_p above 1", vec![1], GenerationOptions { top_p: 1.5, ..ok.clone() }),
        ("a NaN temperature", vec![1], GenerationOptions { temperature: f64::NAN, ..ok.clone() }),
        ("a zero timeout", vec![1], GenerationOptions { timeout: Some(Duration::ZERO), ..ok.clone() }),
    ];
    for (what, prompt, options) in cases {
        let e = generator.generate(&prompt, &options).err().unwrap_or_else(|| panic!("{what} was accepted"));
        assert_eq!(e.status, Status::InvalidArgument, "{what}: {e}");
        assert!(!e.message.is_empty(), "{what}");
    }
    let e = generator.generate(&[1, vocab], &ok).err().unwrap();
    assert!(e.message.contains(&vocab.to_string()), "the message names the id: {e}");
    // Nothing of that reached the engine, which goes on serving.
    assert_eq!(generator.stats().unwrap().sequences_finished, 0);
    assert_eq!(run(&generator, &want.prompts[0], &greedy(want.max_new_tokens)), want.greedy[0]);
}

#[test]
fn a_model_that_is_not_a_decoder_is_refused() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    let e = Generator::new(&plan, &SessionOptions::new(), &GeneratorOptions::default()).err().expect("refused");
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(!e.message.is_empty());
}

#[test]
fn the_generators_session_reports_its_stages() {
    let want = expected();
    let generator = tiny_generator();
    let session = generator.session().unwrap();
    assert_eq!(session.num_stages().unwrap(), 2);
    session.check().unwrap();
    let trace = scratch("generate-trace.json");
    session.trace_start().unwrap();
    assert_eq!(run(&generator, &want.prompts[1], &greedy(want.max_new_tokens)), want.greedy[1]);
    session.trace_stop(Some(&trace)).unwrap();
    assert!(std::fs::metadata(&trace).unwrap().len() > 0);
    // Every step went through both stages.
    let stages = session.stats().unwrap();
    let steps = generator.stats().unwrap().steps;
    assert!(steps > 0);
    for s in &stages {
        assert!(s.microbatches >= steps, "{stages:?} after {steps} steps");
        assert_eq!(s.failures, 0);
    }
}

#[test]
fn options_default_to_libpipes() {
    let options = GenerationOptions::default();
    assert_eq!(options.max_new_tokens, 16);
    assert_eq!((options.temperature, options.top_k, options.top_p, options.seed), (0.0, 0, 1.0, 0));
    assert!(options.stop_ids.is_empty() && options.timeout.is_none());
    assert!(!options.logprobs && !options.prompt_logprobs && options.top_logprobs == 0);
    let generator = GeneratorOptions::default();
    assert_eq!(
        generator,
        GeneratorOptions { max_queued: 0, prefill_chunk: 0, steps_in_flight: 0, max_rows_per_step: 0 }
    );
}

// Shared across threads as pipe.h allows: a generator by many, a generation moved, a cancel handle
// anywhere.
static_assertions::assert_impl_all!(Generator: Send, Sync);
static_assertions::assert_impl_all!(Generation: Send, Sync);
static_assertions::assert_impl_all!(pipe::CancelHandle: Send, Sync, Clone);
