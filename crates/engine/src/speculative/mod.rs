//! The speculative controller: MTP drafts, one batched verify pass of the trunk over the window,
//! acceptance of the longest matching prefix plus the trunk's next token, and exact roll-back.
//!
//! One step, with the trunk at position `P` and the last emitted token `x_P` not yet consumed:
//! 1. draft chain: the first draft `d_1` (a guess of `x_{P+1}`) was computed at the end of the
//!    previous step; each further draft runs the MTP head once more on its own pre-mixer output
//!    and the previous draft, one position on, until the window holds `N − 1` drafts, the draft
//!    floor (`min_p`) cuts it, or the hook ends it;
//! 2. verify: the trunk runs `[x_P, d_1, …]` as one batch (row `i` gives exactly the bits of a
//!    single decode step, DESIGN.md §3), and the picker chooses the token after each row;
//! 3. accept the drafts while they equal the trunk's choices, then the trunk's next choice: every
//!    emitted token is the token plain decoding would emit;
//! 4. roll back to the kept rows: attention caches truncated, recurrent states restored from the
//!    checkpoint and advanced over the kept rows from the logged recurrence inputs;
//! 5. MTP catch-up: the MTP layer's cache is cut back to `P` and the kept rows run through the
//!    head with the trunk's states and the now-known next tokens; its last row is the next
//!    step's first draft.
//!
//! Invariant between steps: the trunk state and the MTP state both hold exactly the consumed
//! tokens (`position()` equal), as if the sequence had been decoded one token at a time.

pub mod draft_vocab;
pub mod guarded;

use std::time::{Duration, Instant};

use crate::decode::{self, ByPicker, Decoding, DraftEdit, Judged, Pick, Policy, Stepper};
use crate::error::{EngineError, Result};
use crate::generate::{GenOptions, Timings};
use crate::qwen4exp::mtp::MtpState;
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::{Checkpoint, Model, ReplayLog, State, Want};
use crate::sampler::{SampleContext, Sampler};

/// The draft chain's pick (ties to the lower index, NaN never chosen): the catalogue's
/// `mtp_pick`, re-exported under the name callers know.
pub use crate::kernels::pick::argmax;
pub use draft_vocab::DraftVocab;

/// The largest verify window (rows of one trunk pass).
pub const MAX_WINDOW: usize = 8;

#[derive(Clone, Debug)]
pub struct SpecConfig {
    /// Verify window `N` (1..=8): up to `N − 1` drafts per pass; 1 is plain decoding.
    pub window: usize,
    /// Draft floor: the chain stops at the first draft whose probability under the draft's
    /// softmax (over the draft vocabulary) is below this. 0 disables it.
    pub min_p: f32,
    /// LM-head rows the draft computes (None: the full vocabulary).
    pub draft_vocab: Option<DraftVocab>,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            window: 4,
            min_p: 0.0,
            draft_vocab: None,
        }
    }
}

/// Chooses the token at absolute position `position` from the trunk's logits for it, given the
/// `history` before it. Draws must depend only on these, never on batching, so that
/// speculation cannot change the output (DESIGN.md §3, determinism 4).
pub trait Picker: Send {
    fn pick(&mut self, logits: &[f32], position: usize, history: &[u32]) -> Result<u32>;

    /// Edits the draft logits for the token at `position` after `history` (drafts included) the
    /// way `pick` will edit the trunk's, so drafts follow the same penalties; `inverse` maps a
    /// full-vocabulary id to its index in `draft_logits` (or −1). Default: no edits.
    fn penalize_draft(
        &self,
        _draft_logits: &mut [f32],
        _inverse: &[i32],
        _position: usize,
        _history: &[u32],
    ) {
    }
}

/// Greedy decoding: the largest logit, ties to the lower id — the plain loop's greedy pick
/// ([`crate::sampler::argmax`], which refuses NaN logits), so both loops choose alike.
#[derive(Clone, Copy, Debug, Default)]
pub struct Greedy;

impl Picker for Greedy {
    fn pick(&mut self, logits: &[f32], _position: usize, _history: &[u32]) -> Result<u32> {
        crate::sampler::argmax(logits)
    }
}

