//! The one place the server touches the engine's model, state and sampler API: the loaded model
//! ([`ModelHandle`], qwen2 or qwen4exp, generic over the backend so a device backend can be
//! handed in; the server builds only CPU ones itself), one sequence's state with its prefix
//! checkpoints ([`Seq`]), the sampler a request asks for ([`SamplingParams`]) and one
//! generation advanced a window at a time ([`Gen`]) so that the worker can interleave sequences
//! fairly.
//!
//! A generation is the engine's one decoding loop (`strata_engine::decode`, as a
//! [`Progress`] that owns its state between calls): the stepper is the slot's sequence (plain
//! decoding, rewinds through checkpoints) or a speculative decoder over it (MTP drafts, one
//! verify pass per window), and the pick is a [`Chooser`]: the request's sampler with the
//! server's extensions — the grammar's token mask (on the trunk's logits and on every draft),
//! the reasoning budget's forced tokens, and log-probability capture. Stop strings are the
//! handlers' (they close the token channel, which ends the loop at its next token).
//!
//! Prefix reuse (issue 13 §7): a qwen2 sequence rolls back by truncating its K/V; a qwen4exp
//! sequence's recurrent states cannot be truncated, so checkpoints are taken at the end of
//! prefill, at the last user-message boundary and at the end of generation, and a rollback
//! restores the longest one at or below the common prefix (K/V truncated with it); the caller
//! replays the prompt from there. The MTP head's state is attention K/V only: it is cut back
//! with the trunk, and kept level with it while a speculative request prefills.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use strata_engine::backend::Backend;
use strata_engine::decode::{DraftEdit, Judged, Lent, Pick as Choose, Progress, Stepper, Verified};
use strata_engine::generate::{GenOptions, StopReason, Timings};
use strata_engine::qwen4exp::mtp::MtpState;
use strata_engine::qwen4exp::state::Checkpoint;
use strata_engine::sampler::dry::{self, DryParams};
use strata_engine::sampler::guard::GuardStop;
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry, SlopState};
use strata_engine::sampler::{Pick, SampleContext, Sampled, Sampler, SamplerConfig, Stage};
use strata_engine::speculative::{SpecConfig, SpecDecoder, SpecStats};
use strata_engine::{qwen2, qwen4exp, CpuBackend, EngineError, KvType, Qwen4expOps};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

/// A loaded model of a supported architecture: qwen2 on any core backend, qwen4exp on any
/// backend of its family.
pub enum ModelHandle<Q2: Backend = CpuBackend, Q4: Qwen4expOps = CpuBackend> {
    Qwen2(Box<qwen2::Model<Q2>>),
    Qwen4exp(Box<qwen4exp::Model<Q4>>),
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub threads: usize,
    pub kv_type: KvType,
    /// An MTP head GGUF to attach beside a qwen4exp trunk.
    pub mtp: Option<PathBuf>,
    /// Positions qwen4exp's caches hold (None: the file's context length).
    pub ctx: Option<usize>,
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            threads: 0,
            kv_type: KvType::F16,
            mtp: None,
            ctx: None,
        }
    }
}

impl ModelHandle {
    /// Opens `path`, reads its tokenizer and binds the model for its architecture on the CPU.
    pub fn load(path: &Path, spec: &LoadSpec) -> Result<(ModelHandle, Tokenizer)> {
        let file =
            Arc::new(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?);
        let tok = Tokenizer::from_gguf(&file)
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
        let backend = CpuBackend::new(spec.threads)?;
        let arch = file.architecture()?.to_string();
        let model = match arch.as_str() {
            qwen2::ARCH => {
                if let Some(p) = &spec.mtp {
                    bail!(
                        "--mtp {}: MTP speculation needs a qwen4exp model; {} is qwen2",
                        p.display(),
                        path.display()
                    );
                }
                ModelHandle::Qwen2(Box::new(
                    qwen2::Model::from_file(
                        file,
                        backend,
                        &qwen2::LoadOptions {
                            kv_type: spec.kv_type,
                        },
                    )
                    .with_context(|| format!("loading {}", path.display()))?,
                ))
            }
            qwen4exp::config::ARCH => {
                let opts = qwen4exp::LoadOptions {
                    kv_type: spec.kv_type,
                    ctx: spec.ctx,
                    ..Default::default()
                };
                let mut m = qwen4exp::Model::from_file(file, backend, &opts)
                    .with_context(|| format!("loading {}", path.display()))?;
                for w in m.warnings() {
                    tracing::warn!("{w}");
                }
                if let Some(p) = &spec.mtp {
                    m.load_mtp(p)
                        .with_context(|| format!("loading the MTP head {}", p.display()))?;
                }
                ModelHandle::Qwen4exp(Box::new(m))
            }
            other => bail!(
                "{}: architecture '{other}' is not supported; expected qwen2 or qwen4exp",
                path.display()
            ),
        };
        Ok((model, tok))
    }
}

impl<Q2: Backend, Q4: Qwen4expOps> ModelHandle<Q2, Q4> {
    pub fn arch(&self) -> &'static str {
        match self {
            ModelHandle::Qwen2(_) => qwen2::ARCH,
            ModelHandle::Qwen4exp(_) => qwen4exp::config::ARCH,
        }
    }

    pub fn n_vocab(&self) -> usize {
        match self {
            ModelHandle::Qwen2(m) => m.config().n_vocab,
            ModelHandle::Qwen4exp(m) => m.config().n_vocab,
        }
    }

    /// The context the model was trained for, when the file says.
    pub fn trained_ctx(&self) -> Option<usize> {
        match self {
            ModelHandle::Qwen2(m) => Some(m.config().n_ctx_train),
            ModelHandle::Qwen4exp(_) => None,
        }
    }

    /// Positions the model's caches hold (qwen4exp's are sized at load).
    pub fn capacity(&self) -> usize {
        match self {
            ModelHandle::Qwen2(m) => m.config().n_ctx_train,
            ModelHandle::Qwen4exp(m) => m.config().n_ctx,
        }
    }

    /// Whether an MTP head is attached (speculative requests need one).
    pub fn has_mtp(&self) -> bool {
        match self {
            ModelHandle::Qwen2(_) => false,
            ModelHandle::Qwen4exp(m) => m.has_mtp(),
        }
    }

    /// Bytes one recurrent-state checkpoint holds (0 for a model that needs none).
    pub fn checkpoint_bytes(&self) -> usize {
        match self {
            ModelHandle::Qwen2(_) => 0,
            ModelHandle::Qwen4exp(m) => {
                let c = m.config();
                let g = c.gdn;
                let per_gdn =
                    (g.conv_kernel - 1) * g.conv_dim() + g.n_v_heads * g.head_k * g.head_v;
                let n_gdn = c
                    .layers
                    .iter()
                    .filter(|l| matches!(l, qwen4exp::config::LayerKind::Gdn))
                    .count();
                let ple = c.ple.as_ref().map_or(0, |p| p.history() * c.residual_dim());
                4 * (n_gdn * per_gdn + ple)
            }
        }
    }

    pub fn new_seq(&self) -> Result<Seq<Q2, Q4>> {
        Ok(Seq {
            state: self.fresh_state()?,
            checkpoints: Vec::new(),
            head_next: None,
        })
    }

    fn fresh_state(&self) -> Result<SeqState<Q2, Q4>> {
        Ok(match self {
            ModelHandle::Qwen2(m) => SeqState::Qwen2(m.new_state()?),
            ModelHandle::Qwen4exp(m) => SeqState::Qwen4exp {
                st: m.new_state()?,
                mtp: if m.has_mtp() {
                    Some(m.new_mtp_state()?)
                } else {
                    None
                },
            },
        })
    }
}

