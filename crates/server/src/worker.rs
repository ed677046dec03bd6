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

use strata_engine::backend::Backend;
use strata_engine::sampler::Sampler;
use strata_engine::Qwen4expOps;
use strata_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{
    Constraint, Finish, Gen, GenRules, ModelHandle, Seq, SpecCounts, ThinkBudget, TokenLogprob,
};
use crate::Shared;

/// Prompt tokens per turn of a prefilling sequence: large enough to keep the matrix products
/// efficient, small enough that decoding sequences are not held up for long.
const PREFILL_CHUNK: usize = 256;

/// One request's generation.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Taken by the generation when it starts.
    pub sampler: Option<Sampler>,
    pub max_tokens: usize,
    /// Log-probabilities with this many alternatives per token (None: none).
    pub top_logprobs: Option<usize>,
    /// Prompt positions to checkpoint (the last user-message boundary), besides the end of
    /// prefill and the end of generation.
    pub checkpoint_at: Vec<usize>,
    /// A grammar the generated tokens must follow, from after `grammar_after` when set.
    pub constraint: Option<Box<dyn Constraint>>,
    pub grammar_after: Option<crate::engine::GrammarAfter>,
    /// A cap on the reasoning tokens.
    pub think: Option<ThinkBudget>,
    /// Verify window (1: plain decoding; more: MTP speculative decoding).
    pub window: usize,
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
        /// A speculative generation's counters.
        spec: Option<SpecCounts>,
    },
    Error(String),
}

enum Phase<'m, Q2: Backend, Q4: Qwen4expOps> {
    Prefill { next: usize },
    Decode(Box<Gen<'m, Q2, Q4>>),
}

struct Active<'m, Q2: Backend, Q4: Qwen4expOps> {
    job: Job,
    phase: Phase<'m, Q2, Q4>,
    started: Instant,
}

struct Slot<'m, Q2: Backend, Q4: Qwen4expOps> {
    seq: Seq<Q2, Q4>,
    active: Option<Active<'m, Q2, Q4>>,
    last_used: u64,
}

pub struct WorkerConfig {
    pub parallel: usize,
    pub n_ctx: usize,
    pub cache_ram: usize,
    pub draft_oracle: Option<crate::engine::DraftOracle>,
}

/// How a slot's turn left its job.
enum Turn {
    Running,
    Done(Finish),
    /// The client went away (or a stop string matched): nobody reads further tokens.
    Cancelled,
    Failed(anyhow::Error),
}

