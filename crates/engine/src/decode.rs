//! The decoding loop, written once. Plain decoding, the slop-guarded loop (phrase rewinds,
//! held-back streaming), speculative decoding and speculative decoding under the guard are this
//! one loop with different policies:
//! - a [`Stepper`] is the sequence: it runs the prompt, proposes drafts (none without a drafter),
//!   verifies a window `[pending, drafts…]` (one row for plain decoding) and settles to the
//!   judged sequence (keeps a prefix of the window, restores its start, or rebuilds);
//! - a [`Pick`] chooses each token (the sampler chain, or a [`Picker`](crate::speculative::Picker)
//!   such as greedy) and edits the drafts the same way;
//! - the [`Judge`] applies the slop state (mode 2 rewinds, held-back streaming), the stop rules
//!   (end of generation, the token budget, the context) and streams what is final.
//!
//! Every emitted token is the token plain decoding emits: the window's rows are the bits of
//! single steps (DESIGN.md §3), the judge samples each row with the history before it, and the
//! stepper settles exactly onto the judged sequence.
//!
//! A generation is a [`Progress`]: it owns the judge's state and the sequence between calls and
//! borrows the stepper, the pick and the token sink per call ([`Lent`]), so a caller can keep
//! many and advance them in turns (the server's slots); [`Decoding`] and [`run`] hold the parts
//! for a whole generation. A pick with state of its own (the server's grammar mask, reasoning
//! budget and log-probability capture) sees every row and every draft it is asked about, with
//! its history, so it can follow them without the loop knowing ([`Pick::penalize_draft`] and
//! [`DraftEdit::edit`] take `&mut self` for that).

use std::time::Instant;

use crate::backend::DevicePick;
use crate::error::{EngineError, Result};
use crate::generate::{GenOptions, StopReason, Timings};
use crate::sampler::guard::GuardStop;
use crate::sampler::slop::{Accepted, DeadEnd, SlopState};
use crate::sampler::{DraftEdits, SampleContext, Sampled, Sampler};

/// Chooses tokens: the sampler chain with an explicit slop state, or a simpler picker.
pub trait Pick {
    /// The token after `ctx.history` from its logits, given the sequence's slop state.
    fn pick(
        &mut self,
        logits: &[f32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) -> Result<Sampled>;
    /// Edits draft-row logits (`inverse` maps full ids to draft rows) the way `pick` will edit
    /// the trunk's at the same position, so drafts follow the same penalties.
    fn penalize_draft(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    );
    /// The pick as a device pick, when the backend can make it from the logits alone (greedy,
    /// or a seeded draw with at most a temperature) and it edits no draft: then a speculative
    /// window moves only token ids ([`Stepper::verify_picked`]). None: picks on the host.
    fn device_pick(&self) -> Option<DevicePick> {
        None
    }
    /// What `penalize_draft` does to the draft chain after `ctx.history`, when a backend can
    /// do it on the device (none, or slop mode 1): the chain then moves only ids. None (the
    /// default): the drafts are edited on the host.
    fn draft_edits(&self, ctx: &SampleContext<'_>, slop: Option<&SlopState>) -> Option<DraftEdits> {
        let _ = (ctx, slop);
        None
    }
}

impl Pick for Sampler {
    fn pick(
        &mut self,
        logits: &[f32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) -> Result<Sampled> {
        self.sample_with(logits, ctx, slop)
    }
    fn penalize_draft(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) {
        Sampler::penalize_draft(self, draft_logits, inverse, ctx, slop)
    }
    fn device_pick(&self) -> Option<DevicePick> {
        self.config().device_pick()
    }
    fn draft_edits(&self, ctx: &SampleContext<'_>, slop: Option<&SlopState>) -> Option<DraftEdits> {
        Sampler::draft_edits(self, ctx, slop)
    }
}

/// A [`Picker`](crate::speculative::Picker) as a [`Pick`] (it keeps its own state; the loop
/// passes it no slop state).
pub struct ByPicker<'a>(pub &'a mut dyn crate::speculative::Picker);

impl Pick for ByPicker<'_> {
    fn pick(
        &mut self,
        logits: &[f32],
        ctx: &SampleContext<'_>,
        _slop: Option<&SlopState>,
    ) -> Result<Sampled> {
        Ok(Sampled::Token(self.0.pick(
            logits,
            ctx.position as usize,
            ctx.history,
        )?))
    }
    fn penalize_draft(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        ctx: &SampleContext<'_>,
        _slop: Option<&SlopState>,
    ) {
        self.0
            .penalize_draft(draft_logits, inverse, ctx.position as usize, ctx.history)
    }
    fn device_pick(&self) -> Option<DevicePick> {
        self.0.device_pick()
    }
    fn draft_edits(
        &self,
        ctx: &SampleContext<'_>,
        _slop: Option<&SlopState>,
    ) -> Option<DraftEdits> {
        self.0.draft_edits(ctx.position as usize, ctx.history)
    }
}