enum SeqState<Q2: Backend, Q4: Qwen4expOps> {
    Qwen2(qwen2::State<Q2>),
    /// `mtp`: the head's state (with a head), at most at the trunk's position: level with it
    /// after a speculative request, behind it after a plain one (which does not run the head).
    Qwen4exp {
        st: qwen4exp::State<Q4>,
        mtp: Option<MtpState<Q4>>,
    },
    /// Lent to a speculative decoder for the length of a generation.
    Lent,
}

/// A recurrent-state checkpoint and when it was taken (for the cache's eviction order).
struct Saved<Q4: Qwen4expOps> {
    cp: Checkpoint<Q4>,
    stamp: u64,
}

/// One sequence's state, kept in its slot between requests so that the next request can reuse
/// the prefix it shares.
pub struct Seq<Q2: Backend = CpuBackend, Q4: Qwen4expOps = CpuBackend> {
    state: SeqState<Q2, Q4>,
    /// qwen4exp only, sorted by position.
    checkpoints: Vec<Saved<Q4>>,
    /// While the MTP head is level with the trunk: the token its last row was paired with (the
    /// one after the trunk's last), which a new prompt must repeat for the head to be reused.
    head_next: Option<u32>,
}

const LENT: &str = "the sequence is lent to a speculative generation";

impl<Q2: Backend, Q4: Qwen4expOps> Seq<Q2, Q4> {
    /// Tokens consumed so far (none while lent).
    pub fn tokens(&self) -> &[u32] {
        match &self.state {
            SeqState::Qwen2(s) => s.tokens(),
            SeqState::Qwen4exp { st, .. } => st.tokens(),
            SeqState::Lent => &[],
        }
    }

    pub fn len(&self) -> usize {
        self.tokens().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the MTP head's state holds level with the trunk (0 without a head).
    pub fn head_position(&self) -> usize {
        match &self.state {
            SeqState::Qwen4exp { mtp: Some(m), .. } => m.position(),
            _ => 0,
        }
    }

    /// Forgets everything (after a failure left the state part-way).
    pub fn reset(&mut self, model: &ModelHandle<Q2, Q4>) -> Result<()> {
        self.state = model.fresh_state()?;
        self.checkpoints.clear();
        self.head_next = None;
        Ok(())
    }

    /// The token at `pos` that the MTP head's row `pos − 1` was paired with: the sequence's
    /// own below its length, `head_next` at it.
    fn head_token(&self, pos: usize) -> Option<u32> {
        let t = self.tokens();
        match pos.cmp(&t.len()) {
            std::cmp::Ordering::Less => t.get(pos).copied(),
            std::cmp::Ordering::Equal => self.head_next,
            std::cmp::Ordering::Greater => None,
        }
    }

    /// For a speculative request: rolls back to the longest point at or below `pos` (at most
    /// the head's position) where the trunk can restore and the head's last row is paired with
    /// the prompt's own token, and leaves the head level with the trunk there. Returns it.
    pub fn rollback_head(
        &mut self,
        model: &ModelHandle<Q2, Q4>,
        pos: usize,
        prompt: &[u32],
    ) -> Result<usize> {
        let mut pos = pos.min(self.head_position());
        loop {
            // Where a rollback to `pos` would land: the sequence's end, or a checkpoint.
            let q = if pos >= self.len() {
                self.len()
            } else {
                self.checkpoints
                    .iter()
                    .rev()
                    .map(|s| s.cp.position())
                    .find(|&p| p <= pos)
                    .unwrap_or(0)
            };
            if q == 0 || self.head_token(q) == prompt.get(q).copied() {
                let next = self.head_token(q);
                let reached = self.rollback(model, q, true)?;
                self.head_next = if reached > 0 { next } else { None };
                return Ok(reached);
            }
            pos = q - 1;
        }
    }

    /// Consumes `tokens` (at least one); returns the logits after the last. The MTP head does
    /// not follow (it falls behind; a speculative prompt's chunks run through
    /// [`Seq::feed_batch`] with `follow`). On an error the sequence is rolled back to where it
    /// was (qwen2) or emptied (qwen4exp, whose recurrent states are then part-way).
    pub fn feed(&mut self, model: &ModelHandle<Q2, Q4>, tokens: &[u32]) -> Result<Vec<f32>> {
        match (model, &mut self.state) {
            (ModelHandle::Qwen2(m), SeqState::Qwen2(st)) => {
                let pos = st.position();
                match m.forward_with(st, tokens, true) {
                    Ok(out) => Ok(out.logits),
                    Err(e) => {
                        m.truncate(st, pos)?;
                        Err(e.into())
                    }
                }
            }
            (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp { st, .. }) => {
                let want = qwen4exp::Want {
                    last_only: true,
                    ..Default::default()
                };
                match m.forward_with(st, tokens, want) {
                    Ok(o) => Ok(o.logits),
                    Err(e) => {
                        self.reset(model)?;
                        Err(e.into())
                    }
                }
            }
            (_, SeqState::Lent) => bail!(LENT),
            _ => bail!("a sequence of one model was used with another"),
        }
    }

    /// Rolls back to at most `pos` tokens, as cheaply as the model allows, and returns the
    /// length reached: `pos` for qwen2; for qwen4exp the longest checkpoint at or below `pos`
    /// (or 0). The caller replays whatever it needs beyond. The MTP head keeps only rows whose
    /// next token is still the sequence's: `head` (a speculative request, which calls with a
    /// `pos` below the prefix it shares) keeps it level with the trunk, else it ends a row
    /// behind at most.
    pub fn rollback(
        &mut self,
        model: &ModelHandle<Q2, Q4>,
        pos: usize,
        head: bool,
    ) -> Result<usize> {
        let have = self.len();
        let reached = match (model, &mut self.state) {
            (_, SeqState::Lent) => bail!(LENT),
            _ if pos >= have => have,
            (ModelHandle::Qwen2(m), SeqState::Qwen2(st)) => {
                m.truncate(st, pos)?;
                pos
            }
            (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp { st, .. }) => {
                self.checkpoints.retain(|s| s.cp.position() <= pos);
                match self.checkpoints.last() {
                    Some(s) => {
                        m.restore(st, &s.cp)?;
                        s.cp.position()
                    }
                    None => {
                        *st = m.new_state()?;
                        0
                    }
                }
            }
            _ => bail!("a sequence of one model was used with another"),
        };
        if let (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp { mtp: Some(h), .. }) =
            (model, &mut self.state)
        {
            let keep = if head {
                reached
            } else {
                reached.saturating_sub(1)
            };
            let keep = keep.min(h.position());
            m.mtp_truncate(h, keep)?;
        }
        Ok(reached)
    }

    /// Rolls back to exactly `pos` tokens: the cheapest rollback, then a replay of the tokens it
    /// had between there and `pos`.
    pub fn rewind(&mut self, model: &ModelHandle<Q2, Q4>, pos: usize) -> Result<usize> {
        let keep: Vec<u32> = self.tokens()[..pos.min(self.len())].to_vec();
        let reached = self.rollback(model, pos, false)?;
        if reached < keep.len() {
            self.feed(model, &keep[reached..])?;
        }
        Ok(keep.len() - reached)
    }

    /// Saves the recurrent state at the current position (qwen4exp; a no-op for qwen2 and when
    /// one is already saved there). Returns the bytes added.
    pub fn checkpoint(&mut self, model: &ModelHandle<Q2, Q4>, stamp: u64) -> Result<usize> {
        let (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp { st, .. }) = (model, &self.state) else {
            return Ok(0);
        };
        let pos = st.position();
        if pos == 0 || self.checkpoints.iter().any(|s| s.cp.position() == pos) {
            return Ok(0);
        }
        let cp = m.checkpoint(st)?;
        let at = self.checkpoints.partition_point(|s| s.cp.position() < pos);
        self.checkpoints.insert(at, Saved { cp, stamp });
        Ok(model.checkpoint_bytes())
    }

    pub fn n_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// The stamp of this sequence's oldest checkpoint.
    pub fn oldest_checkpoint(&self) -> Option<u64> {
        self.checkpoints.iter().map(|s| s.stamp).min()
    }

    /// Drops the oldest checkpoint; returns whether there was one.
    pub fn drop_oldest_checkpoint(&mut self) -> bool {
        let Some((i, _)) = self
            .checkpoints
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.stamp)
        else {
            return false;
        };
        self.checkpoints.remove(i);
        true
    }

