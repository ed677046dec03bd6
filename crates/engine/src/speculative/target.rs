//! The target of speculative decoding: the trunk's side. It runs the prompt, verifies a window
//! `[pending, d_1, …, d_{N−1}]` as one batch (row `i` gives exactly the bits of a single decode
//! step, DESIGN.md §3) with what rolls the window back kept beside it (the start's checkpoint
//! and the recurrences' replay log), and commits what the judge kept: a prefix of the window
//! (attention caches truncated, recurrent states restored and advanced over the kept rows),
//! the window's start (the checkpoint), or a rebuild of the whole sequence.
//!
//! It knows nothing of drafts: the drafter ([`super::drafter`]) takes the pre-mixer rows the
//! target keeps for it (`hidden`) and catches up on the committed tokens.

use std::time::Instant;

use crate::backend::DevicePick;
use crate::error::Result;
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::{Checkpoint, Model, ReplayLog, State, Want};

use super::SpecStats;

/// A verify pass waiting for the judge's ruling.
struct Verified<B: Qwen4expOps> {
    pos0: usize,
    rows: usize,
    checkpoint: Option<Checkpoint<B>>,
    log: ReplayLog<B>,
    hidden: Option<B::Buf>,
}

/// Where a commit left the trunk, for the drafter to follow.
pub(crate) enum Committed<B: Qwen4expOps> {
    /// The window's first `keep` rows (≥ 1) are kept: the trunk holds positions
    /// `..pos0 + keep`; `hidden` are those rows' pre-mixer states (with a drafter).
    Prefix { pos0: usize, hidden: Option<B::Buf> },
    /// Nothing of the window is kept: the trunk is back at its start, `pos0`.
    Start { pos0: usize },
    /// The trunk was rebuilt from nothing to the judged sequence; `hidden` are every consumed
    /// row's pre-mixer states (with a drafter and at least one consumed token).
    Rebuilt { hidden: Option<B::Buf> },
}

/// The trunk of one speculative sequence.
pub(crate) struct Target<'m, B: Qwen4expOps> {
    model: &'m Model<B>,
    pub(crate) state: State<B>,
    /// Keep the pre-mixer rows of each pass (a drafter follows the trunk).
    hidden: bool,
    /// The checkpoint of the last verify window, kept to be filled again (a window allocates
    /// no state copies: [`Model::checkpoint_into`]).
    spare_checkpoint: Option<Checkpoint<B>>,
    /// What the last verify pass left to commit.
    verified: Option<Verified<B>>,
}

impl<'m, B: Qwen4expOps> Target<'m, B> {
    /// The target over `state`; `window` above 1 allocates the window checkpoint up front.
    pub(crate) fn new(
        model: &'m Model<B>,
        state: State<B>,
        window: usize,
        hidden: bool,
    ) -> Result<Self> {
        let spare_checkpoint = if window > 1 {
            Some(model.checkpoint(&state)?)
        } else {
            None
        };
        Ok(Target {
            model,
            state,
            hidden,
            spare_checkpoint,
            verified: None,
        })
    }

    /// Positions consumed so far.
    pub(crate) fn position(&self) -> usize {
        self.state.position()
    }

    pub(crate) fn tokens(&self) -> &[u32] {
        self.state.tokens()
    }

    /// Runs `tokens` (a prompt): the logits after the last of them, and (with a drafter)
    /// every row's pre-mixer state for its catch-up.
    pub(crate) fn run_rows(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, Option<B::Buf>)> {
        let want = Want {
            hidden: self.hidden,
            last_only: true,
            ..Want::default()
        };
        let out = self
            .model
            .forward_dev(&mut self.state, tokens, want, None)?;
        Ok((self.model.backend().download(&out.logits)?, out.hidden))
    }

    /// A checkpoint of the trunk state now, in the buffers of the last one when there is one.
    fn take_checkpoint(&mut self) -> Result<Checkpoint<B>> {
        match self.spare_checkpoint.take() {
            Some(mut cp) => {
                self.model.checkpoint_into(&self.state, &mut cp)?;
                Ok(cp)
            }
            None => self.model.checkpoint(&self.state),
        }
    }

