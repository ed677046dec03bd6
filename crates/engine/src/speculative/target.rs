//! The target of speculative decoding: the trunk's side. It runs the prompt, verifies a window
//! `[pending, d_1, …, d_{N−1}]` as one batch (row `i` gives exactly the bits of a single decode
//! step, DESIGN.md §3) with what rolls the window back kept beside it (the start's checkpoint
//! and the recurrences' replay log), and commits what the judge kept: a prefix of the window
//! (attention caches truncated, recurrent states restored and advanced over the kept rows),
//! the window's start (the checkpoint), or a rebuild of the whole sequence.
//!
//! A window's pass comes in two halves, so that it can run as rows of a batched forward beside
//! other sequences' rows (`crate::batch`): [`Target::window_item`] checkpoints the start and
//! hands out the window's batch item (the state, the replay log, the hidden rows wanted), and
//! [`Target::window_ran`] takes that item's results back. A window run alone is a batch of one.
//!
//! It knows nothing of drafts: the drafter ([`super::drafter`]) takes the pre-mixer rows the
//! target keeps for it (`hidden`) and catches up on the committed tokens.

use std::time::Instant;

use crate::backend::{DeviceBuf, DevicePick};
use crate::decode::Verified;
use crate::error::{EngineError, Result};
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::{BatchItem, BatchOut, Checkpoint, Model, ReplayLog, State, Want};

use super::SpecStats;

/// A verify window's roll-back material: where it starts, its rows, the start's checkpoint and
/// the recurrences' replay log (filled by the window's forward pass).
struct Window<B: Qwen4expOps> {
    pos0: usize,
    rows: usize,
    checkpoint: Option<Checkpoint<B>>,
    log: ReplayLog<B>,
    started: Instant,
}

/// A verify pass waiting for the judge's ruling: its window and the rows' pre-mixer states.
struct Ran<B: Qwen4expOps> {
    window: Window<B>,
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
    /// The window handed out as a batch item and not yet run ([`Target::window_item`]).
    begun: Option<Window<B>>,
    /// What the last verify pass left to commit.
    verified: Option<Ran<B>>,
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
            begun: None,
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

    /// Runs `tokens` (a prompt, or a chat's next turn) alone: the logits after the last of
    /// them, and (with a drafter) every row's pre-mixer state for its catch-up.
    pub(crate) fn run_rows(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, Option<B::Buf>)> {
        let model = self.model;
        let out = model
            .forward_batch_dev(&mut [self.rows_item(tokens)])?
            .pop()
            .ok_or_else(|| EngineError::shape("prefill", "no result for the rows"))?;
        Ok((model.backend().download(&out.logits)?, out.hidden))
    }

    /// The batch item of `tokens` continuing the trunk (prompt rows): the last row's logits
    /// and, with a drafter, every row's pre-mixer state for the head to follow. It may run
    /// alone (a batch of one: the solo pass) or beside other sequences' rows.
    pub(crate) fn rows_item<'a>(&'a mut self, tokens: &'a [u32]) -> BatchItem<'a, B> {
        BatchItem {
            state: &mut self.state,
            tokens,
            last_only: true,
            log: None,
            hidden: self.hidden,
        }
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
        match self.run_window(window, keep_start, None, stats)? {
            Verified::Logits(l) => Ok(l),
            Verified::Ids(_) => Err(EngineError::shape("verify", "picks instead of logits")),
        }
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
        match self.run_window(window, keep_start, Some(pick), stats)? {
            Verified::Ids(ids) => Ok(ids),
            Verified::Logits(_) => Err(EngineError::shape("verify", "logits instead of picks")),
        }
    }

    /// The window's forward pass alone: a batch of one.
    fn run_window(
        &mut self,
        window: &[u32],
        keep_start: bool,
        pick: Option<DevicePick>,
        stats: &mut SpecStats,
    ) -> Result<Verified> {
        let model = self.model;
        let item = self.window_item(window, keep_start)?;
        let out = model
            .forward_batch_dev(&mut [item])?
            .pop()
            .ok_or_else(|| EngineError::shape("verify", "no result for the window"))?;
        self.window_ran(out, pick, stats)
    }

    /// The first half of a verify pass: checkpoints the start (for a window of more than one
    /// row, or with `keep_start`: the judge may rewind to it) and returns the batch item that
    /// runs `window` with the replay log and the hidden rows a commit needs. Its forward pass
    /// may run alone or beside other sequences' rows; hand its results to
    /// [`Target::window_ran`].
    pub(crate) fn window_item<'a>(
        &'a mut self,
        window: &'a [u32],
        keep_start: bool,
    ) -> Result<BatchItem<'a, B>> {
        let n = window.len();
        if n == 0 {
            return Err(EngineError::Input("verify: an empty window".to_string()));
        }
        // A window begun and never run (its batch failed) gives its checkpoint back.
        if let Some(cp) = self.begun.take().and_then(|w| w.checkpoint) {
            self.spare_checkpoint.get_or_insert(cp);
        }
        self.verified = None;
        let checkpoint = if n > 1 || keep_start {
            Some(self.take_checkpoint()?)
        } else {
            None
        };
        let Target {
            state,
            hidden,
            begun,
            ..
        } = self;
        let w = begun.insert(Window {
            pos0: state.position(),
            rows: n,
            checkpoint,
            log: ReplayLog::new(),
            started: Instant::now(),
        });
        Ok(BatchItem {
            state,
            tokens: window,
            last_only: false,
            // One row is kept whole or not at all: nothing to replay.
            log: (n > 1).then_some(&mut w.log),
            hidden: *hidden,
        })
    }

    /// The second half of a verify pass: `out` is the results of the item
    /// [`Target::window_item`] gave out. Keeps what a commit needs and returns each row's
    /// logits (downloaded), or with `pick` the token picked after each row on the device (row
    /// `i`'s at position `start + 1 + i`), so only ids cross the boundary.
    pub(crate) fn window_ran(
        &mut self,
        out: BatchOut<B>,
        pick: Option<DevicePick>,
        stats: &mut SpecStats,
    ) -> Result<Verified> {
        let w = self
            .begun
            .take()
            .ok_or_else(|| EngineError::Input("verify: no window was begun".to_string()))?;
        let hidden_rows = out.hidden.as_ref().map(|h| h.rows());
        if self.state.position() != w.pos0 + w.rows
            || out.logits.rows() != w.rows
            || hidden_rows != self.hidden.then_some(w.rows)
        {
            return Err(EngineError::shape(
                "verify",
                format!(
                    "a window of {} rows from position {}: the trunk is at {}, {} logits rows \
                     and {hidden_rows:?} hidden rows came back",
                    w.rows,
                    w.pos0,
                    self.state.position(),
                    out.logits.rows()
                ),
            ));
        }
        let b = self.model.backend();
        let rows = match pick {
            Some(p) => {
                Verified::Ids(b.download_ids(&b.pick_rows(&out.logits, p, w.pos0 as u64 + 1)?)?)
            }
            None => Verified::Logits(b.download(&out.logits)?),
        };
        stats.verify_time += w.started.elapsed();
        stats.passes += 1;
        self.verified = Some(Ran {
            window: w,
            hidden: out.hidden,
        });
        Ok(rows)
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
        let Some(Ran { window: v, hidden }) = self.verified.take() else {
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
                let hidden = match hidden {
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