/// The sampler chain: its random pick draws from Philox keyed by (seed, position), so a
/// speculative run samples exactly the tokens plain sampling does.
impl Picker for Sampler {
    fn pick(&mut self, logits: &[f32], position: usize, history: &[u32]) -> Result<u32> {
        self.sample(
            logits,
            &SampleContext {
                position: position as u64,
                history,
            },
        )
    }

    fn penalize_draft(
        &self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        position: usize,
        history: &[u32],
    ) {
        Sampler::penalize_draft(
            self,
            draft_logits,
            inverse,
            &SampleContext {
                position: position as u64,
                history,
            },
            None,
        );
    }
}

/// Probability of the entry at `idx` under the softmax of `v`.
fn softmax_prob(v: &[f32], idx: usize) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = v.iter().map(|&x| (x - m).exp()).sum();
    match v.get(idx) {
        Some(&x) if sum > 0.0 => (x - m).exp() / sum,
        _ => 0.0,
    }
}

/// A test and benchmark hook over the drafts: called for each draft in chain order with the
/// absolute position of the drafted token and the MTP's proposal; returns the draft to use
/// (which the chain then continues from) or None to end the chain there.
pub trait DraftHook: Send {
    fn draft(&mut self, position: usize, proposed: u32) -> Option<u32>;
}

/// What the speculative path did (kept for the server to expose; serializes to JSON).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    pub window: usize,
    /// Verify passes of the trunk (not counting the prefill).
    pub passes: u64,
    /// Tokens emitted, including the prefill's.
    pub emitted: u64,
    /// Per draft step `j` (index 0 = first draft): drafts offered, reached (every earlier
    /// draft of the window accepted, so this one was judged) and accepted.
    pub offered: Vec<u64>,
    pub reached: Vec<u64>,
    pub accepted: Vec<u64>,
    /// Chained MTP steps run (each first draft comes from the catch-up pass instead).
    pub draft_steps: u64,
    pub prefill_time: Duration,
    pub verify_time: Duration,
    pub draft_time: Duration,
    pub catchup_time: Duration,
    pub rollback_time: Duration,
    /// Guarded loop (`guarded::generate`): verify passes that rewound, by how the trunk and
    /// the head were rolled back to the phrase's first token: inside the window, to the
    /// window's start (checkpoint and saved first draft), or rebuilt by a replay.
    pub rewinds_in_window: u64,
    pub rewinds_at_start: u64,
    pub rewinds_rebuilt: u64,
}

impl SpecStats {
    fn new(window: usize) -> SpecStats {
        SpecStats {
            window,
            offered: vec![0; window.saturating_sub(1)],
            reached: vec![0; window.saturating_sub(1)],
            accepted: vec![0; window.saturating_sub(1)],
            ..SpecStats::default()
        }
    }

    /// Tokens emitted per verify pass (the prefill's token not counted).
    pub fn tokens_per_pass(&self) -> f64 {
        if self.passes == 0 {
            return 0.0;
        }
        (self.emitted.saturating_sub(1)) as f64 / self.passes as f64
    }

    /// Accepted / offered at draft step `j`.
    pub fn acceptance(&self, j: usize) -> Option<f64> {
        match (self.offered.get(j), self.accepted.get(j)) {
            (Some(&o), Some(&a)) if o > 0 => Some(a as f64 / o as f64),
            _ => None,
        }
    }

    /// Accepted / reached at draft step `j`: the chance a draft is right given that the drafts
    /// before it were (the per-step rate speculative engines usually quote).
    pub fn conditional_acceptance(&self, j: usize) -> Option<f64> {
        match (self.reached.get(j), self.accepted.get(j)) {
            (Some(&r), Some(&a)) if r > 0 => Some(a as f64 / r as f64),
            _ => None,
        }
    }

    /// Accepted / offered over all draft steps.
    pub fn acceptance_all(&self) -> Option<f64> {
        let o: u64 = self.offered.iter().sum();
        let a: u64 = self.accepted.iter().sum();
        (o > 0).then(|| a as f64 / o as f64)
    }

    pub fn time_per_pass(&self) -> Duration {
        self.verify_time
            .checked_div(self.passes.max(1) as u32)
            .unwrap_or_default()
    }