/// The draft editor a stepper's drafter calls for each draft (the judge: its pick and slop
/// state). Mutable, so that a pick with state of its own (a grammar matcher) can follow the
/// drafts.
pub trait DraftEdit {
    fn edit(&mut self, draft_logits: &mut [f32], inverse: &[i32], position: usize, history: &[u32]);
    /// The trunk's pick when it is a device pick and drafts need no edit (no slop state, no
    /// penalties): the drafter may then pick drafts on the device and download only ids.
    fn device_pick(&self) -> Option<DevicePick> {
        None
    }
    /// The edits of the draft chain after `history` when a backend can make them on the device
    /// ([`Pick::draft_edits`] with the judge's slop state). None: edit on the host.
    fn draft_edits(&self, history: &[u32]) -> Option<DraftEdits> {
        let _ = history;
        None
    }
}

/// What one verify pass judged, for the stepper's statistics.
#[derive(Clone, Copy, Debug, Default)]
pub struct Judged {
    /// Drafts in the window and how many of them the judge accepted.
    pub drafts: usize,
    pub accepted: usize,
    /// Tokens the judge kept from this window (streamed or held back).
    pub kept: usize,
    /// The judge rewound the sequence (a phrase completed, or a dead end).
    pub rewound: bool,
    /// Generation ends here; `stopped`: because the caller asked (`on_token` returned false).
    pub end: bool,
    pub stopped: bool,
}

/// One sequence as the loop drives it.
pub trait Stepper {
    /// Most positions the sequence may hold.
    fn n_ctx(&self) -> usize;
    /// Tokens consumed so far.
    fn tokens(&self) -> &[u32];
    /// Runs `prompt` (reusing what prefix of it the sequence already holds, always running its
    /// last token) and returns the logits after it; fills the prompt part of `t`.
    fn prefill(&mut self, prompt: &[u32], opts: &GenOptions, t: &mut Timings) -> Result<Vec<f32>>;
    /// Up to `max` drafts for the positions after `pending` (none without a drafter), each
    /// edited by `edit` with the history before it.
    fn propose(&mut self, pending: u32, max: usize, edit: &mut dyn DraftEdit) -> Result<Vec<u32>>;
    /// Consumes `window` and returns one logits row per token (`window.len() · n_vocab`).
    fn verify(&mut self, window: &[u32]) -> Result<Vec<f32>>;
    /// Consumes `window` and returns the token `pick` chooses after each row, picked where
    /// the logits are (only ids cross the boundary); row `i`'s token sits at position
    /// `tokens().len() + 1 + i` before the call. None: this stepper cannot, and the loop calls
    /// [`Stepper::verify`] instead (nothing was consumed).
    fn verify_picked(&mut self, _window: &[u32], _pick: DevicePick) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// Makes the sequence hold `seq` but its last token (which is pending), after the judge
    /// ruled on the last window (or on the prefill's logits, with no window yet).
    fn settle(&mut self, seq: &[u32], judged: Judged) -> Result<()>;
    /// The stepper may end its generation in the state of the last verify (plain decoding keeps
    /// the last token consumed); a speculative one settles first.
    fn settle_at_end(&self) -> bool {
        true
    }
    /// Told once before a generation whether the judge may rewind (slop mode 2), so a
    /// speculative stepper keeps what a rewind to a window's start needs.
    fn may_rewind(&mut self, _yes: bool) {}
}