    /// Where the sequence would end after `n` more tokens, checked against the caches before a
    /// batch runs (so that one sequence's full context does not fail the others').
    pub fn check_room(&self, model: &ModelHandle<Q2, Q4>, n: usize) -> Result<()> {
        if matches!(self.state, SeqState::Lent) {
            bail!(LENT);
        }
        let end = self.len() + n;
        if end > model.capacity() {
            return Err(EngineError::ContextFull {
                what: "the sequence",
                needed: end,
                capacity: model.capacity(),
            }
            .into());
        }
        Ok(())
    }

    /// Several sequences' rows in one forward pass (`strata_engine::batch`): each plain
    /// item's tokens continue its sequence, and its logits (of the last token, or of each with
    /// `last_only` false) are the bits [`Seq::feed`] gives it alone; a speculative prompt's
    /// chunk (`follow`: the prompt's token after it) with the head level with the trunk gives
    /// its rows' pre-mixer states instead ([`Fed::Hidden`], for [`Seq::follow_head`] after the
    /// pass); a speculative generation's prompt end and verify windows run as rows of the same
    /// pass, with what its decoder needs ([`Fed::Prompt`], [`Fed::Window`], for [`Gen::end`]).
    /// A plain item does not run the MTP head (it falls behind); a generation's head is its
    /// decoder's, which follows in [`Gen::end`]. On an error in the pass every plain sequence
    /// of the batch is rolled back (qwen2) or emptied (qwen4exp); a generation fails with it
    /// (its states are part-way).
    pub fn feed_batch<'m>(
        model: &ModelHandle<Q2, Q4>,
        items: &mut [Feed<'_, 'm, Q2, Q4>],
    ) -> Result<Vec<Fed<Q4>>> {
        let res = match model {
            ModelHandle::Qwen2(m) => {
                let mut batch = Vec::with_capacity(items.len());
                for it in items.iter_mut() {
                    let Feed::Seq {
                        seq,
                        tokens,
                        last_only,
                        ..
                    } = it
                    else {
                        bail!("speculative decoding needs a qwen4exp model");
                    };
                    let SeqState::Qwen2(state) = &mut seq.state else {
                        bail!("a sequence of one model was used with another");
                    };
                    batch.push(qwen2::BatchItem {
                        state,
                        tokens,
                        last_only: *last_only,
                    });
                }
                m.forward_batch(&mut batch)
                    .map(|o| o.into_iter().map(|o| Fed::Logits(o.logits)).collect())
            }
            ModelHandle::Qwen4exp(m) => {
                /// What an item's results go back as.
                enum Back {
                    Logits,
                    Hidden,
                    Window,
                    Prompt,
                }
                let mut batch = Vec::with_capacity(items.len());
                let mut back = Vec::with_capacity(items.len());
                for it in items.iter_mut() {
                    let (item, b) = match it {
                        Feed::Seq {
                            seq,
                            tokens,
                            last_only,
                            follow,
                        } => {
                            let SeqState::Qwen4exp { st, mtp } = &mut seq.state else {
                                bail!(
                                    "a plain batch row needs a qwen4exp sequence that is not lent"
                                );
                            };
                            // The head follows a chunk only from level with the trunk.
                            let hidden = follow.is_some()
                                && mtp.as_ref().is_some_and(|h| h.position() == st.position());
                            let item = qwen4exp::BatchItem {
                                hidden,
                                ..qwen4exp::BatchItem::rows(st, tokens, *last_only)
                            };
                            (item, if hidden { Back::Hidden } else { Back::Logits })
                        }
                        Feed::Window { gen, tokens } => (gen.window_item(tokens)?, Back::Window),
                        Feed::Prompt { gen, prompt } => (gen.prompt_item(prompt)?, Back::Prompt),
                    };
                    batch.push(item);
                    back.push(b);
                }
                let b = m.backend();
                m.forward_batch_dev(&mut batch).and_then(|outs| {
                    outs.into_iter()
                        .zip(back)
                        .map(|(o, back)| match back {
                            Back::Logits => Ok(Fed::Logits(b.download(&o.logits)?)),
                            Back::Hidden => {
                                o.hidden.map(Fed::Hidden).ok_or_else(|| EngineError::Shape {
                                    op: "batch",
                                    what: "no pre-mixer rows for the MTP head".to_string(),
                                })
                            }
                            Back::Window => Ok(Fed::Window(o)),
                            Back::Prompt => Ok(Fed::Prompt(o)),
                        })
                        .collect()
                })
            }
        };
        match res {
            Ok(l) => Ok(l),
            Err(e) => {
                // A failed step advanced no position: qwen2's caches are whole below it;
                // qwen4exp's recurrent states may be part-way, so those sequences start over.
                if let ModelHandle::Qwen4exp(_) = model {
                    for it in items.iter_mut() {
                        if let Feed::Seq { seq, .. } = it {
                            seq.reset(model)?;
                        }
                    }
                }
                Err(e.into())
            }
        }
    }

    /// After a speculative prompt's chunk ran in a batch ([`Fed::Hidden`]): the MTP head
    /// follows the trunk over the chunk's rows, `hidden` their pre-mixer states and `next` the
    /// prompt's token after the chunk, so the head stays level with the trunk. On an error the
    /// sequence starts afresh (its head would be part-way).
    pub fn follow_head(
        &mut self,
        model: &ModelHandle<Q2, Q4>,
        hidden: &Q4::Buf,
        next: u32,
    ) -> Result<()> {
        let (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp { st, mtp: Some(h) }) =
            (model, &mut self.state)
        else {
            bail!("the MTP head follows a qwen4exp sequence that has one");
        };
        match m.mtp_follow(st, h, hidden, next) {
            Ok(()) => {
                self.head_next = Some(next);
                Ok(())
            }
            Err(e) => {
                self.reset(model)?;
                Err(e.into())
            }
        }
    }

    /// Takes the trunk's and the head's states out for a speculative decoder.
    fn lend(&mut self) -> Result<(qwen4exp::State<Q4>, Option<MtpState<Q4>>)> {
        match std::mem::replace(&mut self.state, SeqState::Lent) {
            SeqState::Qwen4exp { st, mtp } => Ok((st, mtp)),
            other => {
                self.state = other;
                bail!("speculative decoding needs a qwen4exp sequence")
            }
        }
    }
}

