//! The drafter of speculative decoding: the MTP head's side. It proposes up to `N − 1` tokens
//! after the pending one (the first from its catch-up pass, each further one from one more
//! head step on its own pre-mixer output and the previous draft), each draft's logits edited
//! the way the judge will edit the trunk's at that position; and it catches up on what the
//! target committed: its cache cut back to the window's start, then the kept rows run through
//! the head with the trunk's pre-mixer states and the now-known next tokens (the last row is
//! the next window's first draft).
//!
//! It never touches the trunk: the target ([`super::target`]) hands it the rows to catch up on.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::{draft_alive, DeviceBuf, DraftMap, DraftSlop, StepKey, StepKind};
use crate::decode::DraftEdit;
use crate::error::{EngineError, Result};
use crate::qwen4exp::mtp::{DraftTokens, MtpState};
use crate::qwen4exp::ops::Qwen4expOps;
use crate::qwen4exp::Model;
use crate::sampler::slop::CompiledSlop;
use crate::sampler::DraftEdits;

use super::{argmax, softmax_prob, DraftHook, DraftVocab, SpecStats, MAX_WINDOW};

/// `StepKey::outputs` of a whole draft chain run as one step (bit 3; bit 1: a draft
/// vocabulary, bit 4: slop mode 1). The head steps inside it keep their own keys' bits
/// (`qwen4exp::mtp`: bit 2 marks their tokens as device ids).
pub const CHAIN_STEP: u32 = 1 << 3;

/// Slop mode 1's device tables and the compiled configuration they were made from.
type SlopTablesFor<B> = (
    Arc<CompiledSlop>,
    DraftSlop<<B as crate::backend::Backend>::Ids, <B as crate::backend::Backend>::Buf>,
);

/// The first draft of the next window: the MTP's pre-mixer output at the last consumed
/// position (one row) and its logits over the draft rows, both still on the device.
struct NextDraft<B: Qwen4expOps> {
    hidden: B::Buf,
    logits: B::Buf,
}

/// A catch-up the head still owes: the trunk states of the kept rows and their next tokens.
struct Catchup<B: Qwen4expOps> {
    hidden: B::Buf,
    next: Vec<u32>,
}

/// The MTP head of one speculative sequence.
pub(crate) struct MtpDrafter<'m, B: Qwen4expOps> {
    model: &'m Model<B>,
    pub(crate) mtp: MtpState<B>,
    min_p: f32,
    vocab: Option<DraftVocab>,
    /// The draft vocabulary's ids on the device (the LM-head rows a draft computes, and the
    /// map of a draft pick to token ids).
    map: Option<DraftMap<B::Ids>>,
    /// The identity map, for drafts over the full vocabulary.
    full_inverse: Vec<i32>,
    /// A chain's picks on the device, gathered for one download at its end: [`MAX_WINDOW`]
    /// token ids, then their picked logits' bits. And the next draft step's token (slot 0, so
    /// the step reads it at the same address every time: a replaying backend's step stays the
    /// same), with its logit's bits in slot 1 when a hook reads the pick.
    chain_ids: Option<B::Ids>,
    next_id: Option<B::Ids>,
    /// The first draft's hidden row and logits where the chain step reads them.
    chain_in: Option<(B::Buf, B::Buf)>,
    /// Slop mode 1's tables on the device, for the configuration they were made from.
    slop: Option<SlopTablesFor<B>>,
    next_draft: Option<NextDraft<B>>,
    catchup: Option<Catchup<B>>,
    /// The judge may rewind (slop mode 2): keep each window's first draft, so that a rewind
    /// to the window's start needs no replay.
    pub(crate) may_rewind: bool,
    saved_first: Option<NextDraft<B>>,
    pub(crate) hook: Option<Box<dyn DraftHook + 'm>>,
    /// Apply the judge's edits to the drafts (off only to measure what they buy).
    pub(crate) penalize: bool,
}