/// Why a generation ended, what it emitted and how long it took.
#[derive(Clone, Debug)]
pub struct Decoded {
    /// The tokens handed to `on_token`, in order (the end-of-generation token excluded).
    pub tokens: Vec<u32>,
    pub stop: GuardStop,
    /// Rewinds taken (phrase completions and dead ends).
    pub rewinds: u32,
    pub timings: Timings,
}

enum Verdict {
    /// The token stays and generation goes on.
    Kept(u32),
    /// The sequence was cut back (to `start + gen.len()` tokens); sample there again.
    Rewound,
    /// Generation ends (a kept token may have been recorded first).
    End(GuardStop),
}

/// What a generation keeps between its steps besides the sequence: the slop state, the
/// generated tokens (streamed or held back), the limits and the counters. Owned, so that a
/// caller can keep a generation across calls ([`Progress`]).
struct Tally {
    slop: Option<SlopState>,
    max_tokens: usize,
    n_ctx: usize,
    /// Position of the first generated token.
    start: usize,
    /// Generated tokens, streamed or held back (the slop state's tokens).
    gen: Vec<u32>,
    /// The shortest `gen` since the current window began (see [`Tally::cut`]).
    low: usize,
    emitted: usize,
    closed: bool,
    rewinds: u32,
    timings: Timings,
}

/// The sampling side of a generation: one sampled position at a time, the slop state's
/// rewinds, the stop rules, and streaming of what is final. Built per call from the owned
/// [`Tally`] and what the caller lends.
struct Judge<'a, 't> {
    pick: &'a mut dyn Pick,
    is_eog: &'a dyn Fn(u32) -> bool,
    on_token: &'a mut dyn FnMut(u32) -> bool,
    t: &'t mut Tally,
}

impl DraftEdit for Judge<'_, '_> {
    fn edit(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        position: usize,
        history: &[u32],
    ) {
        self.pick.penalize_draft(
            draft_logits,
            inverse,
            &SampleContext {
                position: position as u64,
                history,
            },
            self.t.slop.as_ref(),
        )
    }
    fn device_pick(&self) -> Option<DevicePick> {
        match self.t.slop {
            Some(_) => None,
            None => self.pick.device_pick(),
        }
    }
    fn draft_edits(&self, history: &[u32]) -> Option<DraftEdits> {
        self.pick.draft_edits(
            &SampleContext {
                position: history.len() as u64,
                history,
            },
            self.t.slop.as_ref(),
        )
    }
}

impl Tally {
    /// Cuts the generated tokens back to those before `position`, remembering the shortest
    /// length reached (the caller rebuilds its sequence from there, not from the start).
    fn cut(&mut self, position: usize) {
        self.gen.truncate(position - self.start);
        self.low = self.low.min(self.gen.len());
    }

    /// Streams what is still held back (a partial match that never completed is plain text).
    fn finish(mut self, on_token: &mut dyn FnMut(u32) -> bool, stop: GuardStop) -> Decoded {
        if !self.closed {
            let rest = match self.slop.as_mut() {
                Some(s) => s.flush(),
                None => self.emitted..self.gen.len(),
            };
            for i in rest {
                let Some(&t) = self.gen.get(i) else { break };
                self.emitted = i + 1;
                if !on_token(t) {
                    break;
                }
            }
        }
        self.gen.truncate(self.emitted);
        Decoded {
            tokens: self.gen,
            stop,
            rewinds: self.rewinds,
            timings: self.timings,
        }
    }
}

impl Judge<'_, '_> {
    /// Samples the token after `history` from `logits` and records it.
    fn judge(&mut self, logits: &[f32], history: &[u32]) -> Result<Verdict> {
        let pos = history.len();
        let ts = Instant::now();
        let sampled = self.pick.pick(
            logits,
            &SampleContext {
                position: pos as u64,
                history,
            },
            self.t.slop.as_ref(),
        );
        self.t.timings.sample += ts.elapsed();
        self.record(sampled?, pos)
    }