/// One sequence's rows in a batched step ([`Seq::feed_batch`]).
pub enum Feed<'a, 'm, Q2: Backend, Q4: Qwen4expOps> {
    /// Tokens continuing a slot's sequence: the logits of the last only, or of each; with
    /// `follow` (a speculative prompt's chunk: the prompt's token after it), the rows'
    /// pre-mixer states for the MTP head to follow instead.
    Seq {
        seq: &'a mut Seq<Q2, Q4>,
        tokens: &'a [u32],
        last_only: bool,
        follow: Option<u32>,
    },
    /// A speculative generation's prompt end: the part of `prompt` its decoder does not hold
    /// yet (the last token; the decoder holds the slot's sequence meanwhile).
    Prompt {
        gen: &'a mut Gen<'m, Q2, Q4>,
        prompt: &'a [u32],
    },
    /// A speculative generation's verify window ([`Gen::begin`]; its decoder holds the
    /// slot's sequence meanwhile).
    Window {
        gen: &'a mut Gen<'m, Q2, Q4>,
        tokens: &'a [u32],
    },
}

/// What a batched step gave one of its sequences, for [`Gen::end`] (or, a prompt chunk's
/// pre-mixer rows, [`Seq::follow_head`]): a plain row's logits (downloaded), or a speculative
/// generation's results still on the device (its decoder picks there when it can, and keeps
/// the hidden rows for its head).
pub enum Fed<Q4: Qwen4expOps> {
    Logits(Vec<f32>),
    /// A speculative prompt chunk's pre-mixer rows, still on the device, for
    /// [`Seq::follow_head`].
    Hidden(Q4::Buf),
    Window(qwen4exp::BatchOut<Q4>),
    /// A speculative prompt end's results: the logits after the prompt and its rows'
    /// pre-mixer states, for its decoder.
    Prompt(qwen4exp::BatchOut<Q4>),
}

/// The sampling knobs a request may set (OpenAI's and llama.cpp's names), with llama.cpp's
/// defaults. `build` turns them into the engine's chain in the CLI's default order
/// `penalties → dry → slop → top_k → top_p → min_p → temperature`.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub repeat_penalty: f32,
    pub repeat_last_n: i64,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: u32,
    pub dry_penalty_last_n: i64,
    pub dry_sequence_breakers: Option<Vec<String>>,
    /// None: 0, or 2 when phrases or a list are given (as the CLI).
    pub slop_mode: Option<u8>,
    pub slop_phrases: Vec<String>,
    /// None: the built-in list; Some(list): these entries replace it.
    pub slop_list: Option<Vec<(String, f32)>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: None,
            slop_mode: None,
            slop_phrases: Vec::new(),
            slop_list: None,
        }
    }
}

impl SamplingParams {
    /// The engine's chain for these settings (validated).
    pub fn config(&self) -> Result<SamplerConfig> {
        let greedy = self.temperature <= 0.0;
        let mut stages = Vec::new();
        let pen = PenaltyParams {
            last_n: self.repeat_last_n,
            repeat: self.repeat_penalty,
            frequency: self.frequency_penalty,
            presence: self.presence_penalty,
        };
        if !pen.is_neutral() {
            stages.push(Stage::Penalties(pen));
        }
        let d = DryParams {
            multiplier: self.dry_multiplier,
            base: self.dry_base,
            allowed_length: self.dry_allowed_length,
            last_n: self.dry_penalty_last_n,
            sequence_breakers: self
                .dry_sequence_breakers
                .clone()
                .unwrap_or_else(dry::default_breakers),
        };
        if !d.is_neutral() {
            stages.push(Stage::Dry(d));
        }
        let mode = match self.slop_mode {
            Some(m) => m,
            None if self.slop_list.is_some() || !self.slop_phrases.is_empty() => 2,
            None => 0,
        };
        if mode > 0 {
            let (list, entries) = match &self.slop_list {
                Some(l) => (
                    ListChoice::None,
                    l.iter()
                        .map(|(p, x)| SlopEntry {
                            phrase: p.clone(),
                            penalty: *x,
                        })
                        .collect(),
                ),
                None => (ListChoice::Default, Vec::new()),
            };
            stages.push(Stage::Slop(SlopConfig {
                mode,
                list,
                entries,
                ban: self.slop_phrases.clone(),
                ..SlopConfig::default()
            }));
        }
        if !greedy {
            if self.top_k > 0 {
                stages.push(Stage::TopK { k: self.top_k });
            }
            if self.top_p < 1.0 {
                stages.push(Stage::TopP {
                    p: self.top_p,
                    min_keep: 1,
                });
            }
            if self.min_p > 0.0 {
                stages.push(Stage::MinP {
                    p: self.min_p,
                    min_keep: 1,
                });
            }
            if self.temperature != 1.0 {
                stages.push(Stage::Temperature {
                    t: self.temperature,
                });
            }
        }
        let pick = if greedy {
            Pick::Greedy
        } else {
            Pick::Draw {
                seed: self.seed.unwrap_or_else(clock_seed),
            }
        };
        let c = SamplerConfig { stages, pick };
        c.validate()?;
        Ok(c)
    }

    /// The sampler bound to the model's vocabulary (DRY breakers, slop phrases).
    pub fn build(&self, tok: &Tokenizer) -> Result<Sampler> {
        Ok(Sampler::with_vocab(self.config()?, tok)?)
    }
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token (not emitted).
    Eog,
    MaxTokens,
    /// The sequence filled the context.
    ContextFull,
    /// Slop's phrase level ended the reply before a listed phrase (rewind budget or dead end).
    Slop,
    /// The token channel closed (the client went away, or a stop string matched).
    Closed,
}

/// What one [`Gen`] call produced.
#[derive(Debug, Default)]
pub struct StepOut {
    /// Tokens that became final, with their log-probabilities when asked for.
    pub tokens: Vec<(u32, Option<TokenLogprob>)>,
    /// Set when the generation is over (the tokens above still belong to it).
    pub finish: Option<Finish>,
}

/// A constraint on the generated tokens (a grammar): applied to the logits before the sampler.
pub trait Constraint: Send {
    /// Sets the logits of forbidden tokens to −∞.
    fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String>;
    /// The same on a draft's logits, whose rows are the vocabulary ids `inverse` maps to
    /// indices (−1: no row).
    fn mask_draft(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
    ) -> std::result::Result<(), String>;
    /// Records generated tokens while the grammar allows them; returns how many it took (a
    /// refused token leaves the state as it was before it).
    fn consume(&mut self, toks: &[u32]) -> std::result::Result<usize, String>;
    /// Forgets generated tokens past the first `n` (rewinds, rejected drafts).
    fn truncate(&mut self, n: usize) -> std::result::Result<(), String>;
}

/// A constraint kept in step with whatever token sequence the loop hands the pick: the judged
/// tokens, or those plus a window's drafts (it rolls back to the common prefix and consumes
/// the rest).
struct Synced {
    c: Box<dyn Constraint>,
    consumed: Vec<u32>,
}

