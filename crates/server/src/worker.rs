//! The worker thread: it owns the model and the `--parallel` sequence slots, takes jobs from a
//! bounded queue, and steps the active sequences with continuous batching (issue 15): each step
//! gathers the decode row of every running plain sequence, the last prompt token of those about
//! to generate, and at most one chunk's worth of prompt tokens of the joining sequences (oldest
//! first, so short prompts join together; cut to the step's token budget,
//! [`WorkerConfig::batch_tokens`]), and runs them as ONE forward pass
//! ([`Seq::feed_batch`]); each sequence gets exactly the bits it would alone. Sequences join and
//! leave between steps, so a long prompt never holds the running streams up by more than one
//! chunk, and a prefill always advances (no starvation). A speculative (MTP) sequence's verify
//! window (the pending token and its drafts) is rows of the same pass, one window per step, and
//! so are its prompt's chunks (in the same budget and order as the plain ones), the MTP head
//! following each chunk's rows after the pass.
//! HTTP handlers see the worker only through a [`Job`]'s
//! event channel: the tokens, as they become final, and how the generation ended. A handler that
//! goes away (client disconnect, a stop string matched) closes its channel, and the worker frees
//! the job's slot at the start of the next step.
//!
//! A new job goes to the free slot whose sequence shares the longest prefix with its prompt
//! (llama-server's slot similarity), else the least recently used one; the slot's sequence rolls
//! back to that prefix ([`crate::engine::Seq::rollback`]) and only the rest is prefilled.
//!
//! Memory ([`crate::memory`]): the state bytes one sequence needs at the context are known at
//! start, and so is how many fit; a job is admitted only while the sequences it would make
//! active fit (else it waits in the queue), and one that cannot fit even alone is refused.

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
    Constraint, Fed, Feed, Finish, Gen, GenRules, ModelHandle, Seq, SpecCounts, StepOut,
    ThinkBudget, TokenLogprob,
};
use crate::Shared;

/// Most prompt tokens of one prefill chunk: large enough to keep the matrix products
/// efficient, small enough that decoding sequences are not held up for long.
const PREFILL_CHUNK: usize = 256;

/// The default token budget of one step ([`WorkerConfig::batch_tokens`]): a full chunk beside
/// up to 256 decode rows. On the CPU a step costs about its rows' weight reads plus their
/// arithmetic; past a few hundred rows the arithmetic dominates, so a larger step only delays
/// every stream's next token.
pub const BATCH_TOKENS: usize = 512;

/// The smallest prefill chunk a step takes when the decode rows use up the budget, so that a
/// joining sequence still advances every step.
const MIN_CHUNK: usize = 16;

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
    /// When it was admitted (the clock): prefill chunks go to the oldest first.
    admitted: u64,
}

struct Slot<'m, Q2: Backend, Q4: Qwen4expOps> {
    seq: Seq<Q2, Q4>,
    active: Option<Active<'m, Q2, Q4>>,
    last_used: u64,
    /// State bytes the slot's sequence may hold: the most its jobs may have reached since it
    /// was last emptied (a cache keeps the rows it grew to).
    held: u64,
}