    /// Records `sampled`, the choice for position `pos`: rewinds, stop rules, streaming.
    fn record(&mut self, sampled: Sampled, pos: usize) -> Result<Verdict> {
        let t = &mut *self.t;
        t.timings.sampled_tokens += 1;
        let tok = match (sampled, t.slop.as_mut()) {
            (Sampled::Token(tok), _) => tok,
            (Sampled::DeadEnd, Some(s)) => match s.dead_end() {
                DeadEnd::Rewound { position, .. } => {
                    t.rewinds += 1;
                    t.cut(position);
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
        match t.slop.as_mut() {
            Some(s) => {
                match s.accept(tok) {
                    Accepted::Kept => t.gen.push(tok),
                    Accepted::Rewound { position, .. } => {
                        t.rewinds += 1;
                        t.cut(position);
                        return Ok(Verdict::Rewound);
                    }
                    Accepted::Exhausted { position } => {
                        t.cut(position);
                        return Ok(Verdict::End(GuardStop::RewindBudget));
                    }
                }
                for i in s.take_commits() {
                    t.emitted = i + 1;
                    let Some(&g) = t.gen.get(i) else { break };
                    if !(self.on_token)(g) {
                        t.closed = true;
                        break;
                    }
                }
            }
            None => {
                t.gen.push(tok);
                t.emitted = t.gen.len();
                t.closed = !(self.on_token)(tok);
            }
        }
        if t.closed {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::Stopped)));
        }
        if t.gen.len() >= t.max_tokens {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::MaxTokens)));
        }
        if pos + 1 >= t.n_ctx {
            return Ok(Verdict::End(GuardStop::Plain(StopReason::ContextFull)));
        }
        Ok(Verdict::Kept(tok))
    }
}

/// Refuses an empty prompt or one that leaves no room in the context.
pub(crate) fn check_prompt(n_ctx: usize, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::Input("the prompt has no tokens".to_string()));
    }
    if prompt.len() >= n_ctx {
        return Err(EngineError::Input(format!(
            "the prompt has {} tokens; the model's context holds {n_ctx} positions",
            prompt.len()
        )));
    }
    Ok(())
}

/// How a generation is driven.
pub struct Policy<'a> {
    pub pick: &'a mut dyn Pick,
    /// The sequence's slop state (from [`Sampler::new_slop_state`]); None: the pick keeps any
    /// state itself and nothing is held back.
    pub slop: Option<SlopState>,
    pub is_eog: &'a dyn Fn(u32) -> bool,
    /// Largest verify window (1: plain decoding).
    pub window: usize,
}

/// What a [`Progress`] borrows for one call: the sequence's stepper, the pick, the
/// end-of-generation rule and the token sink (which returns false to stop).
pub struct Lent<'a> {
    pub stepper: &'a mut dyn Stepper,
    pub pick: &'a mut dyn Pick,
    pub is_eog: &'a dyn Fn(u32) -> bool,
    pub on_token: &'a mut dyn FnMut(u32) -> bool,
}

impl Lent<'_> {
    /// The same parts lent again for a shorter call (the caller keeps them for later).
    fn reborrow(&mut self) -> Lent<'_> {
        Lent {
            stepper: &mut *self.stepper,
            pick: &mut *self.pick,
            is_eog: self.is_eog,
            on_token: &mut *self.on_token,
        }
    }
}

/// A generation in progress that owns its state and borrows nothing between calls: the judge's
/// tally and the sequence so far (`seq` = prompt and generated tokens; the stepper holds all of
/// it but the last, which is pending). The stepper, the pick and the token sink are lent per
/// call ([`Lent`]), so a caller can keep many generations and advance them in turns (the
/// server's `--parallel` slots); [`Decoding`] is the same loop with its parts held for the
/// whole generation.
pub struct Progress {
    t: Tally,
    seq: Vec<u32>,
    window: usize,
    /// The window begun and not yet judged ([`Progress::begin_window`]).
    open: Option<Open>,
}

/// A window between [`Progress::begin_window`] and [`Progress::end_window`].
struct Open {
    window: Vec<u32>,
    started: Instant,
}

/// What the trunk gave for a window's rows: each row's logits (`rows · n_vocab`), or the
/// device's pick after each row ([`Stepper::verify_picked`]).
pub enum Verified {
    Logits(Vec<f32>),
    Ids(Vec<u32>),
}