impl Synced {
    fn sync(&mut self, gen: &[u32]) -> strata_engine::Result<()> {
        let common = self
            .consumed
            .iter()
            .zip(gen)
            .take_while(|(a, b)| a == b)
            .count();
        let err = |e: String| EngineError::Input(format!("grammar: {e}"));
        if common < self.consumed.len() {
            self.c.truncate(common).map_err(err)?;
            self.consumed.truncate(common);
        }
        let rest = &gen[common..];
        let n = self.c.consume(rest).map_err(err)?;
        self.consumed.extend_from_slice(&rest[..n]);
        match rest.get(n) {
            Some(t) => Err(err(format!("token {t} is not allowed here"))),
            None => Ok(()),
        }
    }
}

/// A cap on the tokens generated inside `<think>…</think>`: when it is reached, `close` is
/// written into the sequence (as llama.cpp's reasoning budget does), and the answer follows.
#[derive(Clone, Debug)]
pub struct ThinkBudget {
    pub budget: usize,
    /// The prompt opened the block already.
    pub in_think: bool,
    /// Token forms of `<think>` and `</think>`, and what is forced to close (`\n</think>\n\n`).
    pub open: Vec<u32>,
    pub end: Vec<u32>,
    pub close: Vec<u32>,
}

impl ThinkBudget {
    pub fn new(
        budget: usize,
        in_think: bool,
        open: Vec<u32>,
        end: Vec<u32>,
        close: Vec<u32>,
    ) -> Self {
        ThinkBudget {
            budget,
            in_think,
            open,
            end,
            close,
        }
    }

    /// The token the budget forces after the generated tokens `gen` (None: the model
    /// chooses). Read from `gen` alone, so rewinds and drafts need no bookkeeping: follows the
    /// block's opening and closing, counts the tokens inside, and once the budget is spent
    /// writes `close` one token per position.
    fn forced(&self, gen: &[u32]) -> Option<u32> {
        let mut in_think = self.in_think;
        let mut count = 0usize;
        let mut forcing = in_think && self.budget == 0;
        // The next token of `close` to write, while it is being written.
        let mut queue = forcing.then_some(0usize);
        for i in 0..gen.len() {
            if let Some(k) = queue {
                queue = (k + 1 < self.close.len()).then_some(k + 1);
            }
            let upto = &gen[..=i];
            if !self.end.is_empty() && upto.ends_with(&self.end) {
                in_think = false;
                forcing = false;
            } else if !self.open.is_empty() && upto.ends_with(&self.open) {
                in_think = true;
                count = 0;
            } else if in_think && !forcing {
                count += 1;
                if count >= self.budget {
                    forcing = true;
                    queue = Some(0);
                }
            }
        }
        queue.and_then(|k| self.close.get(k).copied())
    }
}

/// What shapes one generation besides its sampler.
pub struct GenRules {
    pub max_tokens: usize,
    /// The sequence's context (generation stops when it is full).
    pub n_ctx: usize,
    /// Log-probabilities with this many alternatives (None: none).
    pub top_logprobs: Option<usize>,
    pub constraint: Option<Box<dyn Constraint>>,
    /// The grammar starts after the reasoning block when the prompt opened one: after
    /// `</think>` and what the reasoning budget writes after it; None: from the first generated
    /// token.
    pub grammar_after: Option<GrammarAfter>,
    pub think: Option<ThinkBudget>,
    /// Verify window: 1 is plain decoding, more drafts with the MTP head.
    pub window: usize,
    /// End-of-generation ids: a draft after one is never made (the judge would end there).
    pub eog: Arc<Vec<u32>>,
    /// Replaces the head's drafts (tests).
    pub oracle: Option<DraftOracle>,
}

/// A function that replaces each MTP draft: given the drafted token's absolute position and
/// the head's proposal, the draft to use (None ends the window's chain). For tests and
/// benchmarks that need drafts accepted or refused in a pattern (the engine's `DraftHook`).
#[derive(Clone)]
pub struct DraftOracle(pub Arc<dyn Fn(usize, u32) -> Option<u32> + Send + Sync>);

impl std::fmt::Debug for DraftOracle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DraftOracle")
    }
}

impl strata_engine::speculative::DraftHook for DraftOracle {
    fn draft(&mut self, position: usize, proposed: u32) -> Option<u32> {
        (self.0)(position, proposed)
    }
}

/// The decoding loop's pick for a request: its sampler (with the sequence's slop state), after
/// the reasoning budget's forced token and the grammar's mask; records each chosen token's
/// log-probability (of the raw logits) by position, and edits drafts the same way so that
/// speculation proposes only what the pick could choose.
pub struct Chooser {
    sampler: Sampler,
    /// Position of the first generated token.
    start: usize,
    constraint: Option<Synced>,
    grammar_after: Option<GrammarAfter>,
    think: Option<ThinkBudget>,
    top_logprobs: Option<usize>,
    eog: Arc<Vec<u32>>,
    /// The latest pick's log-probability at each generated position.
    lps: Vec<Option<TokenLogprob>>,
}

impl Chooser {
    fn generated<'h>(&self, history: &'h [u32]) -> &'h [u32] {
        history.get(self.start..).unwrap_or(&[])
    }
}

/// Where a grammar starts when the prompt opened a reasoning block: after the reasoning
/// budget's forced `close` (`\n</think>\n\n`, whose trailing newlines the grammar would
/// refuse) when the generation holds it, else after the block's first `end` (`</think>`).
/// Forced tokens never reach the grammar, so it is first asked after a forced close is whole.
#[derive(Clone, Debug)]
pub struct GrammarAfter {
    pub end: Vec<u32>,
    /// Empty without a budget.
    pub close: Vec<u32>,
}

/// The part of the generated tokens `gen` the grammar reads: all of them, or what follows the
/// reasoning block (None while it is open).
fn grammar_part<'g>(after: Option<&GrammarAfter>, gen: &'g [u32]) -> Option<&'g [u32]> {
    let Some(a) = after.filter(|a| !a.end.is_empty()) else {
        return Some(gen);
    };
    let after = |pat: &[u32]| {
        (!pat.is_empty())
            .then(|| gen.windows(pat.len()).position(|w| w == pat))
            .flatten()
            .map(|i| &gen[i + pat.len()..])
    };
    after(&a.close).or_else(|| after(&a.end))
}

