//! The worker thread: it owns the model and the `--parallel` sequence slots, takes jobs from a
//! bounded queue, and advances every active sequence one unit of work per round (a prefill
//! chunk or one decode step), in slot order, so that sequences take turns fairly. HTTP handlers
//! see it only through a [`Job`]'s event channel: the tokens, as they become final, and how the
//! generation ended. A handler that goes away (client disconnect, a stop string matched) closes
//! its channel, and the worker drops the job at its next turn.
//!
//! A new job goes to the free slot whose sequence shares the longest prefix with its prompt
//! (llama-server's slot similarity), else the least recently used one; the slot's sequence rolls
//! back to that prefix ([`crate::engine::Seq::rollback`]) and only the rest is prefilled.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::sampler::Sampler;
use strata_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{
    Constraint, Finish, Gen, GenRules, ModelHandle, Seq, ThinkBudget, TokenLogprob,
};
use crate::Shared;

/// Prompt tokens per turn of a prefilling sequence: large enough to keep the matrix products
/// efficient, small enough that decoding sequences are not held up for long.
const PREFILL_CHUNK: usize = 256;

/// One request's generation.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampler: Sampler,
    pub max_tokens: usize,
    /// Log-probabilities with this many alternatives per token (None: none).
    pub top_logprobs: Option<usize>,
    /// Prompt positions to checkpoint (the last user-message boundary), besides the end of
    /// prefill and the end of generation.
    pub checkpoint_at: Vec<usize>,
    /// A grammar the generated tokens must follow.
    pub constraint: Option<Box<dyn Constraint>>,
    /// A cap on the reasoning tokens.
    pub think: Option<ThinkBudget>,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Token {
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
    },
    Error(String),
}

enum Phase {
    Prefill { next: usize },
    Decode(Box<Gen>),
}

struct Active {
    job: Job,
    phase: Phase,
    started: Instant,
}

struct Slot {
    seq: Seq,
    active: Option<Active>,
    last_used: u64,
}

pub struct WorkerConfig {
    pub parallel: usize,
    pub n_ctx: usize,
    pub cache_ram: usize,
}