/// Runs until shutdown is flagged in `shared` or the queue's senders are all gone.
pub fn run<Q2: Backend, Q4: Qwen4expOps>(
    model: ModelHandle<Q2, Q4>,
    tok: Arc<Tokenizer>,
    cfg: WorkerConfig,
    jobs: Receiver<Job>,
    shared: Arc<Shared>,
) {
    let model = &model;
    let mut slots: Vec<Slot<'_, Q2, Q4>> = Vec::new();
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
    let eog = Arc::new(tok.eog_ids());
    loop {
        if shared.shutting_down() {
            for s in &mut slots {
                if let Some(a) = end_job(model, s, false) {
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
            admit(model, &mut slots, job, clock, &shared);
        }
        for slot in slots.iter_mut() {
            if slot.active.is_none() {
                continue;
            }
            clock += 1;
            slot.last_used = clock;
            let ctx = TurnCtx {
                n_ctx: cfg.n_ctx,
                is_eog: &is_eog,
                eog: &eog,
                oracle: &cfg.draft_oracle,
                clock,
                shared: &shared,
            };
            match turn(model, slot, &ctx) {
                Turn::Running => {}
                Turn::Done(finish) => {
                    let spec = match slot.active.as_ref().map(|a| &a.phase) {
                        Some(Phase::Decode(g)) => g.spec_counts(),
                        _ => None,
                    };
                    if let Some(a) = end_job(model, slot, true) {
                        let _ = slot.seq.checkpoint(model, clock);
                        if let Some(s) = &spec {
                            shared.metrics.add_spec(s);
                        }
                        let _ = a.job.events.send(Event::Done { finish, spec });
                        log_done(&a, &slot.seq, Some(finish));
                    }
                }
                Turn::Cancelled => {
                    end_job(model, slot, true);
                    shared.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Turn::Failed(e) => {
                    if let Some(a) = end_job(model, slot, false) {
                        tracing::warn!("generation failed: {e:#}");
                        let _ = a.job.events.send(Event::Error(format!("{e:#}")));
                    }
                }
            }
            if slot.active.is_none() {
                shared.metrics.processing.fetch_sub(1, Ordering::Relaxed);
            }
        }
        enforce_budget(model, &mut slots, cfg.cache_ram, &shared);
    }
}

/// Takes a slot's job out, giving its sequence back to the slot (a speculative generation
/// holds it meanwhile); `ok`: the sequence's state is whole (else it starts afresh).
fn end_job<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    ok: bool,
) -> Option<Active<'m, Q2, Q4>> {
    let mut a = slot.active.take()?;
    if let Phase::Decode(g) = std::mem::replace(&mut a.phase, Phase::Prefill { next: 0 }) {
        if let Err(e) = g.release(model, &mut slot.seq, ok) {
            tracing::warn!("returning a sequence to its slot: {e:#}");
        }
    } else if !ok {
        if let Err(e) = slot.seq.reset(model) {
            tracing::warn!("resetting a sequence: {e:#}");
        }
    }
    Some(a)
}

fn log_done<Q2: Backend, Q4: Qwen4expOps>(
    a: &Active<'_, Q2, Q4>,
    seq: &Seq<Q2, Q4>,
    finish: Option<Finish>,
) {
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

fn admit<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slots: &mut [Slot<'m, Q2, Q4>],
    job: Job,
    clock: u64,
    shared: &Shared,
) {
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
    // A speculative job also needs the MTP head's state: its last row pairs a position with
    // the token after it, which the new prompt must repeat.
    let rolled = if job.window > 1 {
        slot.seq.rollback_head(model, common, &job.prompt)
    } else {
        slot.seq.rollback(model, common, false)
    };
    let reached = match rolled {
        Ok(r) => r,
        Err(e) => {
            let _ = slot.seq.reset(model);
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

/// What every turn reads besides the slot.
struct TurnCtx<'a> {
    n_ctx: usize,
    is_eog: &'a dyn Fn(u32) -> bool,
    eog: &'a Arc<Vec<u32>>,
    oracle: &'a Option<crate::engine::DraftOracle>,
    clock: u64,
    shared: &'a Shared,
}

/// One unit of work for a slot's active job: a prefill chunk, or the prompt's last token with
/// the first generated one, or one verify window.
fn turn<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    ctx: &TurnCtx<'_>,
) -> Turn {
    match turn_inner(model, slot, ctx) {
        Ok(t) => t,
        Err(e) => Turn::Failed(e),
    }
}

fn turn_inner<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    ctx: &TurnCtx<'_>,
) -> anyhow::Result<Turn> {
    let Some(a) = slot.active.as_mut() else {
        return Ok(Turn::Running);
    };
    if a.job.events.is_closed() {
        // The client went away: stop computing tokens nobody reads.
        return Ok(Turn::Cancelled);
    }
    ctx.shared.web.set_vram(match model {
        ModelHandle::Qwen2(m) => m.backend().device_memory_used(),
        ModelHandle::Qwen4exp(m) => m.backend().device_memory_used(),
    });
    let m = &ctx.shared.metrics;
    let t0 = Instant::now();
    let prompt = &a.job.prompt;
    let out = match &mut a.phase {
        Phase::Prefill { next } => {
            // Stop each chunk at the next checkpoint position, so the state there is saved;
            // the prompt's last token is the decoding loop's.
            let end_prefill = prompt.len() - 1;
            if *next < end_prefill {
                let mut end = (*next + PREFILL_CHUNK).min(end_prefill);
                for &p in &a.job.checkpoint_at {
                    if p > *next && p < end {
                        end = p;
                    }
                }
                // A speculative job keeps the head level with the trunk: it runs over the
                // chunk's rows with the tokens after them.
                let next_tok = (a.job.window > 1).then(|| prompt[end]);
                slot.seq.feed(model, &prompt[*next..end], next_tok)?;
                m.prompt_tokens
                    .fetch_add((end - *next) as u64, Ordering::Relaxed);
                m.prompt_us
                    .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                *next = end;
                if end == end_prefill || a.job.checkpoint_at.contains(&end) {
                    slot.seq.checkpoint(model, ctx.clock)?;
                }
                return Ok(Turn::Running);
            }
            if a.job.max_tokens == 0 {
                return Ok(Turn::Done(Finish::MaxTokens));
            }
            let sampler = a
                .job
                .sampler
                .take()
                .ok_or_else(|| anyhow::anyhow!("the job has no sampler"))?;
            let rules = GenRules {
                max_tokens: a.job.max_tokens,
                n_ctx: ctx.n_ctx,
                top_logprobs: a.job.top_logprobs,
                constraint: a.job.constraint.take(),
                grammar_after: a.job.grammar_after.take(),
                think: a.job.think.take(),
                window: a.job.window,
                eog: Arc::clone(ctx.eog),
                oracle: ctx.oracle.clone(),
            };
            let mut gen = Box::new(Gen::new(
                model,
                &mut slot.seq,
                sampler,
                prompt.len(),
                rules,
            )?);
            let events = &a.job.events;
            let out = gen.step(model, &mut slot.seq, Some(prompt), ctx.is_eog, &|| {
                events.is_closed()
            });
            a.phase = Phase::Decode(gen);
            m.prompt_tokens.fetch_add(1, Ordering::Relaxed);
            m.prompt_us
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            out?
        }
        Phase::Decode(gen) => {
            let events = &a.job.events;
            let out = gen.step(model, &mut slot.seq, None, ctx.is_eog, &|| {
                events.is_closed()
            })?;
            m.predicted_us
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            m.decode_calls.fetch_add(1, Ordering::Relaxed);
            if let Some(d) = ctx.shared.cfg.test_token_delay {
                std::thread::sleep(d);
            }
            out
        }
    };
    for (id, logprob) in out.tokens {
        m.predicted_tokens.fetch_add(1, Ordering::Relaxed);
        if a.job.events.send(Event::Token { id, logprob }).is_err() {
            return Ok(Turn::Cancelled);
        }
    }
    Ok(match out.finish {
        None => Turn::Running,
        Some(Finish::Closed) => Turn::Cancelled,
        Some(f) => Turn::Done(f),
    })
}

/// Drops the oldest checkpoints, across slots, until they fit in `budget` bytes.
fn enforce_budget<Q2: Backend, Q4: Qwen4expOps>(
    model: &ModelHandle<Q2, Q4>,
    slots: &mut [Slot<'_, Q2, Q4>],
    budget: usize,
    shared: &Shared,
) {
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