    /// Consumes `window` and returns one logits row per token. `keep_start`: checkpoint the
    /// start even for one row (the judge may rewind to it).
    pub(crate) fn verify(
        &mut self,
        window: &[u32],
        keep_start: bool,
        stats: &mut SpecStats,
    ) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        let logits = self.run_window(window, keep_start)?;
        let logits = self.model.backend().download(&logits)?;
        stats.verify_time += t0.elapsed();
        stats.passes += 1;
        Ok(logits)
    }

    /// [`Target::verify`] with the picks made where the logits are: one token per row (row
    /// `i`'s at position `start + 1 + i`), so only ids cross the boundary.
    pub(crate) fn verify_picked(
        &mut self,
        window: &[u32],
        pick: DevicePick,
        keep_start: bool,
        stats: &mut SpecStats,
    ) -> Result<Vec<u32>> {
        let t0 = Instant::now();
        let first = self.state.position() as u64 + 1;
        let logits = self.run_window(window, keep_start)?;
        let b = self.model.backend();
        let ids = b.download_ids(&b.pick_rows(&logits, pick, first)?)?;
        stats.verify_time += t0.elapsed();
        stats.passes += 1;
        Ok(ids)
    }

    /// The window's forward pass, with what commits it kept (the logits stay on the device).
    fn run_window(&mut self, window: &[u32], keep_start: bool) -> Result<B::Buf> {
        let n = window.len();
        let pos0 = self.state.position();
        let checkpoint = if n > 1 || keep_start {
            Some(self.take_checkpoint()?)
        } else {
            None
        };
        let mut log = ReplayLog::new();
        let want = Want {
            hidden: self.hidden,
            ..Want::default()
        };
        let out =
            self.model
                .forward_dev(&mut self.state, window, want, (n > 1).then_some(&mut log))?;
        self.verified = Some(Verified {
            pos0,
            rows: n,
            checkpoint,
            log,
            hidden: out.hidden,
        });
        Ok(out.logits)
    }

    /// Whether a verify pass waits for its commit.
    pub(crate) fn has_verified(&self) -> bool {
        self.verified.is_some()
    }

    /// Makes the trunk hold `seq` but its last token after the last verify pass: inside the
    /// window by the window roll-back, to the window's start from the checkpoint (only when
    /// `can_restart`: the drafter can follow there), else by a replay of `seq` into a fresh
    /// state (batched rows give the bits of single steps, so a replay is exact). `rewound`:
    /// the judge rewound, so the kept tokens need not be the window's own prefix.
    pub(crate) fn commit(
        &mut self,
        seq: &[u32],
        rewound: bool,
        can_restart: bool,
        stats: &mut SpecStats,
    ) -> Result<Committed<B>> {
        let Some(v) = self.verified.take() else {
            return self.rebuild(seq);
        };
        let model = self.model;
        let (pos0, n) = (v.pos0, v.rows);
        let len = seq.len();
        // Without a rewind the kept tokens are the window's own prefix (no full comparison).
        let in_window = len > pos0
            && len - 1 <= pos0 + n
            && (!rewound || self.state.tokens().get(..len - 1) == seq.get(..len - 1));
        let keep = (len - 1).saturating_sub(pos0);
        let r = u64::from(rewound);
        match (in_window, keep, v.checkpoint) {
            (true, 1.., cp) => {
                stats.rewinds_in_window += r;
                if let Some(cp) = cp {
                    if n > 1 {
                        model.rollback_window(&mut self.state, &cp, v.log, keep)?;
                    }
                    self.spare_checkpoint = Some(cp);
                }
                let hidden = match v.hidden {
                    Some(mut h) => {
                        model.backend().truncate_rows(&mut h, keep)?;
                        Some(h)
                    }
                    None => None,
                };
                Ok(Committed::Prefix { pos0, hidden })
            }
            (true, 0, Some(cp)) if can_restart => {
                stats.rewinds_at_start += r;
                model.restore(&mut self.state, &cp)?;
                self.spare_checkpoint = Some(cp);
                Ok(Committed::Start { pos0 })
            }
            _ => {
                stats.rewinds_rebuilt += r;
                self.rebuild(seq)
            }
        }
    }

    /// Rebuilds the trunk state from nothing so that it holds `seq` but its last token.
    fn rebuild(&mut self, seq: &[u32]) -> Result<Committed<B>> {
        let model = self.model;
        self.state = model.new_state()?;
        self.verified = None;
        let mut hidden = None;
        if seq.len() >= 2 {
            let want = Want {
                hidden: self.hidden,
                last_only: true,
                ..Want::default()
            };
            let out = model.forward_dev(&mut self.state, &seq[..seq.len() - 1], want, None)?;
            hidden = out.hidden;
        }
        Ok(Committed::Rebuilt { hidden })
    }
}