    pub fn time_per_draft(&self) -> Duration {
        self.draft_time
            .checked_div(self.draft_steps.max(1) as u32)
            .unwrap_or_default()
    }

    /// A few lines for `--verbose`.
    pub fn report(&self) -> String {
        let mut s = format!(
            "spec: window {} | {} tokens in {} verify passes: {:.2} tokens/pass\n",
            self.window,
            self.emitted,
            self.passes,
            self.tokens_per_pass()
        );
        let pct = |r: Option<f64>| {
            r.map(|r| format!("{:.1}%", 100.0 * r))
                .unwrap_or_else(|| "-".to_string())
        };
        for (j, (o, a)) in self.offered.iter().zip(&self.accepted).enumerate() {
            s += &format!(
                "  draft {}: accepted {a}/{o} offered ({}), {a}/{} reached ({})\n",
                j + 1,
                pct(self.acceptance(j)),
                self.reached.get(j).copied().unwrap_or(0),
                pct(self.conditional_acceptance(j))
            );
        }
        s += &format!(
            "  time: prefill {:.2?}, verify {:.2?} ({:.2?}/pass), draft {:.2?} ({} chained steps, {:.2?}/step), MTP catch-up {:.2?}, roll-back {:.2?}",
            self.prefill_time,
            self.verify_time,
            self.time_per_pass(),
            self.draft_time,
            self.draft_steps,
            self.time_per_draft(),
            self.catchup_time,
            self.rollback_time
        );
        s
    }
}

/// What one [`SpecDecoder::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepOutcome {
    /// Tokens delivered to the callback.
    pub emitted: usize,
    /// Drafts offered and accepted in this pass.
    pub offered: usize,
    pub accepted: usize,
    /// The callback asked to stop.
    pub stopped: bool,
}

/// The first draft of the next window: the MTP's pre-mixer output at the last consumed
/// position (one row) and its logits over the draft rows.
struct NextDraft<B: Qwen4expOps> {
    hidden: B::Buf,
    logits: Vec<f32>,
}

/// A verify pass waiting for the judge's ruling.
struct Verified<B: Qwen4expOps> {
    pos0: usize,
    rows: usize,
    checkpoint: Option<Checkpoint<B>>,
    log: ReplayLog<B>,
    hidden: Option<B::Buf>,
}

/// A catch-up the MTP still owes: the trunk states of the kept rows and their next tokens.
struct Catchup<B: Qwen4expOps> {
    hidden: B::Buf,
    next: Vec<u32>,
}

/// Speculative decoding of one sequence.
pub struct SpecDecoder<'m, B: Qwen4expOps> {
    model: &'m Model<B>,
    window: usize,
    min_p: f32,
    vocab: Option<DraftVocab>,
    /// The draft vocabulary's ids on the device (the LM-head rows a draft computes).
    draft_rows: Option<B::Ids>,
    state: State<B>,
    /// The checkpoint of the last verify window, kept to be filled again (a window allocates
    /// no state copies: [`Model::checkpoint_into`]).
    spare_checkpoint: Option<Checkpoint<B>>,
    /// The trunk's pre-mixer rows of the prefill, until the first token is known (its MTP
    /// catch-up pairs them with the tokens after them).
    prefill_hidden: Option<B::Buf>,
    /// Where the last prefill started (a resumed sequence's prefix was consumed before).
    prefill_from: usize,
    /// What the last verify pass left to settle: its start, rows, checkpoint, replay log and
    /// pre-mixer rows.
    verified: Option<Verified<B>>,
    /// The judge may rewind (slop mode 2): keep the first draft of each window, so that a
    /// rewind to the window's start needs no replay.
    may_rewind: bool,
    saved_first: Option<NextDraft<B>>,
    mtp: Option<MtpState<B>>,
    /// The last emitted token, which the trunk has not consumed yet.
    pending: Option<u32>,
    next_draft: Option<NextDraft<B>>,
    catchup: Option<Catchup<B>>,
    picker: Box<dyn Picker + 'm>,
    hook: Option<Box<dyn DraftHook + 'm>>,
    /// Apply the sampler's edits to the drafts (off only to measure what they buy).
    penalize: bool,
    /// The identity map, for drafts over the full vocabulary.
    full_inverse: Vec<i32>,
    stats: SpecStats,
}