impl<'m, B: Qwen4expOps> MtpDrafter<'m, B> {
    /// The drafter over `mtp` (at the trunk's position). `drafts`: the window can hold drafts
    /// (above 1), so the draft vocabulary's rows and the identity map are made up front.
    pub(crate) fn new(
        model: &'m Model<B>,
        mtp: MtpState<B>,
        min_p: f32,
        vocab: Option<DraftVocab>,
        drafts: bool,
    ) -> Result<Self> {
        let full_inverse = if drafts && vocab.is_none() {
            let n = i32::try_from(model.config().n_vocab).map_err(|_| {
                crate::error::EngineError::Input(
                    "the vocabulary has more than 2^31 tokens".to_string(),
                )
            })?;
            (0..n).collect()
        } else {
            Vec::new()
        };
        let b = model.backend();
        let map = match &vocab {
            Some(v) if drafts => Some(DraftMap::new(b, v.ids(), model.config().n_vocab)?),
            _ => None,
        };
        let (chain_ids, next_id) = if drafts {
            (
                Some(b.upload_ids(&[0; 2 * MAX_WINDOW])?),
                Some(b.upload_ids(&[0; 2])?),
            )
        } else {
            (None, None)
        };
        Ok(MtpDrafter {
            model,
            mtp,
            min_p,
            vocab,
            map,
            full_inverse,
            chain_ids,
            next_id,
            chain_in: None,
            slop: None,
            next_draft: None,
            catchup: None,
            may_rewind: false,
            saved_first: None,
            hook: None,
            penalize: true,
        })
    }

    /// Owes a catch-up over `hidden` (the trunk's pre-mixer rows) with `next`, the token after
    /// each row.
    pub(crate) fn owe(&mut self, hidden: B::Buf, next: Vec<u32>) {
        self.catchup = Some(Catchup { hidden, next });
    }

    /// Forgets the next first draft (the sequence goes on with rows the head has not seen).
    pub(crate) fn forget_first(&mut self) {
        self.next_draft = None;
    }

    /// Runs the owed catch-up: the head then holds every consumed token, and its last row is
    /// the next window's first draft.
    pub(crate) fn catch_up(&mut self, stats: &mut SpecStats) -> Result<()> {
        let Some(c) = self.catchup.take() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let rows = self.map.as_ref().map(|m| &m.dev);
        let (logits, hidden) =
            self.model
                .mtp_forward_dev(&mut self.mtp, &c.hidden, &c.next, true, rows)?;
        let b = self.model.backend();
        let hidden = b.last_row(hidden)?;
        self.next_draft = Some(NextDraft { hidden, logits });
        stats.catchup_time += t0.elapsed();
        Ok(())
    }

