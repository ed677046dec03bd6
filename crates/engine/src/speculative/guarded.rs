//! Speculative decoding under the sampler chain with its explicit slop state: the guarded
//! generation loop of [`crate::sampler::guard`] (slop modes 1 and 2, phrase rewinds, held-back
//! streaming) run on the speculative controller, so that its output is token for token the
//! plain guarded loop's.
//!
//! Each verify row is sampled with [`Sampler::sample_with`] and the sequence's [`SlopState`];
//! the drafts are edited with [`Sampler::penalize_draft`] from that same state (never changed
//! by a draft). When a row completes a listed phrase (or dead-ends), the slop state rolls back
//! to the phrase's first token; the trunk and the MTP head are rolled back to the same point:
//! inside the window by the window roll-back, to the window's start from the step's checkpoint
//! and the saved first draft, and further back by replaying the kept sequence into fresh states
//! (batched rows give the bits of single steps, so a replay is exact). Tokens reach `on_token`
//! only once the slop state commits them.

use std::time::Instant;

use super::{Catchup, DraftPen, NextDraft, SpecDecoder};
use crate::error::{EngineError, Result};
use crate::generate::StopReason;
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::{ReplayLog, Want};
use crate::sampler::guard::GuardStop;
use crate::sampler::slop::{Accepted, DeadEnd, SlopState};
use crate::sampler::{SampleContext, Sampled, Sampler};

/// What a guarded speculative generation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecGeneration {
    /// The tokens handed to `on_token`, in order (the end-of-generation token excluded).
    pub tokens: Vec<u32>,
    pub stop: GuardStop,
    /// Rewinds taken (phrase completions and dead ends).
    pub rewinds: u32,
}

/// The generation's sampling side, shared by the prefill and the verify rows: the same steps
/// as the plain guarded loop, one sampled position at a time.
struct Judge<'a> {
    sampler: &'a mut Sampler,
    slop: Option<SlopState>,
    is_eog: &'a dyn Fn(u32) -> bool,
    on_token: &'a mut dyn FnMut(u32) -> bool,
    max_tokens: usize,
    /// Position of the first generated token.
    start: usize,
    /// Generated tokens, streamed or held back (the slop state's tokens).
    gen: Vec<u32>,
    emitted: usize,
    closed: bool,
    rewinds: u32,
}

enum Verdict {
    /// The token stays and generation goes on.
    Kept(u32),
    /// The sequence was cut back (to `start + gen.len()` tokens); sample there again.
    Rewound,
    /// Generation ends (a kept token may have been recorded first).
    End(GuardStop),
}