impl<'m, B: Qwen4expOps> SpecDecoder<'m, B> {
    /// A decoder with greedy picking. A window above 1 needs the model's MTP head.
    pub fn new(model: &'m Model<B>, cfg: SpecConfig) -> Result<Self> {
        let state = model.new_state()?;
        Self::resume(model, cfg, state, None)
    }

    /// A decoder continuing a sequence that `state` holds (a server's slot reusing a prefix):
    /// its prefill runs only the prompt past `state`'s tokens. `mtp` is the head's state for
    /// the same tokens (a fresh one when None and the sequence is empty); a window above 1 on a
    /// started sequence needs it, at the trunk's position. [`SpecDecoder::into_states`] gives
    /// both back.
    pub fn resume(
        model: &'m Model<B>,
        cfg: SpecConfig,
        state: State<B>,
        mtp: Option<MtpState<B>>,
    ) -> Result<Self> {
        if !(1..=MAX_WINDOW).contains(&cfg.window) {
            return Err(EngineError::Input(format!(
                "--spec {}: the verify window must be 1..={MAX_WINDOW}",
                cfg.window
            )));
        }
        if !(0.0..=1.0).contains(&cfg.min_p) {
            return Err(EngineError::Input(format!(
                "--spec-min-p {}: expected a probability in [0, 1]",
                cfg.min_p
            )));
        }
        if let Some(v) = &cfg.draft_vocab {
            let n = model.config().n_vocab;
            if let Some(&bad) = v.ids().iter().find(|&&t| t as usize >= n) {
                return Err(EngineError::Input(format!(
                    "draft vocabulary: token {bad} is outside the model's vocabulary of {n}"
                )));
            }
        }
        let mtp = match mtp {
            Some(m) if m.position() != state.position() => {
                return Err(EngineError::Input(format!(
                    "speculative decoding: the MTP state holds {} positions, the sequence {}",
                    m.position(),
                    state.position()
                )))
            }
            Some(m) => Some(m),
            None if cfg.window > 1 && state.position() > 0 => {
                return Err(EngineError::Input(
                    "speculative decoding: a started sequence needs its MTP state".to_string(),
                ))
            }
            None if cfg.window > 1 => Some(model.new_mtp_state()?),
            None => None,
        };
        let full_inverse = if cfg.window > 1 && cfg.draft_vocab.is_none() {
            let n = i32::try_from(model.config().n_vocab).map_err(|_| {
                EngineError::Input("the vocabulary has more than 2^31 tokens".to_string())
            })?;
            (0..n).collect()
        } else {
            Vec::new()
        };
        // The window's checkpoint, allocated up front and refilled every window.
        let spare_checkpoint = if cfg.window > 1 {
            Some(model.checkpoint(&state)?)
        } else {
            None
        };
        let draft_rows = match &cfg.draft_vocab {
            Some(v) if cfg.window > 1 => Some(model.backend().upload_ids(v.ids())?),
            _ => None,
        };
        Ok(SpecDecoder {
            model,
            window: cfg.window,
            min_p: cfg.min_p,
            vocab: cfg.draft_vocab,
            draft_rows,
            state,
            spare_checkpoint,
            prefill_hidden: None,
            prefill_from: 0,
            verified: None,
            may_rewind: false,
            saved_first: None,
            mtp,
            pending: None,
            next_draft: None,
            catchup: None,
            picker: Box::new(Greedy),
            hook: None,
            penalize: true,
            full_inverse,
            stats: SpecStats::new(cfg.window),
        })
    }

    /// Replaces the picker (default: greedy).
    pub fn with_picker(mut self, picker: impl Picker + 'm) -> Self {
        self.picker = Box::new(picker);
        self
    }

    /// Installs a hook over the drafts (tests, forced-acceptance benchmarks).
    pub fn with_draft_hook(mut self, hook: impl DraftHook + 'm) -> Self {
        self.hook = Some(Box::new(hook));
        self
    }

