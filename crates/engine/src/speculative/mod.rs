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
//!
//! Two objects do the work, and the decoding loop ([`crate::decode`]) drives both through the
//! [`Stepper`] that [`SpecDecoder`] is: the drafter ([`drafter`], steps 1 and 5: propose, catch
//! up) and the target ([`target`], steps 2 and 4: verify a window, commit what the judge kept).
//! Step 3 is the loop's judge. Neither side reads the other's state: the target hands the
//! drafter the committed tokens and its pre-mixer rows, and the drafter hands the loop tokens.
//!
//! Step 2 may run as rows of a batched forward pass beside other sequences' rows
//! (`crate::batch`): [`SpecDecoder::window_item`] gives the window's batch item and
//! [`SpecDecoder::window_ran`] takes its results back, between the loop's
//! `Progress::begin_window` and `Progress::end_window`; alone, the window is a batch of one.
//! So may the prompt, in chunks: [`SpecDecoder::prompt_item`] gives a chunk's batch item (its
//! rows' pre-mixer states wanted) and [`SpecDecoder::prompt_ran`] has the head follow them
//! after the pass (the last chunk's rows wait for the first token); the solo prefill is the
//! whole prompt as one such chunk.

pub mod draft_vocab;
mod drafter;
pub mod guarded;
mod target;

use std::time::{Duration, Instant};

use crate::backend::{DeviceBuf, DevicePick};
use crate::decode::{self, ByPicker, Decoding, DraftEdit, Judged, Pick, Policy, Stepper, Verified};
use crate::error::{EngineError, Result};
use crate::generate::{GenOptions, Timings};
use crate::qwen4exp::mtp::MtpState;
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::{BatchItem, BatchOut, Model, State};
use crate::sampler::{DraftEdits, SampleContext, Sampler};