impl Choose for Chooser {
    fn pick(
        &mut self,
        logits: &[f32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) -> strata_engine::Result<Sampled> {
        let gen = ctx.history.get(self.start..).unwrap_or(&[]);
        self.lps.truncate(gen.len());
        if let Some(t) = self.think.as_ref().and_then(|b| b.forced(gen)) {
            self.lps.push(None);
            return Ok(Sampled::Token(t));
        }
        let part = grammar_part(self.grammar_after.as_ref(), gen);
        let sampled = match (self.constraint.as_mut(), part) {
            (Some(c), Some(gen)) => {
                c.sync(gen)?;
                let mut masked = logits.to_vec();
                c.c.mask(&mut masked)
                    .map_err(|e| EngineError::Input(format!("grammar: {e}")))?;
                self.sampler.sample_with(&masked, ctx, slop)?
            }
            _ => self.sampler.sample_with(logits, ctx, slop)?,
        };
        if let Sampled::Token(t) = sampled {
            self.lps
                .push(self.top_logprobs.map(|n| logprob_of(logits, t, n)));
        }
        Ok(sampled)
    }

    fn penalize_draft(
        &mut self,
        draft_logits: &mut [f32],
        inverse: &[i32],
        ctx: &SampleContext<'_>,
        slop: Option<&SlopState>,
    ) {
        let gen = self.generated(ctx.history);
        let none = |l: &mut [f32]| l.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
        if gen.iter().any(|t| self.eog.contains(t)) {
            return none(draft_logits);
        }
        if let Some(t) = self.think.as_ref().and_then(|b| b.forced(gen)) {
            let keep = inverse.get(t as usize).copied().unwrap_or(-1);
            for (i, x) in draft_logits.iter_mut().enumerate() {
                if i as i32 != keep {
                    *x = f32::NEG_INFINITY;
                }
            }
            return;
        }
        self.sampler
            .penalize_draft(draft_logits, inverse, ctx, slop);
        let part = grammar_part(self.grammar_after.as_ref(), gen);
        if let (Some(c), Some(gen)) = (self.constraint.as_mut(), part) {
            let ok = c
                .sync(gen)
                .map_err(|e| e.to_string())
                .and_then(|()| c.c.mask_draft(draft_logits, inverse));
            // A grammar that cannot follow the drafts: no draft (the judge still decides).
            if ok.is_err() {
                none(draft_logits);
            }
        }
    }
}

fn engine_err(e: anyhow::Error) -> EngineError {
    match e.downcast::<EngineError>() {
        Ok(e) => e,
        Err(e) => EngineError::Input(format!("{e:#}")),
    }
}

/// A slot's sequence as the decoding loop's stepper: windows of one token (no drafter); a
/// rewind rolls back through the checkpoints and replays.
struct SeqStepper<'a, Q2: Backend, Q4: Qwen4expOps> {
    seq: &'a mut Seq<Q2, Q4>,
    model: &'a ModelHandle<Q2, Q4>,
    n_ctx: usize,
}

/// Runs the part of `prompt` the sequence does not hold yet (the worker prefilled the rest in
/// chunks, so this is its last token).
fn check_prefix(have: &[u32], prompt: &[u32]) -> strata_engine::Result<()> {
    if prompt.len() <= have.len() || prompt.get(..have.len()) != Some(have) {
        return Err(EngineError::Input(
            "the sequence holds tokens that are not a prefix of the prompt".to_string(),
        ));
    }
    Ok(())
}

impl<Q2: Backend, Q4: Qwen4expOps> Stepper for SeqStepper<'_, Q2, Q4> {
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn tokens(&self) -> &[u32] {
        self.seq.tokens()
    }
    fn prefill(
        &mut self,
        prompt: &[u32],
        _opts: &GenOptions,
        t: &mut Timings,
    ) -> strata_engine::Result<Vec<f32>> {
        let have = self.seq.len();
        check_prefix(self.seq.tokens(), prompt)?;
        let t0 = std::time::Instant::now();
        let logits = self
            .seq
            .feed(self.model, &prompt[have..])
            .map_err(engine_err)?;
        t.prompt = t0.elapsed();
        t.prompt_tokens = prompt.len() - have;
        t.reused_tokens = have;
        Ok(logits)
    }
    fn propose(
        &mut self,
        _pending: u32,
        _max: usize,
        _edit: &mut dyn DraftEdit,
    ) -> strata_engine::Result<Vec<u32>> {
        Ok(Vec::new())
    }
    fn verify(&mut self, window: &[u32]) -> strata_engine::Result<Vec<f32>> {
        if window.len() != 1 {
            return Err(EngineError::Input(
                "verify: a plain sequence verifies one token at a time".to_string(),
            ));
        }
        self.seq.feed(self.model, window).map_err(engine_err)
    }
    fn settle(&mut self, seq: &[u32], judged: Judged) -> strata_engine::Result<()> {
        let want = &seq[..seq.len().saturating_sub(1)];
        let have = self.seq.tokens();
        // Without a rewind the sequence consumed exactly the judged tokens.
        if have.len() == want.len() && (!judged.rewound || have == want) {
            return Ok(());
        }
        let common = have.iter().zip(want).take_while(|(a, b)| a == b).count();
        self.seq.rewind(self.model, common).map_err(engine_err)?;
        if common < want.len() {
            self.seq
                .feed(self.model, &want[common..])
                .map_err(engine_err)?;
        }
        Ok(())
    }
    /// The last kept token stays consumed (the next turn extends from it).
    fn settle_at_end(&self) -> bool {
        false
    }
}

/// The speculative decoder with the server's context (which may be below the caches').
struct SpecStepper<'a, 'm, Q4: Qwen4expOps> {
    dec: &'a mut SpecDecoder<'m, Q4>,
    n_ctx: usize,
}

impl<Q4: Qwen4expOps> Stepper for SpecStepper<'_, '_, Q4> {
    fn n_ctx(&self) -> usize {
        self.n_ctx.min(Stepper::n_ctx(&*self.dec))
    }
    fn tokens(&self) -> &[u32] {
        Stepper::tokens(self.dec)
    }
    fn prefill(
        &mut self,
        prompt: &[u32],
        opts: &GenOptions,
        t: &mut Timings,
    ) -> strata_engine::Result<Vec<f32>> {
        Stepper::prefill(&mut *self.dec, prompt, opts, t)
    }
    fn propose(
        &mut self,
        pending: u32,
        max: usize,
        edit: &mut dyn DraftEdit,
    ) -> strata_engine::Result<Vec<u32>> {
        Stepper::propose(&mut *self.dec, pending, max, edit)
    }
    fn verify(&mut self, window: &[u32]) -> strata_engine::Result<Vec<f32>> {
        Stepper::verify(&mut *self.dec, window)
    }
    fn settle(&mut self, seq: &[u32], judged: Judged) -> strata_engine::Result<()> {
        Stepper::settle(&mut *self.dec, seq, judged)
    }
    fn settle_at_end(&self) -> bool {
        Stepper::settle_at_end(&*self.dec)
    }
    fn may_rewind(&mut self, yes: bool) {
        Stepper::may_rewind(&mut *self.dec, yes)
    }
}

/// A speculative request's counters: per draft position (index 0 = the first draft), the
/// drafts made and those accepted.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecCounts {
    pub window: usize,
    /// Trunk verify passes.
    pub passes: u64,
    pub drafted: Vec<u64>,
    pub accepted: Vec<u64>,
}

impl SpecCounts {
    fn from_stats(s: &SpecStats) -> SpecCounts {
        SpecCounts {
            window: s.window,
            passes: s.passes,
            drafted: s.offered.clone(),
            accepted: s.accepted.clone(),
        }
    }
}

/// One generation: the decoding loop's state, the request's pick, and (speculative) the
/// decoder that holds the slot's sequence meanwhile.
pub struct Gen<'m, Q2: Backend = CpuBackend, Q4: Qwen4expOps = CpuBackend> {
    p: Option<Progress>,
    pick: Chooser,
    spec: Option<Box<SpecDecoder<'m, Q4>>>,
    n_ctx: usize,
    /// Tokens handed out so far (their log-probabilities are `pick.lps[..emitted]`).
    emitted: usize,
    _q2: std::marker::PhantomData<Q2>,
}