    /// Turns the sampler's edits of the drafts off (on by default): for tests and benchmarks
    /// that measure what they buy; the output does not change, only the acceptance.
    pub fn with_draft_penalties(mut self, on: bool) -> Self {
        self.penalize = on;
        self
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// The trunk state: the consumed tokens (all emitted tokens but the last).
    pub fn state(&self) -> &State<B> {
        &self.state
    }

    pub fn mtp_state(&self) -> Option<&MtpState<B>> {
        self.mtp.as_ref()
    }

    /// The last emitted token (not yet consumed by the trunk).
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Runs the prompt and returns the first generated token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32> {
        if self.pending.is_some() || self.state.position() > 0 {
            return Err(EngineError::Input(
                "prefill: the sequence has already started".to_string(),
            ));
        }
        self.feed(prompt)
    }

    /// Appends `tokens` to the sequence (a prompt, or the next turn of a chat after a
    /// generation: the pending token is consumed first) and returns the token chosen after
    /// them, which becomes the pending token. The MTP state follows, so speculative steps can
    /// continue from here.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<u32> {
        let mut input = Vec::with_capacity(tokens.len() + 1);
        input.extend(self.pending);
        input.extend_from_slice(tokens);
        if input.is_empty() {
            return Err(EngineError::Input("prefill: empty prompt".to_string()));
        }
        // The MTP state must hold every consumed token before new rows are appended.
        self.run_catchup()?;
        self.next_draft = None;
        let t0 = Instant::now();
        let (logits, hidden) = self.run_rows(&input)?;
        let pos = self.state.position();
        let tok = self.picker.pick(&logits, pos, self.state.tokens())?;
        self.stats.prefill_time += t0.elapsed();
        self.stats.emitted += 1;
        self.pending = Some(tok);
        if let Some(hidden) = hidden {
            let mut next = input[1..].to_vec();
            next.push(tok);
            self.catchup = Some(Catchup { hidden, next });
            self.run_catchup()?;
        }
        Ok(tok)
    }

    /// Brings the MTP state up to the trunk's (after a step that stopped early).
    pub fn sync_mtp(&mut self) -> Result<()> {
        self.run_catchup()
    }

    /// The trunk's and the head's states, for a caller that keeps the sequence (call
    /// [`SpecDecoder::sync_mtp`] first so the head holds what the trunk does). The pending
    /// token is not consumed.
    pub fn into_states(self) -> (State<B>, Option<MtpState<B>>) {
        (self.state, self.mtp)
    }

    fn run_catchup(&mut self) -> Result<()> {
        let (Some(c), Some(mtp)) = (self.catchup.take(), self.mtp.as_mut()) else {
            return Ok(());
        };
        let t0 = Instant::now();
        let rows = self.draft_rows.as_ref();
        let (logits, hidden) = self
            .model
            .mtp_forward_dev(mtp, &c.hidden, &c.next, true, rows)?;
        let b = self.model.backend();
        let hidden = b.last_row(hidden)?;
        self.next_draft = Some(NextDraft {
            hidden,
            logits: b.download(&logits)?,
        });
        self.stats.catchup_time += t0.elapsed();
        Ok(())
    }

    /// Runs `tokens` through the trunk: the logits after the last of them, and (with a head)
    /// every row's pre-mixer state for the head's catch-up.
    fn run_rows(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, Option<B::Buf>)> {
        let want = Want {
            hidden: self.mtp.is_some(),
            last_only: true,
            ..Want::default()
        };
        let out = self
            .model
            .forward_dev(&mut self.state, tokens, want, None)?;
        Ok((self.model.backend().download(&out.logits)?, out.hidden))
    }

    /// A checkpoint of the trunk state now, in the buffers of the last one when there is one.
    pub(crate) fn take_checkpoint(&mut self) -> Result<Checkpoint<B>> {
        match self.spare_checkpoint.take() {
            Some(mut cp) => {
                self.model.checkpoint_into(&self.state, &mut cp)?;
                Ok(cp)
            }
            None => self.model.checkpoint(&self.state),
        }
    }

    /// Picks a draft from draft-row logits: (token, probability when the floor is on).
    fn pick_draft(&self, logits: &[f32]) -> (u32, f32) {
        // The catalogue's `mtp_pick` semantics (ties to the lower index, NaN never chosen).
        let i = argmax(logits);
        let tok = match &self.vocab {
            Some(v) => v.ids().get(i).copied().unwrap_or(0),
            None => i as u32,
        };
        let p = if self.min_p > 0.0 {
            softmax_prob(logits, i)
        } else {
            1.0
        };
        (tok, p)
    }