impl Progress {
    /// A generation of up to `max_tokens` tokens whose first generated token will sit at
    /// position `start`, with verify windows of up to `window` rows, on `stepper`.
    pub fn new(
        stepper: &mut dyn Stepper,
        slop: Option<SlopState>,
        window: usize,
        max_tokens: usize,
        start: usize,
    ) -> Progress {
        let may_rewind = slop.as_ref().is_some_and(|s| s.compiled().mode() >= 2);
        stepper.may_rewind(may_rewind);
        Progress {
            t: Tally {
                slop,
                max_tokens,
                n_ctx: stepper.n_ctx(),
                start,
                gen: Vec::new(),
                low: 0,
                emitted: 0,
                closed: false,
                rewinds: 0,
                timings: Timings::default(),
            },
            seq: Vec::new(),
            window: window.max(1),
            open: None,
        }
    }

    /// The sequence so far: prompt and generated tokens (held-back ones included).
    pub fn seq(&self) -> &[u32] {
        &self.seq
    }

    /// Generated tokens so far, streamed or held back.
    pub fn generated(&self) -> usize {
        self.t.gen.len()
    }

    /// Rewinds taken so far.
    pub fn rewinds(&self) -> u32 {
        self.t.rewinds
    }

    /// Runs the prompt and judges the first token; Some when generation ended there.
    pub fn prefill(
        &mut self,
        lent: Lent<'_>,
        prompt: &[u32],
        opts: &GenOptions,
    ) -> Result<Option<GuardStop>> {
        let mut t = Timings::default();
        let logits = lent.stepper.prefill(prompt, opts, &mut t)?;
        self.prefilled(lent, prompt, &logits, &t)
    }

    /// [`Progress::prefill`] after the caller ran the prompt (alone, or its last rows in a
    /// batch with other sequences): the stepper holds `prompt`, `logits` are those after it,
    /// `t` the prompt's timings. Judges the first token; Some when generation ended there.
    pub fn prefilled(
        &mut self,
        lent: Lent<'_>,
        prompt: &[u32],
        logits: &[f32],
        t: &Timings,
    ) -> Result<Option<GuardStop>> {
        let Lent {
            stepper,
            pick,
            is_eog,
            on_token,
        } = lent;
        self.t.timings.prompt = t.prompt;
        self.t.timings.prompt_tokens = t.prompt_tokens;
        self.t.timings.reused_tokens = t.reused_tokens;
        let mut j = Judge {
            pick,
            is_eog,
            on_token,
            t: &mut self.t,
        };
        // A rewind here can only return to this same position (nothing was generated before
        // it), whose logits these are: sample it again.
        let end = loop {
            match j.judge(logits, prompt)? {
                Verdict::Kept(_) => break None,
                Verdict::Rewound => continue,
                Verdict::End(stop) => break Some(stop),
            }
        };
        self.seq = prompt.to_vec();
        self.seq.extend_from_slice(&self.t.gen);
        let judged = Judged {
            kept: self.t.gen.len(),
            end: end.is_some(),
            stopped: self.t.closed,
            ..Judged::default()
        };
        if end.is_none() || stepper.settle_at_end() {
            stepper.settle(&self.seq, judged)?;
        }
        Ok(end)
    }

    /// Continues a sequence the stepper already holds: `seq` but its last token (pending).
    pub fn resume(&mut self, seq: Vec<u32>) {
        self.seq = seq;
    }

    /// One verify window: drafts, the trunk's pass, the judge over its rows, the settle.
    /// Returns what was judged and, when generation ended, why.
    pub fn window(&mut self, mut lent: Lent<'_>) -> Result<(Judged, Option<GuardStop>)> {
        let window = self.begin_window(lent.reborrow())?.to_vec();
        let device = match self.device_pick(&*lent.pick) {
            Some(p) => lent.stepper.verify_picked(&window, p)?,
            None => None,
        };
        let rows = match device {
            Some(ids) => Verified::Ids(ids),
            None => Verified::Logits(lent.stepper.verify(&window)?),
        };
        self.end_window(lent, rows)
    }