    /// Up to `max` drafts after `pending`, the trunk holding `consumed` (its positions
    /// `..position`): catches up first, keeps the first draft when the judge may rewind, then
    /// runs the chain.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn propose(
        &mut self,
        consumed: &[u32],
        position: usize,
        pending: u32,
        max: usize,
        edit: &mut dyn DraftEdit,
        stats: &mut SpecStats,
    ) -> Result<Vec<u32>> {
        self.catch_up(stats)?;
        self.saved_first = match (&self.next_draft, self.may_rewind) {
            (Some(d), true) => Some(NextDraft {
                hidden: self.model.backend().copy(&d.hidden)?,
                logits: self.model.backend().copy(&d.logits)?,
            }),
            _ => None,
        };
        self.chain(consumed, position, pending, max, edit, stats)
    }

    /// Picks a draft from draft-row logits on the host: (token, probability when the floor is
    /// on).
    fn pick_host(&self, logits: &[f32]) -> (u32, f32) {
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

    /// Makes slop mode 1's device tables for `slop` (once per configuration).
    fn slop_tables(&mut self, slop: &Arc<CompiledSlop>) -> Result<()> {
        if self
            .slop
            .as_ref()
            .is_some_and(|(c, _)| Arc::ptr_eq(c, slop))
        {
            return Ok(());
        }
        let inverse = match &self.vocab {
            Some(v) => v.inverse_map().to_vec(),
            None => self.full_inverse.clone(),
        };
        let n_draft = self
            .vocab
            .as_ref()
            .map_or(self.model.config().n_vocab, |v| v.len());
        let t = DraftSlop::new(self.model.backend(), Arc::clone(slop), inverse, n_draft)?;
        self.slop = Some((Arc::clone(slop), t));
        Ok(())
    }

    /// The draft chain; each draft's logits get the judge's edits for the history before it
    /// (the consumed tokens, the pending token and the earlier drafts), so a draft never
    /// proposes what the sampler has removed.
    ///
    /// One decision, per chain, says where the drafts are edited and picked: on the device
    /// when the edits are none or slop mode 1 ([`DraftEdit::draft_edits`]) and there is no
    /// draft floor (`min_p` needs the draft's probability). There each draft's logits get
    /// `slop_pen_draft` (its state carried on the device from the state after the history,
    /// advanced by each draft), `pick_draft_mapped` gives the token id, and that id feeds the
    /// next head step on the device, the whole chain one step ([`Self::chain_on_device`]):
    /// nothing is read between drafts, and the chain's ids come back in one download at its
    /// end. A hook over the drafts that decides ahead (`DraftHook::ahead`: forced acceptance)
    /// feeds that chain its tokens; one that needs each proposal reads each pick, and the head
    /// steps run one by one. Otherwise (penalties, DRY, slop mode 2, a floor) each
    /// draft's logits are downloaded and edited on the host.
    #[allow(clippy::too_many_arguments)]
    fn chain(
        &mut self,
        consumed: &[u32],
        position: usize,
        pending: u32,
        max: usize,
        edit: &mut dyn DraftEdit,
        stats: &mut SpecStats,
    ) -> Result<Vec<u32>> {
        let Some(first) = self.next_draft.take() else {
            return Ok(Vec::new());
        };
        let mut drafts = Vec::with_capacity(max);
        if max == 0 {
            return Ok(drafts);
        }
        if max > MAX_WINDOW {
            return Err(EngineError::Input(format!(
                "draft chain: {max} drafts; at most {MAX_WINDOW}"
            )));
        }
        let base = position + 1;
        let mut history = Vec::with_capacity(base + max);
        history.extend_from_slice(consumed);
        history.push(pending);
        let device = if self.min_p > 0.0 {
            None
        } else if !self.penalize {
            Some(DraftEdits::None)
        } else {
            edit.draft_edits(&history)
        };
        let slop_state = match &device {
            Some(DraftEdits::Slop { slop, state: s0 }) => {
                self.slop_tables(slop)?;
                Some(DraftSlop::<B::Ids, B::Buf>::state_ids(s0))
            }
            _ => None,
        };
        if device.is_some() {
            // Drafts a hook decides ahead (forced acceptance) keep the chain on the device too.
            let forced = match self.hook.as_mut() {
                None => Some(None),
                Some(h) => match h.ahead(base) {
                    None => None,
                    Some(first_tok) => {
                        let mut toks: Vec<u32> = first_tok.into_iter().collect();
                        if !toks.is_empty() {
                            for j in 1..max {
                                match h.ahead(base + j) {
                                    Some(Some(t)) => toks.push(t),
                                    _ => break,
                                }
                            }
                        }
                        Some(Some(toks))
                    }
                },
            };
            if let Some(forced) = forced {
                return self.chain_on_device(first, max, slop_state, forced, stats);
            }
        }
        let b = self.model.backend();
        let mut state = match &slop_state {
            Some(s) => Some(b.upload_ids(s)?),
            None => None,
        };
        let tables = match (&slop_state, &self.slop) {
            (Some(_), Some((_, t))) => Some(t),
            _ => None,
        };
        // The previous draft's id on the device (slop's `prev`).
        let mut prev: Option<B::Ids> = None;
        let mut hidden = first.hidden;
        let mut logits = first.logits;
        loop {
            let j = drafts.len();
            let tok = if device.is_some() {
                // Edited and picked on the device; the hook reads each pick (the id and its
                // logit's bits, one read).
                if let (Some(t), Some(s)) = (tables, state.as_ref()) {
                    state = Some(b.slop_pen_draft(&mut logits, t, prev.as_ref(), s)?);
                }
                let picked = b.pick_draft_mapped(&logits, self.map.as_ref())?;
                let next = self
                    .next_id
                    .as_mut()
                    .ok_or_else(|| EngineError::shape("draft chain", "no pick buffer"))?;
                b.write_ids(next, 0, &picked.ids)?;
                b.write_ids(next, 1, &picked.values)?;
                let read = b.download_ids(next)?;
                let &[proposed, value] = read.as_slice() else {
                    return Err(EngineError::shape("pick_draft_mapped", "no row"));
                };
                // Everything removed: no draft can be right (the host chain's rule).
                if !draft_alive(value) {
                    break;
                }
                let tok = match self.hook.as_mut() {
                    Some(h) => match h.draft(base + j, proposed) {
                        Some(t) => t,
                        None => break,
                    },
                    None => proposed,
                };
                prev = match (tables, tok == proposed) {
                    (None, _) => None,
                    (Some(_), true) => Some(picked.ids),
                    (Some(_), false) => Some(b.upload_ids(&[tok])?),
                };
                tok
            } else {
                let mut host = b.download(&logits)?;
                let inverse: &[i32] = match &self.vocab {
                    Some(v) => v.inverse_map(),
                    None => &self.full_inverse,
                };
                edit.edit(&mut host, inverse, base + j, &history);
                // Everything removed: no draft can be right.
                if !host.iter().any(|&x| x > f32::NEG_INFINITY) {
                    break;
                }
                let (proposed, p) = self.pick_host(&host);
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
                history.push(tok);
                tok
            };
            drafts.push(tok);
            if drafts.len() == max {
                break;
            }
            let t0 = Instant::now();
            let rows = self.map.as_ref().map(|m| &m.dev);
            let (lg, hid) =
                self.model
                    .mtp_forward_dev(&mut self.mtp, &hidden, &[tok], true, rows)?;
            logits = lg;
            hidden = hid;
            stats.draft_steps += 1;
            stats.draft_time += t0.elapsed();
        }
        Ok(drafts)
    }

    /// The chain on the device as one step, keyed by its length (a capturing backend records
    /// it once per `N` and replays it: "a graph per N"): per draft, `slop_pen_draft` (when
    /// `slop_state`, the state array after the history, is given), `pick_draft_mapped` into
    /// the chain's slots and the next step's token, and the next head step on that token (a
    /// step inside the step). The first draft's hidden row and logits are copied to buffers
    /// of the drafter's first, so the step reads the same addresses whichever catch-up made
    /// them. Nothing is read until the step is done; then the chain's ids, once.
    fn chain_on_device(
        &mut self,
        first: NextDraft<B>,
        max: usize,
        slop_state: Option<Vec<u32>>,
        forced: Option<Vec<u32>>,
        stats: &mut SpecStats,
    ) -> Result<Vec<u32>> {
        let model = self.model;
        let b = model.backend();
        // Forced drafts (a hook's, decided ahead) replace the picks as the chain's tokens; the
        // chain runs the same operations (the picks too: they say where it would have ended).
        let max = forced.as_ref().map_or(max, |f| f.len().min(max));
        if max == 0 {
            return Ok(Vec::new());
        }
        let n_vocab = model.config().n_vocab;
        if let Some(&t) = forced.iter().flatten().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::Input(format!(
                "draft hook: token id {t} is out of range (vocabulary {n_vocab})"
            )));
        }
        // Every head step's room, before any runs: a step that failed part-way would leave the
        // head's length ahead of what ran.
        model.mtp_check_room(&self.mtp, max - 1)?;
        let fits = |x: &Option<(B::Buf, B::Buf)>| {
            x.as_ref().is_some_and(|(h, l)| {
                h.cols() == first.hidden.cols() && l.cols() == first.logits.cols()
            })
        };
        if !fits(&self.chain_in) {
            self.chain_in = Some((
                b.zeros(1, first.hidden.cols())?,
                b.zeros(1, first.logits.cols())?,
            ));
        }
        let (Some((hidden0, logits0)), Some(chain), Some(next)) = (
            self.chain_in.as_mut(),
            self.chain_ids.as_mut(),
            self.next_id.as_mut(),
        ) else {
            return Err(EngineError::shape("draft chain", "no chain buffers"));
        };
        b.copy_into(hidden0, &first.hidden)?;
        b.copy_into(logits0, &first.logits)?;
        let tables = match (&slop_state, &self.slop) {
            (Some(_), Some((_, t))) => Some(t),
            _ => None,
        };
        let map = self.map.as_ref();
        let mtp = &mut self.mtp;
        let key = StepKey {
            kind: StepKind::Draft,
            rows: max,
            outputs: CHAIN_STEP
                | (map.is_some() as u32) << 1
                | (tables.is_some() as u32) << 4
                | (forced.is_some() as u32) << 5,
            seq: mtp.id,
        };
        let t0 = Instant::now();
        b.step(key, || {
            let mut state = match &slop_state {
                Some(s) => Some(b.upload_ids(s)?),
                None => None,
            };
            let forced = match &forced {
                Some(f) => Some(b.upload_ids(f)?),
                None => None,
            };
            let mut prev: Option<B::Ids> = None;
            let mut owned: Option<(B::Buf, B::Buf)> = None;
            for j in 0..max {
                let out = {
                    let (hidden, logits) = match owned.as_mut() {
                        Some((h, l)) => (&*h, l),
                        None => (&*hidden0, &mut *logits0),
                    };
                    if let (Some(t), Some(s)) = (tables, state.as_ref()) {
                        state = Some(b.slop_pen_draft(logits, t, prev.as_ref(), s)?);
                    }
                    let picked = b.pick_draft_mapped(logits, map)?;
                    b.write_ids(chain, j, &picked.ids)?;
                    b.write_ids(chain, MAX_WINDOW + j, &picked.values)?;
                    prev = Some(match &forced {
                        Some(f) => b.ids_range(f, j, 1)?,
                        None => {
                            b.write_ids(next, 0, &picked.ids)?;
                            picked.ids
                        }
                    });
                    if j + 1 == max {
                        break;
                    }
                    let tokens = match &forced {
                        Some(f) => DraftTokens::Device {
                            ids: f,
                            from: j,
                            n: 1,
                        },
                        None => DraftTokens::Device {
                            ids: &*next,
                            from: 0,
                            n: 1,
                        },
                    };
                    let rows = map.map(|m| &m.dev);
                    model.mtp_forward_from(mtp, hidden, tokens, true, rows)?
                };
                owned = Some((out.1, out.0));
            }
            Ok(())
        })?;
        // The chain's head steps, with the picks (and slop edits) between them: one step.
        if max > 1 {
            stats.draft_steps += max as u64 - 1;
            stats.draft_time += t0.elapsed();
        }
        // The chain's one read: its ids and their logits' bits. It ends where the host's
        // would: at the first draft whose every logit the edits removed (the steps after it
        // ran for nothing).
        let ids = b.download_ids(chain)?;
        let alive = (0..max)
            .take_while(|&j| draft_alive(ids[MAX_WINDOW + j]))
            .count();
        Ok(match forced {
            Some(f) => f[..alive].to_vec(),
            None => ids[..alive].to_vec(),
        })
    }

    /// Whether the head can follow the target back to the window's start (it kept the
    /// window's first draft).
    pub(crate) fn can_restart(&self) -> bool {
        self.saved_first.is_some()
    }

    /// The target kept a prefix of the window from `pos0`: the head's cache is cut back there
    /// and it owes a catch-up over the kept rows with `next`.
    pub(crate) fn follow_prefix(
        &mut self,
        pos0: usize,
        hidden: Option<B::Buf>,
        next: Vec<u32>,
    ) -> Result<()> {
        self.saved_first = None;
        if let Some(hidden) = hidden {
            self.model.mtp_truncate(&mut self.mtp, pos0)?;
            self.catchup = Some(Catchup { hidden, next });
        }
        Ok(())
    }

    /// The target went back to the window's start `pos0`: so does the head, with the window's
    /// first draft again.
    pub(crate) fn follow_start(&mut self, pos0: usize) -> Result<()> {
        self.model.mtp_truncate(&mut self.mtp, pos0)?;
        self.catchup = None;
        self.next_draft = self.saved_first.take();
        Ok(())
    }

    /// The target was rebuilt: a fresh head that owes a catch-up over every consumed row.
    pub(crate) fn follow_rebuild(&mut self, hidden: Option<B::Buf>, next: Vec<u32>) -> Result<()> {
        self.mtp = self.model.new_mtp_state()?;
        self.saved_first = None;
        self.next_draft = None;
        self.catchup = hidden.map(|hidden| Catchup { hidden, next });
        Ok(())
    }
}