impl Judge<'_> {
    /// Samples the token after `history` from `logits` and records it.
    fn judge(&mut self, logits: &[f32], history: &[u32]) -> Result<Verdict> {
        let pos = history.len();
        let sampled = self.sampler.sample_with(
            logits,
            &SampleContext {
                position: pos as u64,
                history,
            },
            self.slop.as_ref(),
        )?;
        let tok = match (sampled, self.slop.as_mut()) {
            (Sampled::Token(t), _) => t,
            (Sampled::DeadEnd, Some(s)) => match s.dead_end() {
                DeadEnd::Rewound { position, .. } => {
                    self.rewinds += 1;
                    self.gen.truncate(position - self.start);
                    return Ok(Verdict::Rewound);
                }
                DeadEnd::Stop => return Ok(Verdict::End(GuardStop::DeadEnd)),
            },
            (Sampled::DeadEnd, None) => {
                return Err(EngineError::Input(format!(
                    "sampler: every token was banned at position {pos}"
                )))
            }
        };
        if (self.is_eog)(tok) {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::Eog(tok))));
        }
        match self.slop.as_mut() {
            Some(s) => {
                match s.accept(tok) {
                    Accepted::Kept => self.gen.push(tok),
                    Accepted::Rewound { position, .. } => {
                        self.rewinds += 1;
                        self.gen.truncate(position - self.start);
                        return Ok(Verdict::Rewound);
                    }
                    Accepted::Exhausted { position } => {
                        self.gen.truncate(position - self.start);
                        return Ok(Verdict::End(GuardStop::RewindBudget));
                    }
                }
                for i in s.take_commits() {
                    self.emitted = i + 1;
                    let Some(&t) = self.gen.get(i) else { break };
                    if !(self.on_token)(t) {
                        self.closed = true;
                        break;
                    }
                }
            }
            None => {
                self.gen.push(tok);
                self.emitted = self.gen.len();
                self.closed = !(self.on_token)(tok);
            }
        }
        if self.closed {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::Stopped)));
        }
        if self.gen.len() >= self.max_tokens {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::MaxTokens)));
        }
        Ok(Verdict::Kept(tok))
    }

    /// Streams what is still held back (a partial match that never completed is plain text).
    fn finish(mut self, stop: GuardStop) -> SpecGeneration {
        if !self.closed {
            let rest = match self.slop.as_mut() {
                Some(s) => s.flush(),
                None => self.emitted..self.gen.len(),
            };
            for i in rest {
                let Some(&t) = self.gen.get(i) else { break };
                self.emitted = i + 1;
                if !(self.on_token)(t) {
                    break;
                }
            }
        }
        self.gen.truncate(self.emitted);
        SpecGeneration {
            tokens: self.gen,
            stop,
            rewinds: self.rewinds,
        }
    }
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
    if dec.pending.is_some() || dec.state.position() > 0 {
        return Err(EngineError::Input(
            "guarded speculative generation: the sequence has already started".to_string(),
        ));
    }
    let start = prompt.len();
    let slop = sampler.new_slop_state(start);
    // Rewinds happen only where the text is followed; only then is the first draft saved.
    let can_rewind = slop.as_ref().is_some_and(|s| s.compiled().mode() >= 2);
    let mut j = Judge {
        sampler,
        slop,
        is_eog,
        on_token,
        max_tokens,
        start,
        gen: Vec::new(),
        emitted: 0,
        closed: false,
        rewinds: 0,
    };
    if max_tokens == 0 {
        return Ok(j.finish(GuardStop::Plain(StopReason::MaxTokens)));
    }
    let model = dec.model;
    let b = model.backend();

    // Prefill and the first token.
    let t0 = Instant::now();
    let want = Want {
        hidden: dec.mtp.is_some(),
        last_only: true,
        ..Want::default()
    };
    let out = model.forward_dev(&mut dec.state, prompt, want, None)?;
    let logits = b.download(&out.logits)?;
    dec.stats.prefill_time += t0.elapsed();
    let first = loop {
        // A rewind here can only return to this same position: sample it again.
        match j.judge(&logits, prompt)? {
            Verdict::Kept(t) => break Ok(t),
            Verdict::Rewound => continue,
            Verdict::End(stop) => break Err(stop),
        }
    };
    let first = match first {
        Ok(t) => t,
        Err(stop) => {
            if let Some(&t) = j.gen.last() {
                dec.pending = Some(t);
            }
            return Ok(j.finish(stop));
        }
    };
    dec.stats.emitted += 1;
    dec.pending = Some(first);
    if let Some(hidden) = out.hidden {
        let mut next = prompt[1..].to_vec();
        next.push(first);
        dec.catchup = Some(Catchup { hidden, next });
    }

    loop {
        dec.run_catchup()?;
        let pending = dec
            .pending
            .ok_or_else(|| EngineError::Input("guarded speculative step: no token".to_string()))?;
        let pos0 = dec.state.position();
        let max_emit = max_tokens.saturating_sub(j.gen.len()).max(1);
        let saved = match (&dec.next_draft, can_rewind) {
            (Some(d), true) => Some(NextDraft {
                hidden: b.copy(&d.hidden)?,
                logits: d.logits.clone(),
            }),
            _ => None,
        };
        let drafts = dec.draft_chain(
            (dec.window - 1).min(max_emit - 1),
            DraftPen::Sampler(&*j.sampler, j.slop.as_ref()),
        )?;

        let mut window = Vec::with_capacity(1 + drafts.len());
        window.push(pending);
        window.extend_from_slice(&drafts);
        let n = window.len();
        let t0 = Instant::now();
        let cp = if n > 1 || can_rewind {
            Some(dec.take_checkpoint()?)
        } else {
            None
        };
        let mut log = ReplayLog::new();
        let want = Want {
            hidden: dec.mtp.is_some(),
            ..Want::default()
        };
        let out = model.forward_dev(&mut dec.state, &window, want, (n > 1).then_some(&mut log))?;
        let logits = b.download(&out.logits)?;
        let v = model.config().n_vocab;
        let mut end = None;
        let mut accepted = 0;
        let mut kept = 0u64;
        let rewinds0 = j.rewinds;
        for i in 0..n {
            let row = logits
                .get(i * v..(i + 1) * v)
                .ok_or_else(|| EngineError::shape("verify", format!("no logits row {i} of {n}")))?;
            let history = dec.state.tokens().get(..pos0 + i + 1).unwrap_or_default();
            match j.judge(row, history)? {
                Verdict::Kept(t) => {
                    kept += 1;
                    if drafts.get(i) != Some(&t) {
                        break;
                    }
                    accepted += 1;
                }
                Verdict::Rewound => break,
                Verdict::End(stop) => {
                    end = Some(stop);
                    break;
                }
            }
        }
        dec.stats.verify_time += t0.elapsed();
        dec.stats.passes += 1;
        dec.stats.emitted += kept;
        for k in 0..drafts.len() {
            dec.stats.offered[k] += 1;
            if k <= accepted {
                dec.stats.reached[k] += 1;
            }
            if k < accepted {
                dec.stats.accepted[k] += 1;
            }
        }

        // The decoder must now hold the sequence prompt ++ gen: all consumed but the last,
        // which is pending.
        let t1 = Instant::now();
        let mut target = Vec::with_capacity(start + j.gen.len());
        target.extend_from_slice(prompt);
        target.extend_from_slice(&j.gen);
        let len = target.len();
        let consumed = &target[..len - 1];
        let in_window = len > pos0
            && len - 1 <= pos0 + n
            && dec.state.tokens().get(..len - 1) == Some(consumed);
        let keep = (len - 1).saturating_sub(pos0);
        let rewound = j.rewinds > rewinds0;
        match (in_window, keep, cp) {
            (true, 1.., cp) => {
                dec.stats.rewinds_in_window += u64::from(rewound);
                if let Some(cp) = cp {
                    if n > 1 {
                        model.rollback_window(&mut dec.state, &cp, log, keep)?;
                    }
                }
                if let (Some(mtp), Some(mut hidden)) = (dec.mtp.as_mut(), out.hidden) {
                    model.mtp_truncate(mtp, pos0)?;
                    b.truncate_rows(&mut hidden, keep)?;
                    dec.catchup = Some(Catchup {
                        hidden,
                        next: target[pos0 + 1..].to_vec(),
                    });
                }
            }
            (true, 0, Some(cp)) if dec.mtp.is_none() || saved.is_some() => {
                dec.stats.rewinds_at_start += u64::from(rewound);
                model.restore(&mut dec.state, &cp)?;
                if let Some(mtp) = dec.mtp.as_mut() {
                    model.mtp_truncate(mtp, pos0)?;
                }
                dec.catchup = None;
                dec.next_draft = saved;
            }
            _ => {
                dec.stats.rewinds_rebuilt += u64::from(rewound);
                replay(dec, &target)?
            }
        }
        dec.pending = target.last().copied();
        dec.stats.rollback_time += t1.elapsed();
        if let Some(stop) = end {
            return Ok(j.finish(stop));
        }
    }
}

/// Rebuilds the trunk and MTP states from nothing so that they hold `target` but its last
/// token (which becomes the pending one).
fn replay<B: Qwen4expOps>(dec: &mut SpecDecoder<'_, B>, target: &[u32]) -> Result<()> {
    let model = dec.model;
    dec.state = model.new_state()?;
    if dec.mtp.is_some() {
        dec.mtp = Some(model.new_mtp_state()?);
    }
    dec.next_draft = None;
    dec.catchup = None;
    if target.len() >= 2 {
        let want = Want {
            hidden: dec.mtp.is_some(),
            last_only: true,
            ..Want::default()
        };
        let out = model.forward_dev(&mut dec.state, &target[..target.len() - 1], want, None)?;
        if let Some(hidden) = out.hidden {
            dec.catchup = Some(Catchup {
                hidden,
                next: target[1..].to_vec(),
            });
        }
    }
    Ok(())
}
