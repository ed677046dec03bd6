//! The generation loop with the slop stage's phrase level (DESIGN.md §5, mode 2): when a
//! sampled token completes a listed phrase, the sequence rolls back to the phrase's first token,
//! that token is banned there and the position is sampled again; tokens are handed to the
//! caller only once no partial match can reach them, so nothing streamed is ever taken back.
//!
//! Apart from that it is [`crate::generate::generate`] (prefix reuse, chunked prefill, the
//! same stop rules and timings); with no active slop stage it emits the same tokens.
//!
//! Bounds: at most `max_rewinds` rewinds per generation. When the budget is spent, or when
//! every continuation at a position is banned and the token before it cannot be taken back,
//! generation ends at the last safe token ([`GuardStop`]); a banned phrase is never emitted.

use std::time::Instant;

use super::bound::Sampled;
use super::slop::{Accepted, DeadEnd};
use super::{SampleContext, Sampler};
use crate::error::{EngineError, Result};
use crate::generate::{
    check_prompt, prefill, GenOptions, Generation, Session, StopReason, Timings,
};

/// Why a guarded generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardStop {
    /// One of the plain loop's reasons.
    Plain(StopReason),
    /// A phrase completed after `max_rewinds` rewinds; the output stops before it.
    RewindBudget,
    /// Every continuation was banned and nothing could be rewound.
    DeadEnd,
}

#[derive(Clone, Debug)]
pub struct GuardedGeneration {
    /// The emitted tokens and timings; `generation.stop` is `Stopped` when the slop stage
    /// ended the generation (`stop` says why).
    pub generation: Generation,
    pub stop: GuardStop,
    /// Rewinds taken (phrase completions and dead ends).
    pub rewinds: u32,
}

/// Generates as [`crate::generate::generate`] does, with phrase-level slop rewinds and
/// held-back streaming; `on_token` sees each token once it is final.
pub fn generate(
    session: &mut dyn Session,
    prompt: &[u32],
    sampler: &mut Sampler,
    is_eog: &dyn Fn(u32) -> bool,
    opts: &GenOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GuardedGeneration> {
    check_prompt(session, prompt)?;
    let mut t = Timings::default();
    let mut out = GuardedGeneration {
        generation: Generation {
            tokens: Vec::new(),
            stop: StopReason::MaxTokens,
            timings: Timings::default(),
        },
        stop: GuardStop::Plain(StopReason::MaxTokens),
        rewinds: 0,
    };
    if opts.max_tokens == 0 {
        return Ok(out);
    }
    let mut logits = prefill(session, prompt, opts, &mut t)?;

    let start = prompt.len();
    let mut slop = sampler.new_slop_state(start);
    let mut gen: Vec<u32> = Vec::new();
    let mut emitted = 0usize;
    let mut closed = false;
    // Rolls the session back so that it holds `pos` tokens and returns the logits there.
    let roll = |session: &mut dyn Session, gen: &[u32], pos: usize, t: &mut Timings| {
        let td = Instant::now();
        session.rewind(pos - 1)?;
        let last = if pos - 1 < start {
            prompt[pos - 1]
        } else {
            gen[pos - 1 - start]
        };
        let l = session.feed(&[last]);
        t.decode += td.elapsed();
        t.decoded_tokens += 1;
        l
    };
    let stop = loop {
        let pos = session.tokens().len();
        let ts = Instant::now();
        let sampled = sampler.sample_with(
            &logits,
            &SampleContext {
                position: pos as u64,
                history: session.tokens(),
            },
            slop.as_ref(),
        )?;
        t.sample += ts.elapsed();
        t.sampled_tokens += 1;
        let tok = match (sampled, slop.as_mut()) {
            (Sampled::Token(tok), _) => tok,
            (Sampled::DeadEnd, Some(s)) => match s.dead_end() {
                DeadEnd::Rewound { position, .. } => {
                    out.rewinds += 1;
                    gen.truncate(position - start);
                    logits = roll(session, &gen, position, &mut t)?;
                    continue;
                }
                DeadEnd::Stop => break GuardStop::DeadEnd,
            },
            (Sampled::DeadEnd, None) => {
                return Err(EngineError::Input(format!(
                    "sampler: every token was banned at position {pos}"
                )))
            }
        };
        if is_eog(tok) {
            break GuardStop::Plain(StopReason::Eog(tok));
        }
        match slop.as_mut() {
            Some(s) => {
                match s.accept(tok) {
                    Accepted::Kept => gen.push(tok),
                    Accepted::Rewound { position, .. } => {
                        out.rewinds += 1;
                        gen.truncate(position - start);
                        logits = roll(session, &gen, position, &mut t)?;
                        continue;
                    }
                    Accepted::Exhausted { position } => {
                        gen.truncate(position - start);
                        break GuardStop::RewindBudget;
                    }
                }
                for i in s.take_commits() {
                    emitted = i + 1;
                    if !on_token(gen[i]) {
                        closed = true;
                        break;
                    }
                }
            }
            None => {
                gen.push(tok);
                emitted = gen.len();
                closed = !on_token(tok);
            }
        }
        if closed {
            break GuardStop::Plain(StopReason::Stopped);
        }
        if gen.len() >= opts.max_tokens {
            break GuardStop::Plain(StopReason::MaxTokens);
        }
        if pos + 1 >= session.n_ctx() {
            break GuardStop::Plain(StopReason::ContextFull);
        }
        let td = Instant::now();
        logits = session.feed(&[tok])?;
        t.decode += td.elapsed();
        t.decoded_tokens += 1;
    };
    if !closed {
        // Whatever is still held back is a partial match that never completed: plain text.
        let rest = match slop.as_mut() {
            Some(s) => s.flush(),
            None => emitted..gen.len(),
        };
        for i in rest {
            emitted = i + 1;
            if !on_token(gen[i]) {
                break;
            }
        }
    }
    gen.truncate(emitted);
    out.generation.tokens = gen;
    out.generation.stop = match stop {
        GuardStop::Plain(r) => r,
        _ => StopReason::Stopped,
    };
    out.generation.timings = t;
    out.stop = stop;
    Ok(out)
}