    /// How a window's rows come back to [`Progress::end_window`] with `pick`: Some when the
    /// device can make the pick and there is no slop state to follow (then one token per row,
    /// ids only across the boundary: [`Verified::Ids`]); None: each row's logits.
    pub fn device_pick(&self, pick: &dyn Pick) -> Option<DevicePick> {
        match self.t.slop {
            None => pick.device_pick(),
            Some(_) => None,
        }
    }

    /// The first half of [`Progress::window`]: the drafts, and the window `[pending, drafts…]`
    /// the trunk must run next. The caller runs it (alone with [`Stepper::verify`], or as rows
    /// of a batch with other sequences: `crate::batch`) so that the stepper holds the window,
    /// then hands the rows' results to [`Progress::end_window`].
    pub fn begin_window(&mut self, lent: Lent<'_>) -> Result<&[u32]> {
        let Lent { stepper, pick, .. } = lent;
        let mut j = Judge {
            pick,
            is_eog: &|_| false,
            on_token: &mut |_| true,
            t: &mut self.t,
        };
        let pending = *self
            .seq
            .last()
            .ok_or_else(|| EngineError::Input("decode: no pending token".to_string()))?;
        let pos0 = self.seq.len() - 1;
        let max_emit = j.t.max_tokens.saturating_sub(j.t.gen.len()).max(1);
        // The window's tokens take positions pos0..pos0 + n, all inside the context.
        let room = j.t.n_ctx.saturating_sub(pos0 + 1);
        let max_drafts = (self.window - 1).min(max_emit - 1).min(room);
        let td = Instant::now();
        let drafts = stepper.propose(pending, max_drafts, &mut j)?;
        let mut window = Vec::with_capacity(1 + drafts.len());
        window.push(pending);
        window.extend_from_slice(&drafts);
        self.open = Some(Open {
            window,
            started: td,
        });
        Ok(self.open.as_ref().map_or(&[][..], |o| &o.window[..]))
    }

    /// The second half of [`Progress::window`]: the judge over the window's rows (the logits
    /// of each, or the device's pick of each), then the settle.
    pub fn end_window(
        &mut self,
        lent: Lent<'_>,
        rows: Verified,
    ) -> Result<(Judged, Option<GuardStop>)> {
        let Lent {
            stepper,
            pick,
            is_eog,
            on_token,
        } = lent;
        let Open { window, started } = self
            .open
            .take()
            .ok_or_else(|| EngineError::Input("decode: no window was begun".to_string()))?;
        let drafts = &window[1..];
        let mut j = Judge {
            pick,
            is_eog,
            on_token,
            t: &mut self.t,
        };
        let n = window.len();
        let (logits, device) = match rows {
            Verified::Logits(l) => (l, None),
            Verified::Ids(ids) => (Vec::new(), Some(ids)),
        };
        if device.is_none() && (logits.is_empty() || logits.len() % n != 0) {
            return Err(EngineError::shape(
                "verify",
                format!("{} logits for a window of {n}", logits.len()),
            ));
        }
        j.t.timings.decode += started.elapsed();
        j.t.timings.decoded_tokens += n;
        let v = logits.len() / n;
        let mut end = None;
        let mut judged = Judged {
            drafts: drafts.len(),
            ..Judged::default()
        };
        let rewinds0 = j.t.rewinds;
        // The history of row i is the sequence and the drafts before it: pushed onto `seq` as
        // they are accepted (no copy of the sequence per window), cut back below.
        let history = &mut self.seq;
        let gen0 = j.t.gen.len();
        j.t.low = gen0;
        for i in 0..n {
            let verdict = match &device {
                Some(ids) => {
                    let tok = *ids.get(i).ok_or_else(|| {
                        EngineError::shape("verify", format!("no pick for row {i} of {n}"))
                    })?;
                    j.record(Sampled::Token(tok), history.len())?
                }
                None => {
                    let row = logits.get(i * v..(i + 1) * v).ok_or_else(|| {
                        EngineError::shape("verify", format!("no logits row {i} of {n}"))
                    })?;
                    j.judge(row, history)?
                }
            };
            match verdict {
                Verdict::Kept(t) => {
                    judged.kept += 1;
                    if drafts.get(i) != Some(&t) {
                        break;
                    }
                    judged.accepted += 1;
                    history.push(t);
                }
                Verdict::Rewound => break,
                Verdict::End(stop) => {
                    // A token the budget or the caller ended on still counts as kept.
                    if j.t.gen.len() > gen0 + judged.kept {
                        judged.kept += 1;
                    }
                    end = Some(stop);
                    break;
                }
            }
        }
        let t = &mut self.t;
        judged.rewound = t.rewinds > rewinds0;
        judged.end = end.is_some();
        judged.stopped = t.closed;
        // `seq` = prompt ++ gen again: keep what no rewind reached, append the rest.
        self.seq.truncate(t.start + t.low);
        self.seq.extend_from_slice(&t.gen[t.low..]);
        if end.is_none() || stepper.settle_at_end() {
            let ts = Instant::now();
            stepper.settle(&self.seq, judged)?;
            t.timings.decode += ts.elapsed();
        }
        Ok((judged, end))
    }

