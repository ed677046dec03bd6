//! Speculative decoding under the sampler chain with its explicit slop state: the guarded
//! generation loop of [`crate::sampler::guard`] (slop modes 1 and 2, phrase rewinds, held-back
//! streaming) run on the speculative controller, so that its output is token for token the
//! plain guarded loop's.
//!
//! It is the decoding loop of [`crate::decode`] with the speculative decoder as its stepper and
//! the sampler with the sequence's explicit slop state as its judge: each verify row is sampled
//! with [`Sampler::sample_with`] and that state; the drafts are edited with
//! [`Sampler::penalize_draft`] from the same state (never changed by a draft). When a row
//! completes a listed phrase (or dead-ends), the slop state rolls back to the phrase's first
//! token and the decoder settles onto the same point (see `SpecDecoder::settle_verified`).
//! Tokens reach `on_token` only once the slop state commits them.

use crate::decode::{self, Policy};
use crate::error::{EngineError, Result};
use crate::generate::GenOptions;
use crate::qwen4exp::ops::Qwen4expOps;
use crate::sampler::guard::GuardStop;
use crate::sampler::Sampler;

use super::SpecDecoder;

/// What a guarded speculative generation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecGeneration {
    /// The tokens handed to `on_token`, in order (the end-of-generation token excluded).
    pub tokens: Vec<u32>,
    pub stop: GuardStop,
    /// Rewinds taken (phrase completions and dead ends).
    pub rewinds: u32,
}

/// Generates up to `max_tokens` tokens after `prompt` with `dec` (fresh) and `sampler`, with
/// the guarded loop's semantics: `on_token` sees each token once it is final, and the output is
/// the plain [`crate::sampler::guard::generate`]'s for the same model and sampler.
pub fn generate<B: Qwen4expOps>(
    dec: &mut SpecDecoder<'_, B>,
    prompt: &[u32],
    sampler: &mut Sampler,
    is_eog: &dyn Fn(u32) -> bool,
    max_tokens: usize,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<SpecGeneration> {
    if prompt.is_empty() {
        return Err(EngineError::Input("the prompt has no tokens".to_string()));
    }
    let window = dec.window;
    let policy = Policy {
        slop: sampler.new_slop_state(prompt.len()),
        pick: sampler,
        is_eog,
        window,
    };
    let opts = GenOptions {
        max_tokens,
        ..GenOptions::default()
    };
    let d = decode::run(dec, prompt, policy, &opts, on_token)?;
    Ok(SpecGeneration {
        tokens: d.tokens,
        stop: d.stop,
        rewinds: d.rewinds,
    })
}
