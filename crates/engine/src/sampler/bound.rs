//! The chain's logit-editing stages (penalties, DRY, slop) and what they need from a
//! vocabulary, bound once per sampler; the explicit-state sampling entry points
//! ([`Sampler::sample_with`], [`Sampler::penalize_draft`]) that the generation loops and the
//! speculative path call.
//!
//! Chain order: the stages run in the order the configuration lists them. The usual order
//! (and the CLI's default) is `penalties → dry → slop → top_k → top_p → min_p → temperature`,
//! then the pick: the edits reshape the model's distribution before any filter looks at it,
//! so a removed token cannot take a top-k slot.
//!
//! A greedy pick after edits only needs the edited ids' new values beside the raw logits, so
//! that path ([`super::view::Overlay`]) never copies the vocabulary.

use std::sync::Arc;

use super::dry;
use super::penalties;
use super::slop::{CompiledSlop, DraftCursor, SlopConfig, SlopState};
use super::view::{CandidateEdit, DraftEdit, LogitEdit, Overlay};
use super::vocab::SamplerVocab;
use super::{apply, argmax, pick, Candidates, Pick, SampleContext, Sampler, SamplerConfig, Stage};
use crate::error::{EngineError, Result};

/// The outcome of one sampling step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampled {
    Token(u32),
    /// The slop stage left no token with any probability (see [`SlopState::dead_end`]).
    DeadEnd,
}

/// What the chain's edits of a draft chain are, when a backend can make them on the device
/// ([`Sampler::draft_edits`]): the draft chain then runs without a host read between drafts.
#[derive(Clone, Debug)]
pub enum DraftEdits {
    /// The drafts need no edit (no edit stage, or only neutral ones).
    None,
    /// Slop mode 1 and nothing else: the token penalties and the run caps, starting from
    /// `state`, the token-level state after the history the chain starts from (the state
    /// [`Sampler::penalize_draft`] would start from), advanced by each draft.
    Slop {
        slop: Arc<CompiledSlop>,
        state: super::slop::TokenState,
    },
}

/// Per-stage bindings, parallel to the configuration's stages.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bound {
    /// DRY breaker ids (sorted) per stage index; empty for other stages.
    dry: Vec<Arc<Vec<u32>>>,
    slop: Option<Arc<CompiledSlop>>,
    /// The state used when the caller passes none: follows the history it is given.
    own: Option<SlopState>,
}

impl Stage {
    /// Stages that edit logits rather than filter or rescale them.
    pub fn is_edit(&self) -> bool {
        matches!(self, Stage::Penalties(_) | Stage::Dry(_) | Stage::Slop(_))
    }

    /// True when the stage changes nothing.
    fn is_neutral_edit(&self) -> bool {
        match self {
            Stage::Penalties(p) => p.is_neutral(),
            Stage::Dry(p) => p.is_neutral(),
            Stage::Slop(s) => s.mode == 0,
            _ => false,
        }
    }
}

/// Checks the edit stages' settings (called from [`SamplerConfig::validate`]).
pub(crate) fn validate_stage(s: &Stage) -> std::result::Result<(), String> {
    match s {
        Stage::Penalties(p) => p.validate(),
        Stage::Dry(p) => p.validate(),
        Stage::Slop(c) => c.validate(),
        _ => Ok(()),
    }
}

pub(crate) fn validate_chain(c: &SamplerConfig) -> Result<()> {
    let n = c
        .stages
        .iter()
        .filter(|s| matches!(s, Stage::Slop(_)))
        .count();
    if n > 1 {
        return Err(EngineError::Input(format!(
            "sampler: {n} slop stages; at most one (it carries the sequence's slop state)"
        )));
    }
    Ok(())
}

impl Bound {
    /// Bindings that need no vocabulary; an error names a stage that does.
    pub(crate) fn without_vocab(c: &SamplerConfig) -> Result<Bound> {
        for (i, s) in c.stages.iter().enumerate() {
            let needs = match s {
                Stage::Dry(p) => !p.is_neutral() && !p.sequence_breakers.is_empty(),
                Stage::Slop(s) => s.mode > 0,
                _ => false,
            };
            if needs {
                return Err(EngineError::Input(format!(
                    "sampler stage {i} ({}) needs the model's vocabulary: build the sampler \
                     with Sampler::with_vocab",
                    stage_name(s)
                )));
            }
        }
        Ok(Bound {
            dry: c.stages.iter().map(|_| Arc::new(Vec::new())).collect(),
            slop: None,
            own: None,
        })
    }