impl<'m, Q2: Backend, Q4: Qwen4expOps> Gen<'m, Q2, Q4> {
    /// A generation after `prompt`, of which `seq` holds all but the last token (the worker's
    /// chunked prefill). A window above 1 lends the sequence to a speculative decoder, whose
    /// head state must be level with the trunk ([`Seq::rollback`] with `head`).
    pub fn new(
        model: &'m ModelHandle<Q2, Q4>,
        seq: &mut Seq<Q2, Q4>,
        sampler: Sampler,
        prompt_len: usize,
        rules: GenRules,
    ) -> Result<Self> {
        let GenRules {
            max_tokens,
            n_ctx,
            top_logprobs,
            constraint,
            grammar_after,
            think,
            window,
            eog,
            oracle,
        } = rules;
        let slop = sampler.new_slop_state(prompt_len);
        let pick = Chooser {
            sampler,
            start: prompt_len,
            constraint: constraint.map(|c| Synced {
                c,
                consumed: Vec::new(),
            }),
            grammar_after,
            think,
            top_logprobs,
            eog,
            lps: Vec::new(),
        };
        let mut spec = None;
        if window > 1 {
            let ModelHandle::Qwen4exp(m) = model else {
                bail!("speculative decoding needs a qwen4exp model with an MTP head");
            };
            if !m.has_mtp() {
                bail!("speculative decoding needs an MTP head (strata serve --mtp)");
            }
            if seq.head_position() != seq.len() {
                bail!(
                    "the MTP head holds {} positions, the sequence {}",
                    seq.head_position(),
                    seq.len()
                );
            }
            let (st, mtp) = seq.lend()?;
            let cfg = SpecConfig {
                window,
                ..SpecConfig::default()
            };
            match SpecDecoder::resume(m, cfg, st, mtp) {
                Ok(d) => {
                    spec = Some(Box::new(match oracle {
                        Some(o) => d.with_draft_hook(o),
                        None => d,
                    }))
                }
                Err(e) => {
                    seq.reset(model)?;
                    return Err(e.into());
                }
            }
        }
        let mut g = Gen {
            p: None,
            pick,
            spec,
            n_ctx,
            emitted: 0,
            _q2: std::marker::PhantomData,
        };
        let p = {
            let mut plain;
            let mut sp;
            let stepper: &mut dyn Stepper = match g.spec.as_deref_mut() {
                Some(dec) => {
                    sp = SpecStepper { dec, n_ctx };
                    &mut sp
                }
                None => {
                    plain = SeqStepper { seq, model, n_ctx };
                    &mut plain
                }
            };
            Progress::new(stepper, slop, window, max_tokens, prompt_len)
        };
        g.p = Some(p);
        Ok(g)
    }

    /// Generated tokens so far (emitted or held back).
    pub fn generated(&self) -> usize {
        self.p.as_ref().map_or(0, |p| p.generated())
    }

    /// Rewinds taken so far.
    pub fn rewinds(&self) -> u32 {
        self.p.as_ref().map_or(0, |p| p.rewinds())
    }

    /// The speculative counters (None for plain decoding).
    pub fn spec_counts(&self) -> Option<SpecCounts> {
        self.spec
            .as_ref()
            .map(|d| SpecCounts::from_stats(d.stats()))
    }

    /// Whether the next window's sequence would end past the caches' capacity after `n` more
    /// tokens (checked before a batch runs, so that one full context fails alone).
    pub fn check_room(
        &self,
        model: &ModelHandle<Q2, Q4>,
        seq: &Seq<Q2, Q4>,
        n: usize,
    ) -> Result<()> {
        let Some(dec) = self.spec.as_deref() else {
            return seq.check_room(model, n);
        };
        let end = dec.state().position() + n;
        if end > model.capacity() {
            return Err(EngineError::ContextFull {
                what: "the sequence",
                needed: end,
                capacity: model.capacity(),
            }
            .into());
        }
        Ok(())
    }

    /// Whether this generation is speculative: its windows run through [`Feed::Window`].
    pub fn speculative(&self) -> bool {
        self.spec.is_some()
    }

    /// The first half of a batched step ([`Progress::begin_window`]): the tokens this
    /// generation's next window runs (plain decoding: the pending token; speculative: the
    /// pending token and the head's drafts, which the drafter proposes here).
    pub fn begin(
        &mut self,
        model: &ModelHandle<Q2, Q4>,
        seq: &mut Seq<Q2, Q4>,
    ) -> Result<Vec<u32>> {
        let Some(p) = self.p.as_mut() else {
            bail!("the generation is over");
        };
        let n_ctx = self.n_ctx;
        let mut plain;
        let mut sp;
        let stepper: &mut dyn Stepper = match self.spec.as_deref_mut() {
            Some(dec) => {
                sp = SpecStepper { dec, n_ctx };
                &mut sp
            }
            None => {
                plain = SeqStepper { seq, model, n_ctx };
                &mut plain
            }
        };
        let lent = Lent {
            stepper,
            pick: &mut self.pick,
            is_eog: &|_| false,
            on_token: &mut |_| true,
        };
        Ok(p.begin_window(lent)?.to_vec())
    }

    /// The batch item of a speculative generation's begun window (`tokens`, from
    /// [`Gen::begin`]).
    fn window_item<'a>(&'a mut self, tokens: &'a [u32]) -> Result<qwen4exp::BatchItem<'a, Q4>> {
        let Some(dec) = self.spec.as_deref_mut() else {
            bail!("a verify window for a generation that is not speculative");
        };
        Ok(dec.window_item(tokens)?)
    }

    /// The batch item of a speculative generation's prompt end: the rest of `prompt` (its
    /// last token) continuing the decoder's trunk, the head's rows with it.
    fn prompt_item<'a>(&'a mut self, prompt: &'a [u32]) -> Result<qwen4exp::BatchItem<'a, Q4>> {
        let Some(dec) = self.spec.as_deref_mut() else {
            bail!("a speculative prompt for a generation that is not speculative");
        };
        Ok(dec.prompt_item(prompt, prompt.len())?)
    }

    /// The second half of a batched step: `fed` (the rows of the window, which the batch ran
    /// through `seq` or the decoder's state) judged, then the settle; or, with `first`, the
    /// logits after the prompt (the batch ran its last token) and the first generated token.
    pub fn end(
        &mut self,
        model: &ModelHandle<Q2, Q4>,
        seq: &mut Seq<Q2, Q4>,
        fed: Fed<Q4>,
        first: Option<&[u32]>,
        is_eog: &dyn Fn(u32) -> bool,
        closed: &dyn Fn() -> bool,
    ) -> Result<StepOut> {
        let Some(p) = self.p.as_mut() else {
            bail!("the generation is over");
        };
        let rows = match (fed, self.spec.as_deref_mut(), first) {
            (Fed::Logits(l), None, _) => Verified::Logits(l),
            (Fed::Window(out), Some(dec), None) => {
                dec.window_ran(out, p.device_pick(&self.pick))?
            }
            (Fed::Prompt(out), Some(dec), Some(_)) => match dec.prompt_ran(out)? {
                Some(l) => Verified::Logits(l),
                None => bail!("the prompt's end gave no logits"),
            },
            _ => bail!("a batch's rows do not match the generation they were run for"),
        };
        let mut buf = Vec::new();
        let mut sink = |t: u32| {
            buf.push(t);
            !closed()
        };
        let n_ctx = self.n_ctx;
        let mut plain;
        let mut sp;
        let stepper: &mut dyn Stepper = match self.spec.as_deref_mut() {
            Some(dec) => {
                sp = SpecStepper { dec, n_ctx };
                &mut sp
            }
            None => {
                plain = SeqStepper { seq, model, n_ctx };
                &mut plain
            }
        };
        let lent = Lent {
            stepper,
            pick: &mut self.pick,
            is_eog,
            on_token: &mut sink,
        };
        let end = match (first, rows) {
            (Some(prompt), Verified::Logits(l)) => {
                p.prefilled(lent, prompt, &l, &Timings::default())?
            }
            (Some(_), Verified::Ids(_)) => bail!("the first token needs the prompt's logits"),
            (None, rows) => p.end_window(lent, rows)?.1,
        };
        Ok(self.out(end, buf, closed))
    }