    /// Up to `max` drafts for the positions after the pending token; each draft's logits get
    /// the sampler's edits for the history before it (the consumed tokens, the pending token and
    /// the earlier drafts), so a draft never proposes what the sampler has removed.
    fn draft_chain(&mut self, max: usize, edit: &mut dyn DraftEdit) -> Result<Vec<u32>> {
        let Some(first) = self.next_draft.take() else {
            return Ok(Vec::new());
        };
        let mut drafts = Vec::with_capacity(max);
        if max == 0 {
            return Ok(drafts);
        }
        let base = self.state.position() + 1;
        let mut history = Vec::new();
        if self.penalize {
            history.reserve(base + max);
            history.extend_from_slice(self.state.tokens());
            history.extend(self.pending);
        }
        let mut hidden = first.hidden;
        let mut logits = first.logits;
        loop {
            let j = drafts.len();
            if self.penalize {
                let inverse: &[i32] = match &self.vocab {
                    Some(v) => v.inverse_map(),
                    None => &self.full_inverse,
                };
                edit.edit(&mut logits, inverse, base + j, &history);
                // Everything removed: no draft can be right.
                if !logits.iter().any(|&x| x > f32::NEG_INFINITY) {
                    break;
                }
            }
            let (proposed, p) = self.pick_draft(&logits);
            if p < self.min_p {
                break;
            }
            let tok = match self.hook.as_mut() {
                Some(h) => match h.draft(base + j, proposed) {
                    Some(t) => t,
                    None => break,
                },
                None => proposed,
            };
            drafts.push(tok);
            if self.penalize {
                history.push(tok);
            }
            if drafts.len() == max {
                break;
            }
            let t0 = Instant::now();
            let Some(mtp) = self.mtp.as_mut() else { break };
            let rows = self.draft_rows.as_ref();
            let (lg, hid) = self
                .model
                .mtp_forward_dev(mtp, &hidden, &[tok], true, rows)?;
            logits = self.model.backend().download(&lg)?;
            hidden = hid;
            self.stats.draft_steps += 1;
            self.stats.draft_time += t0.elapsed();
        }
        Ok(drafts)
    }