    fn with_vocab(c: &SamplerConfig, vocab: &dyn SamplerVocab) -> Result<Bound> {
        let mut b = Bound {
            dry: c.stages.iter().map(|_| Arc::new(Vec::new())).collect(),
            slop: None,
            own: None,
        };
        let n = vocab.n_vocab();
        for (i, s) in c.stages.iter().enumerate() {
            match s {
                Stage::Dry(p) if !p.is_neutral() => {
                    b.dry[i] = Arc::new(dry::breaker_ids(p, n, &|id| vocab.piece(id)));
                }
                Stage::Slop(cfg) if cfg.mode > 0 => {
                    b.slop = Some(Arc::new(CompiledSlop::compile(cfg, vocab)?));
                }
                _ => {}
            }
        }
        Ok(b)
    }
}

/// The stage's `type` name in the JSON form.
pub fn stage_name(s: &Stage) -> &'static str {
    match s {
        Stage::TopK { .. } => "top_k",
        Stage::TopP { .. } => "top_p",
        Stage::MinP { .. } => "min_p",
        Stage::Temperature { .. } => "temperature",
        Stage::Penalties(_) => "penalties",
        Stage::Dry(_) => "dry",
        Stage::Slop(_) => "slop",
    }
}

fn apply_edit(
    stage: &Stage,
    breakers: &[u32],
    ctx: &SampleContext<'_>,
    slop: Option<&DraftCursor<'_>>,
    e: &mut dyn LogitEdit,
) {
    match stage {
        Stage::Penalties(p) => penalties::apply(p, ctx.history, e),
        Stage::Dry(p) => dry::apply(p, breakers, ctx.history, e),
        Stage::Slop(_) => {
            if let Some(c) = slop {
                c.penalize(e);
            }
        }
        _ => {}
    }
}

/// The DRY stage without breaker tokens (what [`super::apply`] can do with no vocabulary).
pub(crate) fn apply_unbound(stage: &Stage, c: &mut Candidates, ctx: &SampleContext<'_>) {
    apply_edit(stage, &[], ctx, None, &mut CandidateEdit::new(c));
}

impl Sampler {
    /// A sampler whose DRY and slop stages are bound to `vocab` (token texts, phrase tokens).
    pub fn with_vocab(config: SamplerConfig, vocab: &dyn SamplerVocab) -> Result<Sampler> {
        config.validate()?;
        let bound = Bound::with_vocab(&config, vocab)?;
        Ok(Sampler { config, bound })
    }

    /// The compiled slop tables, when the chain has an active slop stage.
    pub fn slop(&self) -> Option<&Arc<CompiledSlop>> {
        self.bound.slop.as_ref()
    }

    /// The slop configuration of the chain, if any.
    pub fn slop_config(&self) -> Option<&SlopConfig> {
        self.config.stages.iter().find_map(|s| match s {
            Stage::Slop(c) => Some(c),
            _ => None,
        })
    }

    /// A fresh per-sequence slop state whose generated tokens start at `start` (None when the
    /// chain has no active slop stage).
    pub fn new_slop_state(&self, start: usize) -> Option<SlopState> {
        self.bound
            .slop
            .as_ref()
            .map(|s| SlopState::new(Arc::clone(s), start))
    }

    /// Forgets the state that [`Sampler::sample`] keeps for callers that pass none (call it at
    /// the start of each new generation, e.g. each chat turn).
    pub fn reset_sequence(&mut self) {
        self.bound.own = None;
    }