    /// Streams what is still held back and returns the generation.
    pub fn finish(self, on_token: &mut dyn FnMut(u32) -> bool, stop: GuardStop) -> Decoded {
        self.t.finish(on_token, stop)
    }
}

/// A generation in progress with its parts held for its whole length: the loop of
/// [`Progress`] for callers that run a generation at once.
pub struct Decoding<'a> {
    stepper: &'a mut dyn Stepper,
    pick: &'a mut dyn Pick,
    is_eog: &'a dyn Fn(u32) -> bool,
    on_token: &'a mut dyn FnMut(u32) -> bool,
    p: Progress,
}

impl<'a> Decoding<'a> {
    /// A generation of up to `max_tokens` tokens whose first generated token will sit at
    /// position `start`.
    pub fn new(
        stepper: &'a mut dyn Stepper,
        policy: Policy<'a>,
        max_tokens: usize,
        start: usize,
        on_token: &'a mut dyn FnMut(u32) -> bool,
    ) -> Self {
        let p = Progress::new(stepper, policy.slop, policy.window, max_tokens, start);
        Decoding {
            stepper,
            pick: policy.pick,
            is_eog: policy.is_eog,
            on_token,
            p,
        }
    }

    fn lent(&mut self) -> (Lent<'_>, &mut Progress) {
        (
            Lent {
                stepper: &mut *self.stepper,
                pick: &mut *self.pick,
                is_eog: self.is_eog,
                on_token: &mut *self.on_token,
            },
            &mut self.p,
        )
    }

    /// Runs the prompt and judges the first token; Some when generation ended there.
    pub fn prefill(&mut self, prompt: &[u32], opts: &GenOptions) -> Result<Option<GuardStop>> {
        let (lent, p) = self.lent();
        p.prefill(lent, prompt, opts)
    }

    /// Continues a sequence the stepper already holds: `seq` but its last token (pending).
    pub fn resume(&mut self, seq: Vec<u32>) {
        self.p.resume(seq);
    }

    /// One verify window: drafts, the trunk's pass, the judge over its rows, the settle.
    /// Returns what was judged and, when generation ended, why.
    pub fn window(&mut self) -> Result<(Judged, Option<GuardStop>)> {
        let (lent, p) = self.lent();
        p.window(lent)
    }

    /// Streams what is still held back and returns the generation.
    pub fn finish(self, stop: GuardStop) -> Decoded {
        self.p.finish(self.on_token, stop)
    }
}

/// Runs `prompt` through `stepper` and generates up to `opts.max_tokens` tokens, handing each
/// to `on_token` once it is final (it returns false to stop).
pub fn run<'a>(
    stepper: &'a mut dyn Stepper,
    prompt: &[u32],
    policy: Policy<'a>,
    opts: &GenOptions,
    on_token: &'a mut dyn FnMut(u32) -> bool,
) -> Result<Decoded> {
    check_prompt(stepper.n_ctx(), prompt)?;
    let mut d = Decoding::new(stepper, policy, opts.max_tokens, prompt.len(), on_token);
    if opts.max_tokens == 0 {
        return Ok(d.finish(GuardStop::Plain(StopReason::MaxTokens)));
    }
    if let Some(stop) = d.prefill(prompt, opts)? {
        return Ok(d.finish(stop));
    }
    loop {
        if let (_, Some(stop)) = d.window()? {
            return Ok(d.finish(stop));
        }
    }
}