    /// One verify pass: emits 1..=`max_emit` tokens through `on_token` (which returns false to
    /// stop; the token it was given still counts as emitted). One window of the decoding loop
    /// ([`crate::decode`]) with the decoder's picker.
    pub fn step(
        &mut self,
        max_emit: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<StepOutcome> {
        let Some(pending) = self.pending else {
            return Err(EngineError::Input("step: call prefill first".to_string()));
        };
        if max_emit == 0 {
            return Err(EngineError::Input(
                "step: max_emit must be at least 1".to_string(),
            ));
        }
        let mut seq = self.state.tokens().to_vec();
        seq.push(pending);
        let start = seq.len();
        let window = self.window;
        self.with_picker_taken(|dec, pick| {
            let policy = Policy {
                pick,
                slop: None,
                is_eog: &|_| false,
                window,
            };
            let mut d = Decoding::new(dec, policy, max_emit, start, on_token);
            d.resume(seq);
            let (judged, _) = d.window()?;
            Ok(StepOutcome {
                emitted: judged.kept,
                offered: judged.drafts,
                accepted: judged.accepted,
                stopped: judged.stopped,
            })
        })
    }

    /// Runs `f` with the decoder and its picker apart (the loop borrows both).
    pub(crate) fn with_picker_taken<R>(
        &mut self,
        f: impl FnOnce(&mut Self, &mut dyn Pick) -> Result<R>,
    ) -> Result<R> {
        let mut picker = std::mem::replace(&mut self.picker, Box::new(Greedy));
        let out = f(self, &mut ByPicker(&mut *picker));
        self.picker = picker;
        out
    }

    /// Keeps what the judge ruled on the last pass: the trunk and the head end holding `seq`
    /// but its last token (pending). Inside the window by the window roll-back, to the
    /// window's start from the checkpoint (and the saved first draft), else by a replay of the
    /// kept sequence into fresh states (batched rows give the bits of single steps, so a
    /// replay is exact).
    fn settle_verified(&mut self, v: Verified<B>, seq: &[u32], judged: Judged) -> Result<()> {
        let model = self.model;
        let b = model.backend();
        for k in 0..judged.drafts {
            self.stats.offered[k] += 1;
            if k <= judged.accepted {
                self.stats.reached[k] += 1;
            }
            if k < judged.accepted {
                self.stats.accepted[k] += 1;
            }
        }
        self.stats.emitted += judged.kept as u64;
        let t1 = Instant::now();
        let (pos0, n) = (v.pos0, v.rows);
        let len = seq.len();
        // Without a rewind the kept tokens are the window's own prefix (no full comparison).
        let in_window = len > pos0
            && len - 1 <= pos0 + n
            && (!judged.rewound || self.state.tokens().get(..len - 1) == seq.get(..len - 1));
        let keep = (len - 1).saturating_sub(pos0);
        let saved = self.saved_first.take();
        let rewound = u64::from(judged.rewound);
        match (in_window, keep, v.checkpoint) {
            (true, 1.., cp) => {
                self.stats.rewinds_in_window += rewound;
                if let Some(cp) = cp {
                    if n > 1 {
                        model.rollback_window(&mut self.state, &cp, v.log, keep)?;
                    }
                    self.spare_checkpoint = Some(cp);
                }
                if let (Some(mtp), Some(mut hidden)) = (self.mtp.as_mut(), v.hidden) {
                    model.mtp_truncate(mtp, pos0)?;
                    b.truncate_rows(&mut hidden, keep)?;
                    self.catchup = Some(Catchup {
                        hidden,
                        next: seq[pos0 + 1..].to_vec(),
                    });
                }
            }
            (true, 0, Some(cp)) if self.mtp.is_none() || saved.is_some() => {
                self.stats.rewinds_at_start += rewound;
                model.restore(&mut self.state, &cp)?;
                self.spare_checkpoint = Some(cp);
                if let Some(mtp) = self.mtp.as_mut() {
                    model.mtp_truncate(mtp, pos0)?;
                }
                self.catchup = None;
                self.next_draft = saved;
            }
            _ => {
                self.stats.rewinds_rebuilt += rewound;
                self.replay(seq)?;
            }
        }
        self.pending = seq.last().copied();
        self.stats.rollback_time += t1.elapsed();
        Ok(())
    }

    /// Rebuilds the trunk and MTP states from nothing so that they hold `seq` but its last
    /// token (which becomes the pending one).
    fn replay(&mut self, seq: &[u32]) -> Result<()> {
        let model = self.model;
        self.state = model.new_state()?;
        if self.mtp.is_some() {
            self.mtp = Some(model.new_mtp_state()?);
        }
        self.next_draft = None;
        self.catchup = None;
        if seq.len() >= 2 {
            let want = Want {
                hidden: self.mtp.is_some(),
                last_only: true,
                ..Want::default()
            };
            let out = model.forward_dev(&mut self.state, &seq[..seq.len() - 1], want, None)?;
            if let Some(hidden) = out.hidden {
                self.catchup = Some(Catchup {
                    hidden,
                    next: seq[1..].to_vec(),
                });
            }
        }
        Ok(())
    }
}

/// The speculative decoder as the decoding loop's stepper: drafts from the MTP head, a verify
/// window on the trunk, and exact settling onto the judged sequence.
impl<B: Qwen4expOps> Stepper for SpecDecoder<'_, B> {
    fn n_ctx(&self) -> usize {
        self.model.config().n_ctx
    }

    fn tokens(&self) -> &[u32] {
        self.state.tokens()
    }

    fn prefill(&mut self, prompt: &[u32], _opts: &GenOptions, t: &mut Timings) -> Result<Vec<f32>> {
        // A resumed sequence continues with the prompt's rest; it must be a prefix of it.
        let from = self.state.position();
        if self.pending.is_some()
            || prompt.len() <= from
            || prompt.get(..from) != Some(self.state.tokens())
        {
            return Err(EngineError::Input(
                "speculative generation: the sequence already holds tokens that are not a prefix \
                 of the prompt"
                    .to_string(),
            ));
        }
        self.prefill_from = from;
        let t0 = Instant::now();
        let (logits, hidden) = self.run_rows(&prompt[from..])?;
        self.prefill_hidden = hidden;
        self.stats.prefill_time += t0.elapsed();
        t.prompt = t0.elapsed();
        t.prompt_tokens = prompt.len() - from;
        t.reused_tokens = from;
        Ok(logits)
    }

