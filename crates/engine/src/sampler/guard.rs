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

use super::Sampler;
use crate::decode::{self, Policy};
use crate::error::Result;
use crate::generate::{GenOptions, Generation, Session, SessionStepper, StopReason};

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
/// held-back streaming; `on_token` sees each token once it is final. The decoding loop of
/// [`crate::decode`] with the sequence's explicit slop state.
pub fn generate(
    session: &mut dyn Session,
    prompt: &[u32],
    sampler: &mut Sampler,
    is_eog: &dyn Fn(u32) -> bool,
    opts: &GenOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GuardedGeneration> {
    let policy = Policy {
        slop: sampler.new_slop_state(prompt.len()),
        pick: sampler,
        is_eog,
        window: 1,
    };
    let d = decode::run(&mut SessionStepper(session), prompt, policy, opts, on_token)?;
    Ok(GuardedGeneration {
        generation: Generation {
            tokens: d.tokens,
            stop: match d.stop {
                GuardStop::Plain(r) => r,
                _ => StopReason::Stopped,
            },
            timings: d.timings,
        },
        stop: d.stop,
        rewinds: d.rewinds,
    })
}