    /// The token for `logits` at `ctx.position`, with the slop stage reading `slop` (the
    /// sequence's state, which must be at `ctx.position`); with `None`, a state the sampler
    /// keeps itself and brings in line with `ctx.history` (token level only).
    pub fn sample_with(
        &mut self,
        logits: &[f32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) -> Result<Sampled> {
        let active = self
            .config
            .stages
            .iter()
            .any(|s| s.is_edit() && !s.is_neutral_edit());
        let cursor: Option<DraftCursor<'_>> = match (&self.bound.slop, slop) {
            (None, _) => None,
            (Some(_), Some(s)) => {
                if s.position() as u64 != ctx.position {
                    return Err(EngineError::Input(format!(
                        "sampler: the slop state is at position {}, the token asked for is at {}",
                        s.position(),
                        ctx.position
                    )));
                }
                Some(s.cursor())
            }
            (Some(c), None) => {
                let own = self.bound.own.get_or_insert_with(|| {
                    SlopState::without_text(Arc::clone(c), ctx.history.len())
                });
                own.sync(ctx.history);
                self.bound.own.as_ref().map(|s| s.cursor())
            }
        };
        let slop_on = cursor.is_some();
        let stages = &self.config.stages;
        if self.config.pick == Pick::Greedy && stages.iter().all(|s| s.is_edit()) {
            if !active {
                return argmax(logits).map(Sampled::Token);
            }
            let mut ov = Overlay::new(logits);
            for (i, s) in stages.iter().enumerate() {
                apply_edit(s, &self.bound.dry[i], ctx, cursor.as_ref(), &mut ov);
            }
            return Ok(match ov.argmax()? {
                Some(t) => Sampled::Token(t),
                None if slop_on => Sampled::DeadEnd,
                // Every logit was −∞ before any edit: the plain greedy answer.
                None => Sampled::Token(argmax(logits)?),
            });
        }
        // When the first filter is a top-k, the candidate set after it is found on the edited
        // logits directly (`Overlay::top_k`: the same set, order and bits) instead of building
        // and selecting from the whole vocabulary.
        let first_filter = stages.iter().position(|s| !s.is_edit());
        let (mut c, from) = match first_filter.map(|f| (f, &stages[f])) {
            Some((f, &Stage::TopK { k })) if k > 0 => {
                let mut ov = Overlay::new(logits);
                for (i, s) in stages[..f].iter().enumerate() {
                    apply_edit(s, &self.bound.dry[i], ctx, cursor.as_ref(), &mut ov);
                }
                (ov.top_k(k)?, f + 1)
            }
            _ => (Candidates::from_logits(logits)?, 0),
        };
        for (i, s) in stages.iter().enumerate().skip(from) {
            if s.is_edit() {
                apply_edit(
                    s,
                    &self.bound.dry[i],
                    ctx,
                    cursor.as_ref(),
                    &mut CandidateEdit::new(&mut c),
                );
            } else {
                apply(s, &mut c, ctx);
            }
        }
        // Any token with mass stops the scan at once in the usual case.
        if slop_on && !c.items.iter().any(|x| x.logit > f32::NEG_INFINITY) {
            return Ok(Sampled::DeadEnd);
        }
        pick(&self.config.pick, &mut c, ctx).map(Sampled::Token)
    }

    /// The edits [`Sampler::penalize_draft`] makes to the draft chain that starts after
    /// `ctx.history`, when they are a device operation: none at all, or slop mode 1 alone (its
    /// state found exactly as `penalize_draft` finds it: `slop`, else the sampler's own state,
    /// at its longest agreement with the history). None: the edits need the host (penalties,
    /// DRY, slop mode 2's phrases and bans).
    pub fn draft_edits(
        &self,
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) -> Option<DraftEdits> {
        for s in &self.config.stages {
            match s {
                Stage::Slop(c) if c.mode == 1 || c.mode == 0 => {}
                e if e.is_edit() && !e.is_neutral_edit() => return None,
                _ => {}
            }
        }
        let Some(c) = &self.bound.slop else {
            return Some(DraftEdits::None);
        };
        if c.mode() != 1 {
            return None;
        }
        let state = match slop.or(self.bound.own.as_ref()) {
            Some(s) => s.cursor_for(ctx.history).state().clone(),
            None => Default::default(),
        };
        Some(DraftEdits::Slop {
            slop: Arc::clone(c),
            state,
        })
    }

    /// Applies the chain's edit stages (penalties, DRY, slop, in chain order; filters and
    /// temperature do not move a greedy draft) to draft logits: `draft_logits[d]` belongs to
    /// the token whose `inverse` entry is `d`. `ctx` is the draft's own position and history
    /// (prompt, emitted tokens and the drafts before it); the slop stage starts from `slop`
    /// (or the sampler's own state) at its longest agreement with that history.
    pub fn penalize_draft(
        &self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) {
        let state = slop.or(self.bound.own.as_ref());
        let cursor = match (&self.bound.slop, state) {
            (Some(_), Some(s)) => Some(s.cursor_for(ctx.history)),
            (Some(c), None) => Some(DraftCursor::new(c, Default::default(), &[])),
            (None, _) => None,
        };
        let mut e = DraftEdit {
            logits: draft_logits,
            inverse,
        };
        for (i, s) in self.config.stages.iter().enumerate() {
            if s.is_edit() {
                apply_edit(s, &self.bound.dry[i], ctx, cursor.as_ref(), &mut e);
            }
        }
    }
}