/// The draft chain's pick (ties to the lower index, NaN never chosen): the catalogue's
/// `mtp_pick`, re-exported under the name callers know.
pub use crate::kernels::pick::argmax;
pub use draft_vocab::DraftVocab;
use drafter::MtpDrafter;
pub use drafter::CHAIN_STEP;
use target::{Committed, Target};

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

    /// The pick as a device pick, when it is one and edits no draft (greedy, a seeded draw with
    /// at most a temperature): a verify window then moves only ids. Default: None (host).
    fn device_pick(&self) -> Option<DevicePick> {
        None
    }

    /// What `penalize_draft` does to the draft chain that starts at `position` after
    /// `history`, when a backend can do it on the device (none, or slop mode 1). Default: None
    /// (the host edits the drafts).
    fn draft_edits(&self, _position: usize, _history: &[u32]) -> Option<DraftEdits> {
        None
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

    fn device_pick(&self) -> Option<DevicePick> {
        Some(DevicePick::Greedy)
    }

    fn draft_edits(&self, _position: usize, _history: &[u32]) -> Option<DraftEdits> {
        Some(DraftEdits::None)
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

    fn device_pick(&self) -> Option<DevicePick> {
        self.config().device_pick()
    }

    fn draft_edits(&self, position: usize, history: &[u32]) -> Option<DraftEdits> {
        Sampler::draft_edits(
            self,
            &SampleContext {
                position: position as u64,
                history,
            },
            None,
        )
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

    /// The draft at `position` decided without the proposal (a hook whose choice depends on
    /// the position alone, such as forced acceptance): `Some(Some(t))` the draft, `Some(None)`
    /// the chain ends there; the chain then asks for every position before it runs and stays
    /// on the device, fed these tokens. `None` (the default): the hook needs each proposal, so
    /// the chain reads each pick. A hook answers for every position or for none.
    fn ahead(&mut self, position: usize) -> Option<Option<u32>> {
        let _ = position;
        None
    }
}

/// What the speculative path did (kept for the server to expose; serializes to JSON).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    pub window: usize,
    /// Verify passes of the trunk (not counting the prefill).
    pub passes: u64,
    /// Passes of the trunk over the prompt: its chunks ([`SpecDecoder::prompt_item`]; one when
    /// the prompt runs whole).
    pub prompt_passes: u64,
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

/// A prompt chunk between [`SpecDecoder::prompt_item`] and [`SpecDecoder::prompt_ran`]: where
/// it ends, the prompt's token after it (None: it ends the prompt) and when it began.
struct PromptChunk {
    end: usize,
    next: Option<u32>,
    started: Instant,
}

/// Speculative decoding of one sequence: a [`Target`] (the trunk: verify a window, commit what
/// the judge kept) and, with the MTP head, an [`MtpDrafter`] (propose drafts, catch up on the
/// committed rows), driven by the decoding loop of [`crate::decode`] through [`Stepper`].
/// The decoder itself only passes what one side leaves to the other: the committed tokens and
/// the trunk's pre-mixer rows.
pub struct SpecDecoder<'m, B: Qwen4expOps> {
    model: &'m Model<B>,
    window: usize,
    target: Target<'m, B>,
    /// The head's side; present exactly when the sequence has an MTP state (a window of 1 on a
    /// resumed sequence keeps its head in step, for the caller's next request).
    drafter: Option<MtpDrafter<'m, B>>,
    /// The trunk's pre-mixer rows of the prefill, until the first token is known (the head's
    /// catch-up pairs them with the tokens after them).
    prefill_hidden: Option<B::Buf>,
    /// Where the last prefill started (a resumed sequence's prefix was consumed before; with a
    /// prompt in chunks, the last chunk's start).
    prefill_from: usize,
    /// The prompt chunk handed out as a batch item and not yet run
    /// ([`SpecDecoder::prompt_item`]).
    prompt_chunk: Option<PromptChunk>,
    /// The judge may rewind (slop mode 2): the target checkpoints even one-row windows.
    may_rewind: bool,
    /// The last emitted token, which the trunk has not consumed yet.
    pending: Option<u32>,
    picker: Box<dyn Picker + 'm>,
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
        let target = Target::new(model, state, cfg.window, mtp.is_some())?;
        let drafter = match mtp {
            Some(m) => Some(MtpDrafter::new(
                model,
                m,
                cfg.min_p,
                cfg.draft_vocab,
                cfg.window > 1,
            )?),
            None => None,
        };
        Ok(SpecDecoder {
            model,
            window: cfg.window,
            target,
            drafter,
            prefill_hidden: None,
            prefill_from: 0,
            prompt_chunk: None,
            may_rewind: false,
            pending: None,
            picker: Box::new(Greedy),
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
        if let Some(d) = self.drafter.as_mut() {
            d.hook = Some(Box::new(hook));
        }
        self
    }

    /// Turns the sampler's edits of the drafts off (on by default): for tests and benchmarks
    /// that measure what they buy; the output does not change, only the acceptance.
    pub fn with_draft_penalties(mut self, on: bool) -> Self {
        if let Some(d) = self.drafter.as_mut() {
            d.penalize = on;
        }
        self
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// The trunk state: the consumed tokens (all emitted tokens but the last).
    pub fn state(&self) -> &State<B> {
        &self.target.state
    }

    pub fn mtp_state(&self) -> Option<&MtpState<B>> {
        self.drafter.as_ref().map(|d| &d.mtp)
    }

    /// The last emitted token (not yet consumed by the trunk).
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Runs the prompt and returns the first generated token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32> {
        if self.pending.is_some() || self.target.position() > 0 {
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
        self.sync_mtp()?;
        if let Some(d) = self.drafter.as_mut() {
            d.forget_first();
        }
        let t0 = Instant::now();
        let (logits, hidden) = self.target.run_rows(&input)?;
        let pos = self.target.position();
        let tok = self.picker.pick(&logits, pos, self.target.tokens())?;
        self.stats.prefill_time += t0.elapsed();
        self.stats.emitted += 1;
        self.pending = Some(tok);
        if let (Some(hidden), Some(d)) = (hidden, self.drafter.as_mut()) {
            let mut next = input[1..].to_vec();
            next.push(tok);
            d.owe(hidden, next);
            d.catch_up(&mut self.stats)?;
        }
        Ok(tok)
    }

    /// Brings the MTP state up to the trunk's (after a step that stopped early).
    pub fn sync_mtp(&mut self) -> Result<()> {
        match self.drafter.as_mut() {
            Some(d) => d.catch_up(&mut self.stats),
            None => Ok(()),
        }
    }

    /// The trunk's and the head's states, for a caller that keeps the sequence (call
    /// [`SpecDecoder::sync_mtp`] first so the head holds what the trunk does). The pending
    /// token is not consumed.
    pub fn into_states(self) -> (State<B>, Option<MtpState<B>>) {
        (self.target.state, self.drafter.map(|d| d.mtp))
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
        let mut seq = self.target.tokens().to_vec();
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

    /// The first half of a verify pass run as rows of a batch (`crate::batch`): the batch
    /// item of `window`, the window [`Progress::begin_window`](crate::decode::Progress) gave
    /// for this decoder (the pending token, then the drafts), with the trunk's state, the
    /// replay log that rolls the window back and the hidden rows the head needs. Run it in
    /// [`Model::forward_batch_dev`] beside other sequences' rows, then hand its results to
    /// [`SpecDecoder::window_ran`].
    pub fn window_item<'a>(&'a mut self, window: &'a [u32]) -> Result<BatchItem<'a, B>> {
        if self.pending.is_none() || window.first() != self.pending.as_ref() {
            return Err(EngineError::Input(
                "speculative step: the window does not start with the pending token".to_string(),
            ));
        }
        self.target.window_item(window, self.may_rewind)
    }

    /// The second half of a batched verify pass: `out`, the results of the item
    /// [`SpecDecoder::window_item`] gave, as [`Progress::end_window`](crate::decode::Progress)
    /// takes them: each row's logits, or with `pick` (the loop's
    /// [`Progress::device_pick`](crate::decode::Progress::device_pick)) the device's pick
    /// after each row.
    pub fn window_ran(&mut self, out: BatchOut<B>, pick: Option<DevicePick>) -> Result<Verified> {
        self.target.window_ran(out, pick, &mut self.stats)
    }

    /// The first half of a prompt chunk run as rows of a batch (`crate::batch`): the batch
    /// item of `prompt[from..end]`, `from` being the tokens the trunk holds (a prefix of
    /// `prompt`: earlier chunks, or a resumed sequence's prefix), with the last row's logits
    /// and the rows' pre-mixer states for the head. Run it in [`Model::forward_batch_dev`]
    /// (alone, or beside other sequences' rows), then hand its results to
    /// [`SpecDecoder::prompt_ran`]; a prompt runs in any chunks this way, the last ending at
    /// `prompt.len()`, and then the loop judges the first token
    /// ([`Progress::prefilled`](crate::decode::Progress::prefilled)) from its logits.
    pub fn prompt_item<'a>(
        &'a mut self,
        prompt: &'a [u32],
        end: usize,
    ) -> Result<BatchItem<'a, B>> {
        let from = self.target.position();
        // A resumed sequence continues with the prompt's rest; it must be a prefix of it.
        if self.pending.is_some()
            || prompt.len() <= from
            || prompt.get(..from) != Some(self.target.tokens())
        {
            return Err(EngineError::Input(
                "speculative generation: the sequence already holds tokens that are not a prefix \
                 of the prompt"
                    .to_string(),
            ));
        }
        if end <= from || end > prompt.len() {
            return Err(EngineError::Input(format!(
                "speculative prompt: a chunk ending at {end}, the sequence holding {from} of the \
                 prompt's {} tokens",
                prompt.len()
            )));
        }
        if self.target.has_verified() {
            return Err(EngineError::Input(
                "speculative prompt: a verify pass waits for its commit".to_string(),
            ));
        }
        // The head holds every consumed token (each earlier chunk's rows were followed).
        if let Some(d) = self.drafter.as_mut() {
            d.forget_first();
        }
        self.prefill_from = from;
        self.prefill_hidden = None;
        self.prompt_chunk = Some(PromptChunk {
            end,
            next: prompt.get(end).copied(),
            started: Instant::now(),
        });
        Ok(self.target.rows_item(&prompt[from..end]))
    }

    /// The second half of a prompt chunk: `out`, the results of the item
    /// [`SpecDecoder::prompt_item`] gave. A chunk before the prompt's end has the head follow
    /// the trunk over its rows now (the tokens after them are the prompt's) and returns None;
    /// the prompt's last chunk returns the logits after the prompt, and its rows wait for the
    /// first generated token, which pairs with the last of them (the head follows when the
    /// loop settles the first token).
    pub fn prompt_ran(&mut self, out: BatchOut<B>) -> Result<Option<Vec<f32>>> {
        let c = self
            .prompt_chunk
            .take()
            .ok_or_else(|| EngineError::Input("prefill: no prompt chunk was begun".to_string()))?;
        let rows = c.end - self.prefill_from;
        let hidden_rows = out.hidden.as_ref().map(|h| h.rows());
        if self.target.position() != c.end
            || out.logits.rows() != 1
            || hidden_rows != self.drafter.is_some().then_some(rows)
        {
            return Err(EngineError::shape(
                "prefill",
                format!(
                    "a prompt chunk of {rows} rows ending at {}: the trunk is at {}, {} logits \
                     rows and {hidden_rows:?} pre-mixer rows came back",
                    c.end,
                    self.target.position(),
                    out.logits.rows()
                ),
            ));
        }
        self.stats.prefill_time += c.started.elapsed();
        self.stats.prompt_passes += 1;
        match c.next {
            Some(next) => {
                if let (Some(hidden), Some(d)) = (out.hidden, self.drafter.as_mut()) {
                    let t0 = Instant::now();
                    self.model
                        .mtp_follow(&self.target.state, &mut d.mtp, &hidden, next)?;
                    self.stats.catchup_time += t0.elapsed();
                }
                Ok(None)
            }
            None => {
                self.prefill_hidden = out.hidden;
                Ok(Some(self.model.backend().download(&out.logits)?))
            }
        }
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

    /// Keeps what the judge ruled on the last pass: the target commits (a prefix of the
    /// window, its start, or a rebuild) and the drafter follows it there; both end holding
    /// `seq` but its last token (pending).
    fn settle_verified(&mut self, seq: &[u32], judged: Judged) -> Result<()> {
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
        let can_restart = self.drafter.as_ref().is_none_or(|d| d.can_restart());
        let committed = self
            .target
            .commit(seq, judged.rewound, can_restart, &mut self.stats)?;
        if let Some(d) = self.drafter.as_mut() {
            match committed {
                Committed::Prefix { pos0, hidden } => {
                    d.follow_prefix(pos0, hidden, seq[pos0 + 1..].to_vec())?
                }
                Committed::Start { pos0 } => d.follow_start(pos0)?,
                Committed::Rebuilt { hidden } => {
                    d.follow_rebuild(hidden, seq.get(1..).unwrap_or_default().to_vec())?
                }
            }
        }
        self.pending = seq.last().copied();
        self.stats.rollback_time += t1.elapsed();
        Ok(())
    }
}

/// The speculative decoder as the decoding loop's stepper: `propose` is the drafter's,
/// `verify` the target's, and `settle` commits the target and has the drafter follow.
impl<B: Qwen4expOps> Stepper for SpecDecoder<'_, B> {
    fn n_ctx(&self) -> usize {
        self.model.config().n_ctx
    }

    fn tokens(&self) -> &[u32] {
        self.target.tokens()
    }

    fn prefill(&mut self, prompt: &[u32], opts: &GenOptions, t: &mut Timings) -> Result<Vec<f32>> {
        let from = self.target.position();
        // The rest of the prompt in plain decoding's chunks (`prefill_chunk` rows from where the
        // sequence stands), each a batch of one: a GPU's fast prefill, whose rows depend on the
        // chunk's row count, then gives the trunk plain decoding's bits too.
        let t0 = Instant::now();
        let model = self.model;
        let step = opts.prefill_chunk.max(1);
        let mut end = from;
        let logits = loop {
            end = end.saturating_add(step).min(prompt.len());
            let item = self.prompt_item(prompt, end)?;
            let out = model
                .forward_batch_dev(&mut [item])?
                .pop()
                .ok_or_else(|| EngineError::shape("prefill", "no result for the prompt"))?;
            match self.prompt_ran(out)? {
                Some(logits) => break logits,
                None if end >= prompt.len() => {
                    return Err(EngineError::shape("prefill", "no logits after the prompt"))
                }
                None => {}
            }
        };
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
        match self.drafter.as_mut() {
            Some(d) => d.propose(
                self.target.tokens(),
                self.target.position(),
                pending,
                max,
                edit,
                &mut self.stats,
            ),
            None => Ok(Vec::new()),
        }
    }

    fn verify(&mut self, window: &[u32]) -> Result<Vec<f32>> {
        self.target.verify(window, self.may_rewind, &mut self.stats)
    }

    fn verify_picked(&mut self, window: &[u32], pick: DevicePick) -> Result<Option<Vec<u32>>> {
        self.target
            .verify_picked(window, pick, self.may_rewind, &mut self.stats)
            .map(Some)
    }

    fn settle(&mut self, seq: &[u32], judged: Judged) -> Result<()> {
        if self.target.has_verified() {
            self.settle_verified(seq, judged)?;
        } else {
            // The prefill's ruling: the first token is pending, the head catches up over the
            // prompt's rows with the tokens after them.
            self.stats.emitted += judged.kept as u64;
            let hidden = self.prefill_hidden.take();
            if seq.len() > self.target.position() {
                self.pending = seq.last().copied();
                if let (Some(hidden), Some(d)) = (hidden, self.drafter.as_mut()) {
                    d.owe(hidden, seq[self.prefill_from + 1..].to_vec());
                }
            }
        }
        // The head follows at once unless the caller stopped (then `sync_mtp` brings it up).
        if !judged.stopped {
            self.sync_mtp()?;
        }
        Ok(())
    }

    fn may_rewind(&mut self, yes: bool) {
        self.may_rewind = yes;
        if let Some(d) = self.drafter.as_mut() {
            d.may_rewind = yes;
        }
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
    let opts = GenOptions {
        max_tokens: max_new,
        ..GenOptions::default()
    };
    run_with(dec, prompt, &opts, on_token)
}

/// [`run`] with `opts`' token budget (`max_tokens`) and prompt chunks (`prefill_chunk`); its
/// sampler settings are the decoder's picker's, not `opts`'.
pub fn run_with<B: Qwen4expOps>(
    dec: &mut SpecDecoder<'_, B>,
    prompt: &[u32],
    opts: &GenOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    if opts.max_tokens == 0 {
        return Ok(Vec::new());
    }
    let window = dec.window;
    let d = dec.with_picker_taken(|dec, pick| {
        let policy = Policy {
            pick,
            slop: None,
            is_eog: &|_| false,
            window,
        };
        decode::run(dec, prompt, policy, opts, on_token)
    })?;
    Ok(d.tokens)
}