/// Runs until shutdown is flagged in `shared` or the queue's senders are all gone.
pub fn run(
    model: ModelHandle,
    tok: Arc<Tokenizer>,
    cfg: WorkerConfig,
    jobs: Receiver<Job>,
    shared: Arc<Shared>,
) {
    let mut slots: Vec<Slot> = Vec::new();
    for _ in 0..cfg.parallel.max(1) {
        match model.new_seq() {
            Ok(seq) => slots.push(Slot {
                seq,
                active: None,
                last_used: 0,
            }),
            Err(e) => {
                tracing::error!("creating a sequence: {e:#}");
                shared.fail(format!("creating a sequence: {e:#}"));
                return;
            }
        }
    }
    let mut clock = 0u64;
    let is_eog = |id: u32| tok.is_eog(id);
    loop {
        if shared.shutting_down() {
            for s in &mut slots {
                if let Some(a) = s.active.take() {
                    let _ = a
                        .job
                        .events
                        .send(Event::Error("the server is shutting down".into()));
                }
            }
            while let Ok(job) = jobs.try_recv() {
                let _ = job
                    .events
                    .send(Event::Error("the server is shutting down".into()));
            }
            return;
        }
        // Admit queued jobs while a slot is free; wait for one only when nothing runs.
        while slots.iter().any(|s| s.active.is_none()) {
            let busy = slots.iter().any(|s| s.active.is_some());
            let job = if busy {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(_) => break,
                }
            } else {
                match jobs.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            shared.metrics.deferred.fetch_sub(1, Ordering::Relaxed);
            clock += 1;
            admit(&model, &mut slots, job, clock, &shared);
        }
        for slot in slots.iter_mut() {
            if slot.active.is_none() {
                continue;
            }
            clock += 1;
            slot.last_used = clock;
            let res = turn(&model, slot, &cfg, &is_eog, clock, &shared);
            match res {
                Ok(Some(finish)) => {
                    if let Some(a) = slot.active.take() {
                        let _ = slot.seq.checkpoint(&model, clock);
                        let _ = a.job.events.send(Event::Done { finish });
                        log_done(&a, &slot.seq, Some(finish));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    if let Some(a) = slot.active.take() {
                        tracing::warn!("generation failed: {e:#}");
                        let _ = a.job.events.send(Event::Error(format!("{e:#}")));
                    }
                }
            }
            if slot.active.is_none() {
                shared.metrics.processing.fetch_sub(1, Ordering::Relaxed);
            }
        }
        enforce_budget(&model, &mut slots, cfg.cache_ram, &shared);
    }
}

fn log_done(a: &Active, seq: &Seq, finish: Option<Finish>) {
    tracing::debug!(
        target: "strata::worker",
        finish = ?finish,
        tokens = seq.len(),
        secs = a.started.elapsed().as_secs_f64(),
        "sequence done"
    );
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn admit(model: &ModelHandle, slots: &mut [Slot], job: Job, clock: u64, shared: &Shared) {
    // The free slot sharing the longest prefix; among equals the least recently used.
    let Some(i) = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.active.is_none())
        .max_by_key(|(_, s)| {
            (
                common_prefix(s.seq.tokens(), &job.prompt),
                std::cmp::Reverse(s.last_used),
            )
        })
        .map(|(i, _)| i)
    else {
        return;
    };
    let slot = &mut slots[i];
    slot.last_used = clock;
    let common = common_prefix(slot.seq.tokens(), &job.prompt).min(job.prompt.len() - 1);
    let had = slot.seq.len();
    let reached = match slot.seq.rollback(model, common) {
        Ok(r) => r,
        Err(e) => {
            let _ = job
                .events
                .send(Event::Error(format!("rolling the cache back: {e:#}")));
            return;
        }
    };
    let m = &shared.metrics;
    if reached > 0 {
        m.cache_hits.fetch_add(1, Ordering::Relaxed);
        m.cached_tokens.fetch_add(reached as u64, Ordering::Relaxed);
        if reached < had && model.checkpoint_bytes() > 0 {
            m.checkpoint_restores.fetch_add(1, Ordering::Relaxed);
        }
    }
    m.processing.fetch_add(1, Ordering::Relaxed);
    let _ = job.events.send(Event::Started {
        prompt_tokens: job.prompt.len(),
        cached_tokens: reached,
    });
    slot.active = Some(Active {
        job,
        phase: Phase::Prefill { next: reached },
        started: Instant::now(),
    });
}

/// One unit of work for a slot's active job; `Some` when the generation is over.
fn turn(
    model: &ModelHandle,
    slot: &mut Slot,
    cfg: &WorkerConfig,
    is_eog: &dyn Fn(u32) -> bool,
    clock: u64,
    shared: &Shared,
) -> anyhow::Result<Option<Finish>> {
    let Some(a) = slot.active.as_mut() else {
        return Ok(None);
    };
    if a.job.events.is_closed() {
        // The client went away: stop computing tokens nobody reads.
        slot.active = None;
        shared.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        return Ok(None);
    }
    let m = &shared.metrics;
    match &mut a.phase {
        Phase::Prefill { next } => {
            let prompt = &a.job.prompt;
            // Stop each chunk at the next checkpoint position, so the state there is saved.
            let end_prefill = prompt.len() - 1;
            let mut end = (*next + PREFILL_CHUNK).min(prompt.len());
            for &p in a.job.checkpoint_at.iter().chain([&end_prefill]) {
                if p > *next && p < end {
                    end = p;
                }
            }
            let t0 = Instant::now();
            let logits = slot.seq.feed(model, &prompt[*next..end])?;
            m.prompt_tokens
                .fetch_add((end - *next) as u64, Ordering::Relaxed);
            m.prompt_us
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            *next = end;
            if end == end_prefill || a.job.checkpoint_at.contains(&end) {
                slot.seq.checkpoint(model, clock)?;
            }
            if end == prompt.len() {
                let rules = GenRules {
                    max_tokens: a.job.max_tokens,
                    n_ctx: cfg.n_ctx,
                    top_logprobs: a.job.top_logprobs,
                    constraint: a.job.constraint.take(),
                    think: a.job.think.take(),
                };
                let gen = Gen::new(&a.job.sampler, logits, prompt.len(), rules);
                a.phase = Phase::Decode(Box::new(gen));
            }
            Ok(None)
        }
        Phase::Decode(gen) => {
            let t0 = Instant::now();
            let out = gen.step(&mut slot.seq, model, &mut a.job.sampler, is_eog)?;
            m.predicted_us
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            m.decode_calls.fetch_add(1, Ordering::Relaxed);
            for (id, logprob) in out.tokens {
                m.predicted_tokens.fetch_add(1, Ordering::Relaxed);
                if a.job.events.send(Event::Token { id, logprob }).is_err() {
                    slot.active = None;
                    m.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
            }
            if let Some(d) = shared.cfg.test_token_delay {
                std::thread::sleep(d);
            }
            Ok(out.finish)
        }
    }
}

/// Drops the oldest checkpoints, across slots, until they fit in `budget` bytes.
fn enforce_budget(model: &ModelHandle, slots: &mut [Slot], budget: usize, shared: &Shared) {
    let per = model.checkpoint_bytes();
    if per == 0 {
        return;
    }
    loop {
        let total: usize = slots.iter().map(|s| s.seq.n_checkpoints() * per).sum();
        shared
            .metrics
            .checkpoint_bytes
            .store(total as u64, Ordering::Relaxed);
        if total <= budget {
            return;
        }
        let Some(i) = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.seq.oldest_checkpoint().map(|t| (i, t)))
            .min_by_key(|&(_, t)| t)
            .map(|(i, _)| i)
        else {
            return;
        };
        slots[i].seq.drop_oldest_checkpoint();
        shared
            .metrics
            .checkpoint_evictions
            .fetch_add(1, Ordering::Relaxed);
    }
}