    /// What a step streamed, with the log-probabilities, and how the generation ended.
    fn out(
        &mut self,
        end: Option<GuardStop>,
        mut buf: Vec<u32>,
        closed: &dyn Fn() -> bool,
    ) -> StepOut {
        let mut sink = |t: u32| {
            buf.push(t);
            !closed()
        };
        let finish = match end {
            Some(stop) => {
                let p = self.p.take().expect("checked above");
                let _ = p.finish(&mut sink, stop);
                Some(match stop {
                    GuardStop::Plain(StopReason::Eog(_)) => Finish::Eog,
                    GuardStop::Plain(StopReason::MaxTokens) => Finish::MaxTokens,
                    GuardStop::Plain(StopReason::ContextFull) => Finish::ContextFull,
                    GuardStop::Plain(StopReason::Stopped) => Finish::Closed,
                    GuardStop::RewindBudget | GuardStop::DeadEnd => Finish::Slop,
                })
            }
            None => None,
        };
        let mut out = StepOut {
            tokens: Vec::with_capacity(buf.len()),
            finish,
        };
        for t in buf {
            let lp = self.pick.lps.get_mut(self.emitted).and_then(Option::take);
            self.emitted += 1;
            out.tokens.push((t, lp));
        }
        out
    }

    /// Gives the sequence back to its slot (speculative: the decoder's states, the head
    /// brought level with the trunk). `ok`: the generation ended normally; otherwise its
    /// states may be part-way and the sequence starts afresh.
    pub fn release(
        self,
        model: &ModelHandle<Q2, Q4>,
        seq: &mut Seq<Q2, Q4>,
        ok: bool,
    ) -> Result<()> {
        let Some(mut dec) = self.spec else {
            if !ok {
                seq.reset(model)?;
            }
            return Ok(());
        };
        if ok && dec.sync_mtp().is_ok() {
            let pending = dec.pending();
            let (st, mtp) = dec.into_states();
            seq.state = SeqState::Qwen4exp { st, mtp };
            seq.head_next = pending;
            // Checkpoints beyond what the decoder kept are stale.
            let n = seq.len();
            seq.checkpoints.retain(|s| s.cp.position() <= n);
            Ok(())
        } else {
            seq.reset(model)
        }
    }
}

/// A token's log-probability under the model (raw logits, before any sampler stage) and the
/// most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// log-softmax of `logits` at `id`, and the `n` best tokens (ties to the lower id).
pub fn logprob_of(logits: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lz = z.ln() as f32 + max;
    let lp = |l: f32| l - lz;
    let mut top: Vec<(u32, f32)> = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let cmp = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = n.min(idx.len());
        if n < idx.len() {
            idx.select_nth_unstable_by(n - 1, cmp);
            idx.truncate(n);
        }
        idx.sort_unstable_by(cmp);
        top = idx
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    TokenLogprob {
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_ordered_alternatives() {
        // softmax([0, ln 3]) = [1/4, 3/4]; a tie goes to the lower id.
        let l = [0.0f32, 3f32.ln(), 3f32.ln()];
        let r = logprob_of(&l, 0, 2);
        let z = 1.0 + 3.0 + 3.0;
        assert!((r.logprob - (1.0f32 / z).ln()).abs() < 1e-6);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((r.top[0].1 - (3.0f32 / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn the_reasoning_budget_is_read_from_the_generated_tokens() {
        // <think> = [1], </think> = [2], the forced close = [9, 2, 8]; budget 2.
        let b = ThinkBudget::new(2, true, vec![1], vec![2], vec![9, 2, 8]);
        assert_eq!(b.forced(&[]), None);
        assert_eq!(b.forced(&[5]), None);
        // Two tokens inside: the close is written, one token per position, then nothing.
        assert_eq!(b.forced(&[5, 6]), Some(9));
        assert_eq!(b.forced(&[5, 6, 9]), Some(2));
        assert_eq!(b.forced(&[5, 6, 9, 2]), Some(8));
        assert_eq!(b.forced(&[5, 6, 9, 2, 8]), None);
        assert_eq!(b.forced(&[5, 6, 9, 2, 8, 5, 5, 5]), None);
        // The model closed the block itself before the budget: nothing forced.
        assert_eq!(b.forced(&[5, 2, 7, 7, 7]), None);
        // A new block starts the count again.
        assert_eq!(b.forced(&[5, 2, 1, 7]), None);
        assert_eq!(b.forced(&[5, 2, 1, 7, 7]), Some(9));
        // Budget 0 with the block open: the close at once; not open: nothing.
        let zero = ThinkBudget::new(0, true, vec![1], vec![2], vec![9, 2, 8]);
        assert_eq!(zero.forced(&[]), Some(9));
        assert_eq!(zero.forced(&[9, 2]), Some(8));
        let shut = ThinkBudget::new(0, false, vec![1], vec![2], vec![9, 2, 8]);
        assert_eq!(shut.forced(&[4, 4]), None);
    }

    #[test]
    fn a_grammar_after_reasoning_reads_what_follows_the_block() {
        let a = GrammarAfter {
            end: vec![2],
            close: vec![9, 2, 8],
        };
        assert_eq!(grammar_part(None, &[5, 6]), Some(&[5u32, 6][..]));
        assert_eq!(grammar_part(Some(&a), &[5, 6]), None);
        assert_eq!(grammar_part(Some(&a), &[5, 2, 7]), Some(&[7u32][..]));
        assert_eq!(grammar_part(Some(&a), &[5, 9, 2, 8, 7]), Some(&[7u32][..]));
        assert_eq!(grammar_part(Some(&a), &[5, 2]), Some(&[][..]));
    }

    #[test]
    fn sampling_params_make_the_cli_chain() {
        let p = SamplingParams {
            temperature: 0.0,
            repeat_penalty: 1.1,
            ..Default::default()
        };
        let c = p.config().unwrap();
        assert_eq!(c.pick, Pick::Greedy);
        assert_eq!(c.stages.len(), 1, "greedy keeps only the edits: {c:?}");
        let p = SamplingParams {
            seed: Some(3),
            slop_phrases: vec!["delve".into()],
            ..Default::default()
        };
        let c = p.config().unwrap();
        assert!(matches!(&c.stages[0], Stage::Slop(s) if s.mode == 2 && s.ban == ["delve"]));
        assert_eq!(c.pick, Pick::Draw { seed: 3 });
        let bad = SamplingParams {
            top_p: -0.5,
            ..Default::default()
        };
        assert!(bad.config().is_err());
    }
}