    fn propose(&mut self, pending: u32, max: usize, edit: &mut dyn DraftEdit) -> Result<Vec<u32>> {
        if self.pending != Some(pending) {
            return Err(EngineError::Input(
                "speculative step: the pending token does not match the sequence".to_string(),
            ));
        }
        self.run_catchup()?;
        self.saved_first = match (&self.next_draft, self.may_rewind) {
            (Some(d), true) => Some(NextDraft {
                hidden: self.model.backend().copy(&d.hidden)?,
                logits: d.logits.clone(),
            }),
            _ => None,
        };
        self.draft_chain(max, edit)
    }

    fn verify(&mut self, window: &[u32]) -> Result<Vec<f32>> {
        let n = window.len();
        let t0 = Instant::now();
        let pos0 = self.state.position();
        let checkpoint = if n > 1 || self.may_rewind {
            Some(self.take_checkpoint()?)
        } else {
            None
        };
        let mut log = ReplayLog::new();
        let want = Want {
            hidden: self.mtp.is_some(),
            ..Want::default()
        };
        let out =
            self.model
                .forward_dev(&mut self.state, window, want, (n > 1).then_some(&mut log))?;
        let logits = self.model.backend().download(&out.logits)?;
        self.verified = Some(Verified {
            pos0,
            rows: n,
            checkpoint,
            log,
            hidden: out.hidden,
        });
        self.stats.verify_time += t0.elapsed();
        self.stats.passes += 1;
        Ok(logits)
    }

    fn settle(&mut self, seq: &[u32], judged: Judged) -> Result<()> {
        match self.verified.take() {
            Some(v) => self.settle_verified(v, seq, judged)?,
            // The prefill's ruling: the first token is pending, the head catches up over the
            // prompt's rows with the tokens after them.
            None => {
                self.stats.emitted += judged.kept as u64;
                let hidden = self.prefill_hidden.take();
                if seq.len() > self.state.position() {
                    self.pending = seq.last().copied();
                    if let Some(hidden) = hidden {
                        self.catchup = Some(Catchup {
                            hidden,
                            next: seq[self.prefill_from + 1..].to_vec(),
                        });
                    }
                }
            }
        }
        // The head follows at once unless the caller stopped (then `sync_mtp` brings it up).
        if !judged.stopped {
            self.run_catchup()?;
        }
        Ok(())
    }

    fn may_rewind(&mut self, yes: bool) {
        self.may_rewind = yes;
    }
}

/// Generates up to `max_new` tokens after `prompt`, speculatively when `cfg.window > 1`;
/// `on_token` sees each token as it is emitted and returns false to stop. Returns the tokens and
/// the statistics.
pub fn generate_spec<B: Qwen4expOps>(
    model: &Model<B>,
    prompt: &[u32],
    max_new: usize,
    cfg: SpecConfig,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(Vec<u32>, SpecStats)> {
    let mut dec = SpecDecoder::new(model, cfg)?;
    let out = run(&mut dec, prompt, max_new, &mut on_token)?;
    Ok((out, dec.stats().clone()))
}

/// Drives `dec` from its prefill to `max_new` tokens (or until `on_token` says stop): the
/// decoding loop with the decoder's picker and no end-of-generation token.
pub fn run<B: Qwen4expOps>(
    dec: &mut SpecDecoder<'_, B>,
    prompt: &[u32],
    max_new: usize,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    if max_new == 0 {
        return Ok(Vec::new());
    }
    let window = dec.window;
    let opts = GenOptions {
        max_tokens: max_new,
        ..GenOptions::default()
    };
    let d = dec.with_picker_taken(|dec, pick| {
        let policy = Policy {
            pick,
            slop: None,
            is_eog: &|_| false,
            window,
        };
        decode::run(dec, prompt, policy, &opts, on_token)
    })?;
    Ok(d.tokens)
}