pub struct WorkerConfig {
    pub parallel: usize,
    pub n_ctx: usize,
    pub cache_ram: usize,
    pub draft_oracle: Option<crate::engine::DraftOracle>,
    /// Most tokens one step runs (decode rows and the prefill chunk; [`BATCH_TOKENS`]).
    pub batch_tokens: usize,
    /// What the sequences' states may hold ([`crate::memory::Budget`]).
    pub memory: crate::memory::Budget,
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
                held: 0,
            }),
            Err(e) => {
                tracing::error!("creating a sequence: {e:#}");
                shared.fail(format!("creating a sequence: {e:#}"));
                return;
            }
        }
    }
    let mut clock = 0u64;
    let mut waiting: Option<Job> = None;
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
        // A waiting job whose client went away leaves the queue.
        if waiting.as_ref().is_some_and(|j| j.events.is_closed()) {
            waiting = None;
            shared.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        // Admit queued jobs while a slot is free and their states fit; wait for one only when
        // nothing runs. A job that does not fit yet waits (first in line) for others to end.
        while slots.iter().any(|s| s.active.is_none()) {
            let busy = slots.iter().any(|s| s.active.is_some());
            let job = match waiting.take() {
                Some(j) => j,
                None => {
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
                    job
                }
            };
            let Some(i) = choose_slot(&slots, &job) else {
                waiting = Some(job);
                break;
            };
            let need = cfg.memory.need(job.prompt.len(), job.max_tokens);
            if !make_room(model, &mut slots, i, need, cfg.memory.limit) {
                if busy {
                    waiting = Some(job);
                } else {
                    let _ = job.events.send(Event::Error(format!(
                        "the request's sequence state ({need} bytes) does not fit in the server's state memory ({} bytes)",
                        cfg.memory.limit
                    )));
                }
                break;
            }
            clock += 1;
            admit(model, &mut slots[i], job, clock, &shared);
            slots[i].held = slots[i].held.max(need);
        }
        clock += 1;
        let ctx = TurnCtx {
            n_ctx: cfg.n_ctx,
            is_eog: &is_eog,
            eog: &eog,
            oracle: &cfg.draft_oracle,
            clock,
            shared: &shared,
        };
        // A job whose client went away frees its slot now, before any work on it.
        for slot in slots.iter_mut() {
            if slot
                .active
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed())
            {
                finish_turn(model, slot, Turn::Cancelled, clock, &shared);
            }
        }
        // Every sequence's rows, speculative prompts and verify windows included, in one
        // forward pass.
        let turns = batch_step(model, &mut slots, &ctx, cfg.batch_tokens);
        for (i, t) in turns {
            slots[i].last_used = clock;
            finish_turn(model, &mut slots[i], t, clock, &shared);
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

/// The free slot for `job`: the one sharing the longest prefix with its prompt; among equals
/// the least recently used.
fn choose_slot<Q2: Backend, Q4: Qwen4expOps>(
    slots: &[Slot<'_, Q2, Q4>],
    job: &Job,
) -> Option<usize> {
    slots
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
}

/// Whether a job needing `need` state bytes can go to slot `i` within `limit`: the other
/// slots' held bytes plus the larger of slot `i`'s and `need`. Idle slots other than `i` give
/// their prefixes up (least recently used first) until it fits.
fn make_room<Q2: Backend, Q4: Qwen4expOps>(
    model: &ModelHandle<Q2, Q4>,
    slots: &mut [Slot<'_, Q2, Q4>],
    i: usize,
    need: u64,
    limit: u64,
) -> bool {
    let total = |slots: &[Slot<'_, Q2, Q4>]| -> u64 {
        slots
            .iter()
            .enumerate()
            .map(|(j, s)| if j == i { s.held.max(need) } else { s.held })
            .fold(0u64, u64::saturating_add)
    };
    while total(slots) > limit {
        let Some(j) = slots
            .iter()
            .enumerate()
            .filter(|(j, s)| *j != i && s.active.is_none() && s.held > 0)
            .min_by_key(|(_, s)| s.last_used)
            .map(|(j, _)| j)
        else {
            return false;
        };
        if let Err(e) = slots[j].seq.reset(model) {
            tracing::warn!("resetting a sequence: {e:#}");
            return false;
        }
        slots[j].held = 0;
    }
    true
}

fn admit<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    job: Job,
    clock: u64,
    shared: &Shared,
) {
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
        admitted: clock,
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

/// The generation of a job whose prompt the sequence now holds but its last token.
fn start_gen<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    seq: &mut Seq<Q2, Q4>,
    job: &mut Job,
    ctx: &TurnCtx<'_>,
) -> anyhow::Result<Box<Gen<'m, Q2, Q4>>> {
    let sampler = job
        .sampler
        .take()
        .ok_or_else(|| anyhow::anyhow!("the job has no sampler"))?;
    let rules = GenRules {
        max_tokens: job.max_tokens,
        n_ctx: ctx.n_ctx,
        top_logprobs: job.top_logprobs,
        constraint: job.constraint.take(),
        grammar_after: job.grammar_after.take(),
        think: job.think.take(),
        window: job.window,
        eog: Arc::clone(ctx.eog),
        oracle: ctx.oracle.clone(),
    };
    Ok(Box::new(Gen::new(
        model,
        seq,
        sampler,
        job.prompt.len(),
        rules,
    )?))
}

/// Sends a step's final tokens to the job's handler; how the job stands after them.
fn send_out(job: &Job, out: StepOut, m: &crate::metrics::Metrics) -> Turn {
    for (id, logprob) in out.tokens {
        m.predicted_tokens.fetch_add(1, Ordering::Relaxed);
        if job.events.send(Event::Token { id, logprob }).is_err() {
            return Turn::Cancelled;
        }
    }
    match out.finish {
        None => Turn::Running,
        Some(Finish::Closed) => Turn::Cancelled,
        Some(f) => Turn::Done(f),
    }
}

/// Ends a slot's step: a finished job reports and leaves, a cancelled or failed one leaves.
fn finish_turn<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    turn: Turn,
    clock: u64,
    shared: &Shared,
) {
    let was = slot.active.is_some();
    match turn {
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
    if was && slot.active.is_none() {
        shared.metrics.processing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a slot's rows are in a step's batch.
enum Row {
    /// Its plain generation's next window (one token).
    Decode,
    /// Its speculative generation's next verify window: the pending token and the drafts.
    Window,
    /// The prompt's last token, whose logits give the first generated token (speculative:
    /// run by its generation's decoder, which holds the sequence from this step on).
    First,
    /// Prompt tokens up to `end` (no logits read); `follow`: a speculative prompt's token
    /// after them, for the MTP head to follow the chunk's rows after the pass.
    Chunk { end: usize, follow: Option<u32> },
}

/// One step of continuous batching: every running sequence's decode row or verify window
/// (speculative: the pending token and its drafts), the last prompt token of those about to
/// generate, and one chunk's worth of prompt tokens of the joining ones (oldest first; the
/// budget's rest, at least [`MIN_CHUNK`] and at most [`PREFILL_CHUNK`] tokens in all) in one
/// forward pass; after it, the MTP head of each speculative prompt's chunk follows the chunk's
/// rows. Returns each slot's turn.
fn batch_step<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slots: &mut [Slot<'m, Q2, Q4>],
    ctx: &TurnCtx<'_>,
    budget: usize,
) -> Vec<(usize, Turn)> {
    let mut turns = Vec::new();
    let mut plan: Vec<(usize, Row, Vec<u32>)> = Vec::new();
    let mut used = 0;
    for (i, slot) in slots.iter_mut().enumerate() {
        let Some(a) = slot.active.as_mut() else {
            continue;
        };
        match &mut a.phase {
            Phase::Decode(gen) => match gen.begin(model, &mut slot.seq) {
                Ok(w) => {
                    used += w.len();
                    let row = match gen.speculative() {
                        true => Row::Window,
                        false => Row::Decode,
                    };
                    plan.push((i, row, w));
                }
                Err(e) => turns.push((i, Turn::Failed(e))),
            },
            Phase::Prefill { next } if *next + 1 >= a.job.prompt.len() => {
                if a.job.max_tokens == 0 {
                    turns.push((i, Turn::Done(Finish::MaxTokens)));
                    continue;
                }
                let last = a.job.prompt[*next];
                // A speculative generation's decoder takes the sequence now: the prompt's last
                // token is its item in the batch.
                if a.job.window > 1 {
                    match start_gen(model, &mut slot.seq, &mut a.job, ctx) {
                        Ok(gen) => a.phase = Phase::Decode(gen),
                        Err(e) => {
                            turns.push((i, Turn::Failed(e)));
                            continue;
                        }
                    }
                }
                used += 1;
                plan.push((i, Row::First, vec![last]));
            }
            Phase::Prefill { .. } => {}
        }
    }
    // Prompt tokens of joining sequences, oldest first: one chunk's worth in all (at most
    // PREFILL_CHUNK, and the budget's rest but at least MIN_CHUNK), so the running streams
    // never wait for more than one chunk, and short prompts join together.
    let mut joining: Vec<(u64, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let a = s.active.as_ref()?;
            match a.phase {
                Phase::Prefill { next } if next + 1 < a.job.prompt.len() => Some((a.admitted, i)),
                _ => None,
            }
        })
        .collect();
    joining.sort_unstable();
    let mut room = budget.saturating_sub(used).clamp(MIN_CHUNK, PREFILL_CHUNK);
    for (_, i) in joining {
        if room == 0 {
            break;
        }
        let Some(a) = slots[i].active.as_ref() else {
            continue;
        };
        let Phase::Prefill { next } = a.phase else {
            continue;
        };
        // Stop the chunk at the next checkpoint position, so the state there is saved; the
        // prompt's last token is the decoding loop's.
        let end_prefill = a.job.prompt.len() - 1;
        let mut end = (next + room).min(end_prefill);
        for &p in &a.job.checkpoint_at {
            if p > next && p < end {
                end = p;
            }
        }
        room -= end - next;
        // A speculative prompt keeps the head level with the trunk: it follows the chunk's
        // rows with the tokens after them.
        let follow = (a.job.window > 1).then(|| a.job.prompt[end]);
        plan.push((
            i,
            Row::Chunk { end, follow },
            a.job.prompt[next..end].to_vec(),
        ));
    }
    // A sequence whose context is full fails alone, before the batch runs.
    plan.retain(|(i, _, toks)| {
        let slot = &slots[*i];
        let room = match slot.active.as_ref().map(|a| &a.phase) {
            Some(Phase::Decode(gen)) => gen.check_room(model, &slot.seq, toks.len()),
            _ => slot.seq.check_room(model, toks.len()),
        };
        match room {
            Ok(()) => true,
            Err(e) => {
                turns.push((*i, Turn::Failed(e)));
                false
            }
        }
    });
    if plan.is_empty() {
        return turns;
    }
    ctx.shared.web.set_vram(match model {
        ModelHandle::Qwen2(m) => m.backend().device_memory_used(),
        ModelHandle::Qwen4exp(m) => m.backend().device_memory_used(),
    });
    let t0 = Instant::now();
    let res = {
        let mut parts: Vec<Option<&mut Slot<'m, Q2, Q4>>> = slots.iter_mut().map(Some).collect();
        let mut items: Vec<Feed<'_, 'm, Q2, Q4>> = Vec::with_capacity(plan.len());
        for (i, row, toks) in &plan {
            let Some(slot) = parts[*i].take() else {
                continue;
            };
            let Slot { seq, active, .. } = slot;
            items.push(match (row, active.as_mut()) {
                (
                    Row::Window,
                    Some(Active {
                        phase: Phase::Decode(gen),
                        ..
                    }),
                ) => Feed::Window {
                    gen: &mut **gen,
                    tokens: toks,
                },
                (
                    Row::First,
                    Some(Active {
                        phase: Phase::Decode(gen),
                        job,
                        ..
                    }),
                ) => Feed::Prompt {
                    gen: &mut **gen,
                    prompt: &job.prompt,
                },
                // Cannot be (the plan was made from the phase); the count check below fails
                // the batch.
                (Row::Window, _) => continue,
                (row, _) => Feed::Seq {
                    seq,
                    tokens: toks,
                    last_only: matches!(row, Row::Chunk { .. }),
                    follow: match row {
                        Row::Chunk { follow, .. } => *follow,
                        _ => None,
                    },
                },
            });
        }
        Seq::feed_batch(model, &mut items)
    };
    let us = t0.elapsed().as_micros() as u64;
    let fed = match res {
        Ok(l) if l.len() == plan.len() => l,
        Ok(_) => {
            for (i, _, _) in plan {
                turns.push((i, Turn::Failed(anyhow::anyhow!("a batch lost a sequence"))));
            }
            return turns;
        }
        Err(e) => {
            tracing::warn!("a batch of {} sequences failed: {e:#}", plan.len());
            for (i, _, _) in plan {
                turns.push((i, Turn::Failed(anyhow::anyhow!("{e:#}"))));
            }
            return turns;
        }
    };
    // The step's time, shared between prompt and decode by their rows.
    let m = &ctx.shared.metrics;
    m.batch_steps.fetch_add(1, Ordering::Relaxed);
    m.batch_sequences
        .fetch_add(plan.len() as u64, Ordering::Relaxed);
    m.batch_sequences_max
        .fetch_max(plan.len() as u64, Ordering::Relaxed);
    let rows: usize = plan.iter().map(|p| p.2.len()).sum();
    let decodes = |r: &Row| matches!(r, Row::Decode | Row::Window);
    let prompt_rows: usize = plan
        .iter()
        .filter(|p| !decodes(&p.1))
        .map(|p| p.2.len())
        .sum();
    let prompt_us = us * prompt_rows as u64 / rows.max(1) as u64;
    m.prompt_us.fetch_add(prompt_us, Ordering::Relaxed);
    m.predicted_us.fetch_add(us - prompt_us, Ordering::Relaxed);
    if plan.len() > 1 {
        let windows = plan.iter().filter(|p| matches!(p.1, Row::Window)).count();
        m.batch_windows.fetch_add(windows as u64, Ordering::Relaxed);
    }
    // Speculative prompt chunks and prompt ends beside other sequences' decode rows.
    let spec = |i: usize| slots[i].active.as_ref().is_some_and(|a| a.job.window > 1);
    let beside = plan
        .iter()
        .filter(|(i, r, _)| {
            matches!(r, Row::Chunk { .. } | Row::First)
                && spec(*i)
                && plan.iter().any(|(j, r, _)| j != i && decodes(r))
        })
        .count();
    m.batch_spec_prompts
        .fetch_add(beside as u64, Ordering::Relaxed);
    let decoding = plan.iter().any(|p| decodes(&p.1));
    for ((i, row, toks), l) in plan.into_iter().zip(fed) {
        let t = deliver(model, &mut slots[i], row, toks.len(), l, ctx).unwrap_or_else(Turn::Failed);
        turns.push((i, t));
    }
    if decoding {
        m.decode_calls.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = ctx.shared.cfg.test_token_delay {
            std::thread::sleep(d);
        }
    }
    turns
}

/// Hands a slot the results of its rows in a batch.
fn deliver<'m, Q2: Backend, Q4: Qwen4expOps>(
    model: &'m ModelHandle<Q2, Q4>,
    slot: &mut Slot<'m, Q2, Q4>,
    row: Row,
    n: usize,
    fed: Fed<Q4>,
    ctx: &TurnCtx<'_>,
) -> anyhow::Result<Turn> {
    let Some(a) = slot.active.as_mut() else {
        return Ok(Turn::Running);
    };
    let m = &ctx.shared.metrics;
    let out = match row {
        Row::Chunk { end, follow } => {
            m.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
            if let (Some(next), Fed::Hidden(hidden)) = (follow, fed) {
                slot.seq.follow_head(model, &hidden, next)?;
            }
            a.phase = Phase::Prefill { next: end };
            if end + 1 == a.job.prompt.len() || a.job.checkpoint_at.contains(&end) {
                slot.seq.checkpoint(model, ctx.clock)?;
            }
            return Ok(Turn::Running);
        }
        Row::First => {
            m.prompt_tokens.fetch_add(1, Ordering::Relaxed);
            if let Phase::Prefill { .. } = a.phase {
                a.phase = Phase::Decode(start_gen(model, &mut slot.seq, &mut a.job, ctx)?);
            }
            let Phase::Decode(gen) = &mut a.phase else {
                anyhow::bail!("the prompt's end for a sequence without its generation");
            };
            let events = &a.job.events;
            gen.end(
                model,
                &mut slot.seq,
                fed,
                Some(&a.job.prompt),
                ctx.is_eog,
                &|| events.is_closed(),
            )?
        }
        Row::Decode | Row::Window => {
            let Phase::Decode(gen) = &mut a.phase else {
                anyhow::bail!("a decode row for a sequence that is not decoding");
            };
            let events = &a.job.events;
            gen.end(model, &mut slot.seq, fed, None, ctx.is_eog, &|| {
                events.is_closed()
            })?
        }
    };
    Ok(send_out(&a.job, out, m))
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
