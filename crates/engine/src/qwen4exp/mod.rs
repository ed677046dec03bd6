//! qwen4exp (Qwen3.8-Flash-Next) inference, written once against [`Backend`]. Each function
//! below is one block of `SPEC-qwen4exp.md` and is named after it; the weights are in llama.cpp's
//! GGUF layout (norms with 1 + w folded, GDN value heads tiled, experts split, indexer split).

pub mod config;
pub mod mtp;
mod ngram;
pub mod ops;
pub mod state;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use strata_gguf::GgufFile;

use crate::backend::{Backend, DeviceBuf, StepInputs, StepKey, StepKind};
use crate::batch::{self, Split};
use crate::error::{EngineError, Result};

pub use config::{Config, LayerKind, LoadOptions, DOCUMENTED_QSA_RATIO};
use ops::{GdnParams, HcWeights, QsaIndexW, QsaPrepW, QsaRows, QsaSelect, Qwen4expOps};
use state::GdnRecord;
use state::{AttnCache, LayerState};
pub use state::{Checkpoint, ReplayLog, State};
use weights::{AttnW, Binder, GdnW, HcW, LayerW, MixerW, MoeW, PleW, Weights};

/// What a forward call returns besides the logits.
#[derive(Clone, Copy, Debug, Default)]
pub struct Want {
    /// The multi-stream residual after every layer (`layer_out.{i}` in the goldens).
    pub layer_out: bool,
    /// The pre-mixer residual after the last layer (the MTP head's input).
    pub hidden: bool,
    /// Logits of the last token only.
    pub last_only: bool,
}

/// Host copies of a forward call's results, row-major.
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    /// `[rows, n_vocab]` (rows = tokens, or 1 with `Want::last_only`).
    pub logits: Vec<f32>,
    pub n_vocab: usize,
    /// Per layer, `[tokens, S·H]`.
    pub layer_out: Vec<Vec<f32>>,
    /// `[tokens, S·H]`.
    pub hidden: Option<Vec<f32>>,
}

impl Outputs {
    pub fn rows(&self) -> usize {
        self.logits.len().checked_div(self.n_vocab).unwrap_or(0)
    }

    /// Logits of row `r`, if there is one.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        self.logits.get(r * self.n_vocab..(r + 1) * self.n_vocab)
    }
}

pub struct Model<B: Backend> {
    backend: B,
    config: Config,
    weights: Weights<B::Weight>,
    warnings: Vec<String>,
    file: Arc<GgufFile>,
    /// The MTP draft head, when one is attached (from the model file or a separate GGUF).
    mtp: Option<mtp::MtpHead<B::Weight>>,
}

/// A block's MoE output `y` and its combine's inject gains, not yet added to the streams: the
/// next block's mix adds them (`hc_combine_mix`, which a GPU fuses into the mix's norm).
struct Carry<B: Backend> {
    y: B::Buf,
    inj: B::Buf,
}

/// A QSA layer's per-row projections that go into its cache.
struct QsaKeys<B: Backend> {
    k: B::Buf,
    v: B::Buf,
    kraw: Option<B::Buf>,
}

/// The step inputs of a layer call's rows (token ids, positions, the blocks they complete) and
/// the RoPE base they rotate with (the MTP layer may have its own).
pub(crate) struct At<'a, B: Backend> {
    pub inputs: &'a StepInputs<B>,
    pub theta: f32,
}

impl<B: Backend> Clone for At<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for At<'_, B> {}

/// The rows of a layer call: their step inputs ([`At`]) and how they split into sequences
/// (`crate::batch`; one sequence for a solo pass). Row-parallel work runs over all of them,
/// the work on a sequence's own state over its part ([`Rows::each`]).
pub(crate) struct Rows<'a, B: Backend> {
    pub at: At<'a, B>,
    pub split: &'a Split<B>,
}

impl<B: Backend> Clone for Rows<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Rows<'_, B> {}

impl<B: Backend> Rows<'_, B> {
    /// `f` over each sequence's rows of `xs`, with that sequence's inputs; results joined.
    fn each(
        &self,
        b: &B,
        xs: Vec<B::Buf>,
        mut f: impl FnMut(usize, At<'_, B>, Vec<B::Buf>) -> Result<B::Buf>,
    ) -> Result<B::Buf> {
        let theta = self.at.theta;
        self.split.each(b, self.at.inputs, xs, |i, inputs, parts| {
            f(i, At { inputs, theta }, parts)
        })
    }
}

/// One sequence's rows in [`Model::forward_batch`]: its tokens continue `state`.
pub struct BatchItem<'a, B: Backend> {
    pub state: &'a mut State<B>,
    pub tokens: &'a [u32],
    /// Logits of the last token only (a prefill chunk); else of every token.
    pub last_only: bool,
    /// A speculative verify window's replay log: the inputs of every recurrent update of these
    /// rows are kept in it, so that the window can later keep only a prefix of them
    /// ([`Model::rollback_window`], `crate::speculative`).
    pub log: Option<&'a mut ReplayLog<B>>,
    /// Return the rows' pre-mixer residual too (the MTP head's input).
    pub hidden: bool,
}

impl<'a, B: Backend> BatchItem<'a, B> {
    /// A sequence's plain rows (a decode token, a prefill chunk): no replay log, no hidden rows.
    pub fn rows(state: &'a mut State<B>, tokens: &'a [u32], last_only: bool) -> Self {
        BatchItem {
            state,
            tokens,
            last_only,
            log: None,
            hidden: false,
        }
    }
}

/// One item's results of [`Model::forward_batch_dev`], still on the device.
pub struct BatchOut<B: Backend> {
    /// `[rows, n_vocab]`: every row's logits, or the last row's with `last_only`.
    pub logits: B::Buf,
    /// `[tokens, S·H]`, the pre-mixer residual (with [`BatchItem::hidden`]).
    pub hidden: Option<B::Buf>,
}

/// Bits of [`StepKey::outputs`] for the trunk's forward.
const OUT_LOGITS_ALL: u32 = 1;
const OUT_HIDDEN: u32 = 2;
const OUT_LAYERS: u32 = 4;
const OUT_LOGGED: u32 = 8;
/// Several sequences' rows (`crate::batch`); the key's `seq` names the batch's composition.
const OUT_BATCH: u32 = 16;

/// A forward pass's results still on the device.
pub(crate) struct DevOutputs<B: Backend> {
    /// `[rows, n_vocab]` (rows = tokens, or 1 with `Want::last_only`).
    pub logits: B::Buf,
    /// `[tokens, S·H]`, the pre-mixer residual (with `Want::hidden`).
    pub hidden: Option<B::Buf>,
    pub layer_out: Vec<Vec<f32>>,
}

impl<B: Qwen4expOps> Model<B> {
    /// Opens a qwen4exp GGUF and binds every tensor on `backend`.
    pub fn load(path: impl AsRef<Path>, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        let file = Arc::new(GgufFile::open(path)?);
        Self::from_file(file, backend, opts)
    }

    /// As [`Model::load`], from a file already open (or built in memory).
    pub fn from_file(file: Arc<GgufFile>, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        let arch = file.architecture()?;
        if arch != config::ARCH {
            return Err(EngineError::UnsupportedArch {
                file: file.name().to_string(),
                found: arch.to_string(),
                expected: config::ARCH.to_string(),
            });
        }
        let n_embd = file.get_u32(&format!("{}.embedding_length", config::ARCH))? as usize;
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| EngineError::MissingTensor {
                file: file.name().to_string(),
                tensor: "token_embd.weight".to_string(),
                expected: format!("shape [{n_embd}, n_vocab]"),
            })?;
        if embd.dims.len() != 2 || embd.ne(0) != n_embd as u64 {
            return Err(EngineError::TensorShape {
                file: file.name().to_string(),
                tensor: embd.name.clone(),
                found: embd.dims.clone(),
                expected: vec![n_embd as u64, embd.ne(1)],
            });
        }
        let n_vocab = embd.ne(1) as usize;
        let mut config = Config::from_gguf(&file, n_vocab, opts)?;
        let weights = Binder {
            file: &file,
            backend: &backend,
        }
        .weights(&config)?;
        let mut warnings = Vec::new();
        resolve_qsa_ratios(&mut config, &weights, opts, file.name(), &mut warnings)?;
        let mut model = Model {
            backend,
            config,
            weights,
            warnings,
            file: Arc::clone(&file),
            mtp: None,
        };
        // A file that carries the head (`mtp.*` tensors) gets it attached at once.
        if mtp::file_has_head(&file) {
            model.attach_mtp(file)?;
        }
        Ok(model)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The bound weights (the parity harness runs the family operations on them).
    pub fn weights(&self) -> &Weights<B::Weight> {
        &self.weights
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Things about the file worth telling the user (e.g. a converter fault worked around).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// A fresh sequence state (position 0).
    pub fn new_state(&self) -> Result<State<B>> {
        let b = &self.backend;
        let c = &self.config;
        let g = c.gdn;
        let mut layers = Vec::with_capacity(c.n_layer);
        for kind in &c.layers {
            layers.push(match kind {
                LayerKind::Gdn => LayerState::Gdn {
                    conv: b.zeros(g.conv_kernel - 1, g.conv_dim())?,
                    s: b.zeros(g.n_v_heads, g.head_k * g.head_v)?,
                },
                LayerKind::Attention { .. } => {
                    let kv = c.attn.n_head_kv * c.attn.head_dim;
                    LayerState::Attn(AttnCache::new(b, c.n_ctx, kv, c.indexer.head_dim)?)
                }
            });
        }
        let ple_conv = match &c.ple {
            Some(p) => Some(b.zeros(p.history(), c.residual_dim())?),
            None => None,
        };
        Ok(State {
            id: crate::backend::sequence_id(),
            pos: 0,
            tokens: Vec::new(),
            layers,
            ple_conv,
        })
    }

    /// Copies of the recurrent states, to roll `st` back to this point later.
    pub fn checkpoint(&self, st: &State<B>) -> Result<Checkpoint<B>> {
        let b = &self.backend;
        let recurrent = st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn { conv, s } => Ok(Some((b.copy(conv)?, b.copy(s)?))),
                LayerState::Attn(_) => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let ple_conv = st.ple_conv.as_ref().map(|p| b.copy(p)).transpose()?;
        Ok(Checkpoint {
            pos: st.pos,
            recurrent,
            ple_conv,
        })
    }

    /// Fills a checkpoint made earlier for this state's model (its buffers are reused: a
    /// speculative decoder keeps one for its whole run, so a verify window allocates none).
    pub fn checkpoint_into(&self, st: &State<B>, cp: &mut Checkpoint<B>) -> Result<()> {
        let b = &self.backend;
        if cp.recurrent.len() != st.layers.len() {
            return Err(EngineError::Input(
                "checkpoint layers do not match the state".to_string(),
            ));
        }
        for (layer, saved) in st.layers.iter().zip(cp.recurrent.iter_mut()) {
            match (layer, saved) {
                (LayerState::Gdn { conv, s }, Some((c0, s0))) => {
                    b.copy_into(c0, conv)?;
                    b.copy_into(s0, s)?;
                }
                (LayerState::Attn(_), None) => {}
                _ => {
                    return Err(EngineError::Input(
                        "checkpoint layers do not match the state".to_string(),
                    ))
                }
            }
        }
        if let (Some(p0), Some(p)) = (cp.ple_conv.as_mut(), st.ple_conv.as_ref()) {
            b.copy_into(p0, p)?;
        }
        cp.pos = st.pos;
        Ok(())
    }

    /// Rolls `st` back to `cp` (taken from this state, at or before its position): caches are
    /// cut back by length, recurrent states restored.
    pub fn restore(&self, st: &mut State<B>, cp: &Checkpoint<B>) -> Result<()> {
        if cp.pos > st.pos || cp.recurrent.len() != st.layers.len() {
            return Err(EngineError::Input(format!(
                "checkpoint at position {} does not belong to this state (position {})",
                cp.pos, st.pos
            )));
        }
        let b = &self.backend;
        for ((layer, saved), kind) in st
            .layers
            .iter_mut()
            .zip(&cp.recurrent)
            .zip(&self.config.layers)
        {
            match (layer, saved) {
                (LayerState::Gdn { conv, s }, Some((c0, s0))) => {
                    b.copy_into(conv, c0)?;
                    b.copy_into(s, s0)?;
                }
                (LayerState::Attn(cache), None) => {
                    let ratio = match kind {
                        LayerKind::Attention { ratio } => *ratio,
                        LayerKind::Gdn => None,
                    };
                    cache.set_len(cp.pos, ratio)?;
                }
                _ => {
                    return Err(EngineError::Input(
                        "checkpoint layers do not match the state".to_string(),
                    ));
                }
            }
        }
        if let (Some(p), Some(p0)) = (st.ple_conv.as_mut(), cp.ple_conv.as_ref()) {
            b.copy_into(p, p0)?;
        }
        st.pos = cp.pos;
        st.tokens.truncate(cp.pos);
        Ok(())
    }

    /// Keeps the first `keep` tokens of the window that the last [`Model::forward_dev`] call
    /// (logged into `log`, from checkpoint `cp`) ran: attention caches are truncated, and the
    /// recurrent states restored and advanced over the kept rows from the logged inputs. The
    /// result is bit for bit the state of decoding the kept tokens one at a time.
    pub(crate) fn rollback_window(
        &self,
        st: &mut State<B>,
        cp: &Checkpoint<B>,
        log: ReplayLog<B>,
        keep: usize,
    ) -> Result<()> {
        let window = st.pos.checked_sub(cp.pos).ok_or_else(|| {
            EngineError::Input(format!(
                "checkpoint at position {} is ahead of the state (position {})",
                cp.pos, st.pos
            ))
        })?;
        if keep > window || cp.recurrent.len() != st.layers.len() {
            return Err(EngineError::Input(format!(
                "cannot keep {keep} of a window of {window} tokens"
            )));
        }
        if keep == window {
            return Ok(());
        }
        let key = StepKey {
            kind: StepKind::Replay,
            rows: keep,
            outputs: 0,
            seq: st.id,
        };
        self.backend
            .step(key, || self.rollback_body(st, cp, log, keep))
    }

    /// The body of [`Model::rollback_window`] (arguments checked), inside the backend's pool.
    fn rollback_body(
        &self,
        st: &mut State<B>,
        cp: &Checkpoint<B>,
        log: ReplayLog<B>,
        keep: usize,
    ) -> Result<()> {
        let b = &self.backend;
        let new_pos = cp.pos + keep;
        let mut gdn_log = log.gdn;
        gdn_log.resize_with(st.layers.len(), || None);
        for (l, ((layer, saved), rec)) in st
            .layers
            .iter_mut()
            .zip(&cp.recurrent)
            .zip(gdn_log)
            .enumerate()
        {
            match (layer, saved, &self.weights.layers[l].mixer) {
                (LayerState::Gdn { conv, s }, Some((c0, s0)), MixerW::Gdn(gw)) => {
                    b.copy_into(conv, c0)?;
                    b.copy_into(s, s0)?;
                    if keep == 0 {
                        continue;
                    }
                    let Some(mut r) = rec else {
                        return Err(EngineError::Input(format!(
                            "layer {l}: the window was run without a replay log"
                        )));
                    };
                    for buf in [&mut r.raw, &mut r.qkv, &mut r.z, &mut r.alpha, &mut r.beta] {
                        b.truncate_rows(buf, keep)?;
                    }
                    b.conv1d_silu(&r.raw, &gw.conv, conv, 1)?;
                    b.gdn_step(&self.gdn_params(gw), &r.qkv, &r.z, &r.alpha, &r.beta, s)?;
                }
                (LayerState::Attn(cache), None, _) => {
                    let ratio = match &self.config.layers[l] {
                        LayerKind::Attention { ratio } => *ratio,
                        LayerKind::Gdn => None,
                    };
                    cache.set_len(new_pos, ratio)?;
                }
                _ => {
                    return Err(EngineError::Input(
                        "checkpoint layers do not match the state".to_string(),
                    ))
                }
            }
        }
        if let (Some(p), Some(p0)) = (st.ple_conv.as_mut(), cp.ple_conv.as_ref()) {
            b.copy_into(p, p0)?;
            if keep > 0 {
                let (Some(mut cn), Some(pc), Some(pw)) = (
                    log.ple,
                    self.config.ple.as_ref(),
                    self.weights.layers.iter().find_map(|lw| lw.ple.as_ref()),
                ) else {
                    return Err(EngineError::Input(
                        "the window was run without a PLE replay log".to_string(),
                    ));
                };
                b.truncate_rows(&mut cn, keep)?;
                b.conv1d_silu(&cn, &pw.conv, p, pc.ngram_size)?;
            }
        }
        st.pos = new_pos;
        st.tokens.truncate(new_pos);
        Ok(())
    }

    /// Every buffer of a sequence state, downloaded and named (for bit-for-bit comparisons of
    /// two states): per layer the caches or recurrent states, the PLE history, and the tokens.
    pub fn state_buffers(&self, st: &State<B>) -> Result<Vec<(String, Vec<f32>)>> {
        let b = &self.backend;
        let mut out = Vec::new();
        for (l, layer) in st.layers.iter().enumerate() {
            match layer {
                LayerState::Gdn { conv, s } => {
                    out.push((format!("blk.{l}.conv"), b.download(conv)?));
                    out.push((format!("blk.{l}.ssm"), b.download(s)?));
                }
                LayerState::Attn(c) => out.extend(cache_buffers(b, &format!("blk.{l}"), c)?),
            }
        }
        if let Some(p) = &st.ple_conv {
            out.push(("ple.conv".to_string(), b.download(p)?));
        }
        out.push((
            "tokens".to_string(),
            st.tokens.iter().map(|&t| t as f32).collect(),
        ));
        Ok(out)
    }

    /// Logits of every token of `tokens`, continuing `st` (prefill when many, decode when one).
    pub fn forward(&self, st: &mut State<B>, tokens: &[u32]) -> Result<Outputs> {
        self.forward_with(st, tokens, Want::default())
    }

    /// The forward pass (spec §3). Every operation works row by row, so N tokens in one call give
    /// the same bits as N calls of one token. On error the state is left part-way; restore a
    /// checkpoint before using it again.
    pub fn forward_with(&self, st: &mut State<B>, tokens: &[u32], want: Want) -> Result<Outputs> {
        let b = &self.backend;
        let out = self.forward_dev(st, tokens, want, None)?;
        Ok(Outputs {
            logits: b.download(&out.logits)?,
            n_vocab: self.config.n_vocab,
            layer_out: out.layer_out,
            hidden: out.hidden.as_ref().map(|h| b.download(h)).transpose()?,
        })
    }

    /// Several sequences' rows in one forward pass (`crate::batch`): each item's tokens
    /// continue its state, and its logits (of every row, or of the last with `last_only`) and
    /// hidden rows (when asked) are the bits of [`Model::forward_with`] on that sequence alone.
    /// Every item is checked before the step runs; on an error inside the step the states are
    /// left part-way.
    pub fn forward_batch(&self, items: &mut [BatchItem<'_, B>]) -> Result<Vec<Outputs>> {
        let b = &self.backend;
        self.forward_batch_dev(items)?
            .into_iter()
            .map(|o| {
                Ok(Outputs {
                    logits: b.download(&o.logits)?,
                    n_vocab: self.config.n_vocab,
                    layer_out: Vec::new(),
                    hidden: o.hidden.as_ref().map(|h| b.download(h)).transpose()?,
                })
            })
            .collect()
    }

    /// [`Model::forward_batch`] with the results left on the device, one [`BatchOut`] per item;
    /// an item with a replay log (a speculative verify window) has it filled as
    /// [`Model::forward_dev`] fills it for the sequence alone.
    pub fn forward_batch_dev(&self, items: &mut [BatchItem<'_, B>]) -> Result<Vec<BatchOut<B>>> {
        let b = &self.backend;
        let c = &self.config;
        for it in items.iter() {
            self.check_tokens(it.tokens)?;
            self.check_room(it.state, it.state.pos + it.tokens.len())?;
        }
        if items.len() == 1 || !b.batches_sequences() {
            // One sequence, or a backend that steps sequences apart: each its own step.
            return items
                .iter_mut()
                .map(|it| {
                    let want = Want {
                        last_only: it.last_only,
                        hidden: it.hidden,
                        ..Want::default()
                    };
                    let out = self.forward_dev(it.state, it.tokens, want, it.log.as_deref_mut())?;
                    Ok(BatchOut {
                        logits: out.logits,
                        hidden: out.hidden,
                    })
                })
                .collect();
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut ple_ids = c.ple.as_ref().map(|_| Vec::new());
        let mut parts = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            tokens.extend_from_slice(it.tokens);
            positions.extend(it.state.pos..it.state.pos + it.tokens.len());
            if let (Some(p), Some(ids)) = (&c.ple, ple_ids.as_mut()) {
                ids.extend(ngram::row_ids(p, &it.state.tokens, it.tokens)?);
            }
            if let Some(log) = it.log.as_deref_mut() {
                log.reset(c.n_layer);
            }
            let wants = (it.last_only as u32)
                | ((it.hidden as u32) * OUT_HIDDEN)
                | ((it.log.is_some() as u32) * OUT_LOGGED);
            parts.push((it.state.id, it.tokens.len(), wants));
        }
        let lens: Vec<usize> = items.iter().map(|it| it.tokens.len()).collect();
        let lasts: Vec<bool> = items.iter().map(|it| it.last_only).collect();
        let out_lens: Vec<usize> = items
            .iter()
            .map(|it| if it.last_only { 1 } else { it.tokens.len() })
            .collect();
        let hidden: Vec<bool> = items.iter().map(|it| it.hidden).collect();
        let want = Want {
            hidden: hidden.contains(&true),
            ..Want::default()
        };
        let ratios = self.qsa_ratios();
        let key = StepKey {
            kind: StepKind::Forward,
            rows: tokens.len(),
            outputs: OUT_BATCH
                | ((want.hidden as u32) * OUT_HIDDEN)
                | ((items.iter().any(|it| it.log.is_some()) as u32) * OUT_LOGGED),
            seq: batch::batch_key(&parts),
        };
        let outs = b.step(key, || {
            let inputs = StepInputs::at_positions(b, &tokens, &positions, &ratios)?;
            let split = Split::new(b, &inputs, &lens, &lasts)?;
            let ple_rows = ple_ids.as_ref().map(|r| b.upload_ids(r)).transpose()?;
            let (mut sts, mut logs): (Vec<&mut State<B>>, Vec<Option<&mut ReplayLog<B>>>) = items
                .iter_mut()
                .map(|it| (&mut *it.state, it.log.as_deref_mut()))
                .unzip();
            let rows = Rows {
                at: At {
                    inputs: &inputs,
                    theta: c.rope_theta,
                },
                split: &split,
            };
            let out = self.layers_and_head(&mut sts, rows, ple_rows.as_ref(), want, &mut logs)?;
            // Each sequence's rows of the results.
            let logits = b.split_rows(out.logits, &out_lens)?;
            let mut rows_of = match out.hidden {
                Some(h) => {
                    let h = b.reshape(h, tokens.len(), c.residual_dim())?;
                    b.split_rows(h, &lens)?.into_iter().map(Some).collect()
                }
                None => Vec::new(),
            };
            rows_of.resize_with(lens.len(), || None);
            Ok(logits
                .into_iter()
                .zip(rows_of)
                .zip(&hidden)
                .map(|((logits, h), &want)| BatchOut {
                    logits,
                    hidden: h.filter(|_| want),
                })
                .collect::<Vec<_>>())
        })?;
        for it in items.iter_mut() {
            self.advance(it.state, it.tokens)?;
        }
        Ok(outs)
    }

    /// Refuses an empty call or a token outside the vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(EngineError::Input("forward: no tokens".to_string()));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(EngineError::Input(format!(
                "token id {t} is out of range (vocabulary {})",
                c.n_vocab
            )));
        }
        Ok(())
    }

    /// After a step over `tokens`: the caches hold them, the state is past them.
    fn advance(&self, st: &mut State<B>, tokens: &[u32]) -> Result<()> {
        let end = st.pos + tokens.len();
        for (layer, kind) in st.layers.iter_mut().zip(&self.config.layers) {
            if let (LayerState::Attn(cache), LayerKind::Attention { ratio }) = (layer, kind) {
                cache.set_len(end, *ratio)?;
            }
        }
        st.pos = end;
        st.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// [`Model::forward_with`] with the results left on the device; with `log`, the inputs of
    /// every recurrent update are kept so that [`Model::rollback_window`] can later keep only a
    /// prefix of these tokens.
    pub(crate) fn forward_dev(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        want: Want,
        mut log: Option<&mut ReplayLog<B>>,
    ) -> Result<DevOutputs<B>> {
        let b = &self.backend;
        let c = &self.config;
        self.check_tokens(tokens)?;
        let n = tokens.len();
        let end = st.pos + n;
        self.check_room(st, end)?;
        // The step's inputs (ids, positions, the blocks they complete, n-gram rows), computed
        // on the host and uploaded once, inside the step.
        let ratios = self.qsa_ratios();
        let ple_ids = match &c.ple {
            Some(p) => Some(ngram::row_ids(p, &st.tokens, tokens)?),
            None => None,
        };
        let start = st.pos;

        if let Some(log) = log.as_deref_mut() {
            log.reset(c.n_layer);
        }
        let key = StepKey {
            kind: StepKind::Forward,
            rows: n,
            outputs: ((!want.last_only as u32) * OUT_LOGITS_ALL)
                | ((want.hidden as u32) * OUT_HIDDEN)
                | ((want.layer_out as u32) * OUT_LAYERS)
                | ((log.is_some() as u32) * OUT_LOGGED),
            seq: st.id,
        };
        let out = b.step(key, || {
            let inputs = StepInputs::new(b, tokens, start, &ratios)?;
            let ple_rows = ple_ids.as_ref().map(|r| b.upload_ids(r)).transpose()?;
            let one = Split::one();
            let rows = Rows {
                at: At {
                    inputs: &inputs,
                    theta: c.rope_theta,
                },
                split: &one,
            };
            self.layers_and_head(&mut [&mut *st], rows, ple_rows.as_ref(), want, &mut [log])
        })?;
        self.advance(st, tokens)?;
        Ok(out)
    }

    /// The QSA block sizes of the trunk's layers (the step inputs carry their blocks).
    fn qsa_ratios(&self) -> Vec<usize> {
        let mut rs: Vec<usize> = self
            .config
            .layers
            .iter()
            .filter_map(|k| match k {
                LayerKind::Attention { ratio } => *ratio,
                LayerKind::Gdn => None,
            })
            .collect();
        rs.sort_unstable();
        rs.dedup();
        rs
    }

    /// Refuses, before the step, one that would end past the caches' capacity.
    fn check_room(&self, st: &State<B>, end: usize) -> Result<()> {
        for layer in &st.layers {
            if let LayerState::Attn(cache) = layer {
                cache.check_room(end)?;
            }
        }
        if end > self.config.n_ctx {
            return Err(EngineError::ContextFull {
                what: "the sequence",
                needed: end,
                capacity: self.config.n_ctx,
            });
        }
        Ok(())
    }

    /// The body of [`Model::forward_dev`] and [`Model::forward_batch`]: every layer over the
    /// rows of the sequences `sts` (one, or a batch split by `rows.split`), then the mixer and
    /// LM head over the rows whose logits are wanted.
    fn layers_and_head(
        &self,
        sts: &mut [&mut State<B>],
        rows: Rows<'_, B>,
        ple_rows: Option<&B::Ids>,
        want: Want,
        logs: &mut [Option<&mut ReplayLog<B>>],
    ) -> Result<DevOutputs<B>> {
        let b = &self.backend;
        let c = &self.config;
        let w = &self.weights;
        let inputs = rows.at.inputs;
        let n = inputs.rows();
        // X_t = [E[x_t]; …; E[x_t]]: the streams start as copies of the embedding.
        let mut x = b.embed_rows(&w.token_embd, &inputs.tokens, c.hc_streams)?;
        let mut layer_out = Vec::new();
        let last_layer = w.layers.len().saturating_sub(1);
        // Only the last row's output is read after the last layer when nothing but the last
        // logits is wanted: if that layer is an attention layer, the rows before the last only
        // leave their keys in its cache (the same bits as the full pass).
        let last_row_only = rows.split.is_one()
            && want.last_only
            && n > 1
            && !want.hidden
            && !want.layer_out
            && logs.iter().all(Option::is_none)
            && matches!(c.layers.get(last_layer), Some(LayerKind::Attention { .. }));
        // The last block's output, added to the streams by the next mix.
        let mut carry: Option<Carry<B>> = None;
        for (l, lw) in w.layers.iter().enumerate() {
            if let (Some(pw), Some(ids)) = (&lw.ple, ple_rows) {
                self.settle(&mut x, carry.take())?;
                let mut hists: Vec<Option<&mut B::Buf>> =
                    sts.iter_mut().map(|s| s.ple_conv.as_mut()).collect();
                let mut recs: Vec<Option<&mut Option<B::Buf>>> = logs
                    .iter_mut()
                    .map(|g| g.as_deref_mut().map(|g| &mut g.ple))
                    .collect();
                self.ple_block(pw, ids, &mut x, rows, &mut hists, &mut recs)?;
            }
            if last_row_only && l == last_layer {
                self.settle(&mut x, carry.take())?;
                let xr = b.reshape(x, n, c.residual_dim())?;
                x = self.attention_layer_last_row(
                    &c.layers[l],
                    lw,
                    xr,
                    rows.at,
                    &mut sts[0].layers[l],
                )?;
                continue;
            }
            let mut layer: Vec<&mut LayerState<B>> =
                sts.iter_mut().map(|s| &mut s.layers[l]).collect();
            let mut recs: Vec<Option<&mut Option<GdnRecord<B>>>> = logs
                .iter_mut()
                .map(|g| g.as_deref_mut().and_then(|g| g.gdn.get_mut(l)))
                .collect();
            carry = Some(self.decoder_block_open(
                &c.layers[l],
                lw,
                &mut x,
                carry.take(),
                rows,
                &mut layer,
                &mut recs,
            )?);
            // The device may start on the layers recorded so far while the host goes on.
            b.submit_part()?;
            if want.layer_out {
                self.settle(&mut x, carry.take())?;
                layer_out.push(b.download(&x)?);
            }
        }
        if want.hidden || !rows.split.is_one() {
            self.settle(&mut x, carry.take())?;
        }
        let hidden = if want.hidden { Some(b.copy(&x)?) } else { None };
        if !rows.split.is_one() {
            // A batch: each sequence's last row, or all its rows.
            x = b.reshape(x, n, c.residual_dim())?;
            x = rows.split.output_rows(b, x)?;
        } else if want.last_only && !last_row_only {
            x = b.reshape(x, n, c.residual_dim())?;
            x = b.last_row(x)?;
            carry = carry
                .map(|k| -> Result<Carry<B>> {
                    Ok(Carry {
                        y: b.last_row(k.y)?,
                        inj: b.last_row(k.inj)?,
                    })
                })
                .transpose()?;
        }
        let logits = self.lm_head(&mut x, carry)?;
        Ok(DevOutputs {
            logits,
            hidden,
            layer_out,
        })
    }

    /// One decoder layer over one sequence's rows (the MTP head's layer, a last-row pass).
    pub(crate) fn decoder_layer(
        &self,
        kind: &LayerKind,
        lw: &LayerW<B::Weight>,
        x: &mut B::Buf,
        at: At<'_, B>,
        st: &mut LayerState<B>,
        rec: Option<&mut Option<GdnRecord<B>>>,
    ) -> Result<()> {
        let one = Split::one();
        let rows = Rows { at, split: &one };
        self.decoder_block(kind, lw, x, rows, &mut [st], &mut [rec])
    }

    /// One decoder layer: token mixer and MoE, each behind a hyper-connection mix and combine.
    /// `sts` (and `recs`) hold each sequence's state of this layer.
    fn decoder_block(
        &self,
        kind: &LayerKind,
        lw: &LayerW<B::Weight>,
        x: &mut B::Buf,
        rows: Rows<'_, B>,
        sts: &mut [&mut LayerState<B>],
        recs: &mut [Option<&mut Option<GdnRecord<B>>>],
    ) -> Result<()> {
        let out = self.decoder_block_open(kind, lw, x, None, rows, sts, recs)?;
        self.settle(x, Some(out))
    }

    /// [`Self::decoder_block`] with the combines at its edges left to the mixes beside them:
    /// `carry` (the block before's output) is added to the streams by this block's first mix,
    /// and this block's MoE output is returned for the next mix to add.
    #[allow(clippy::too_many_arguments)]
    fn decoder_block_open(
        &self,
        kind: &LayerKind,
        lw: &LayerW<B::Weight>,
        x: &mut B::Buf,
        carry: Option<Carry<B>>,
        rows: Rows<'_, B>,
        sts: &mut [&mut LayerState<B>],
        recs: &mut [Option<&mut Option<GdnRecord<B>>>],
    ) -> Result<Carry<B>> {
        let (u, inj) = self.carry_mix(&lw.hc_attn, x, carry)?;
        let y = match (&lw.mixer, kind) {
            (MixerW::Gdn(gw), _) => self.gated_deltanet(gw, &u, rows, sts, recs)?,
            (MixerW::Attn(aw), LayerKind::Attention { ratio }) => {
                self.qsa_attention(aw, &u, rows, sts, *ratio)?
            }
            _ => {
                return Err(EngineError::Input(
                    "a layer's state does not match the model".to_string(),
                ))
            }
        };
        let (u, inj) = self.hc_combine_mix(x, &y, inj.as_ref(), &lw.hc_ffn)?;
        let y = self.moe(&lw.moe, &u)?;
        let inj =
            inj.ok_or_else(|| EngineError::shape("hc_combine", "mix without inject weights"))?;
        Ok(Carry { y, inj })
    }

    /// Adds a block's output still carried (if any) to the streams: `X_s += inj_s · y`.
    fn settle(&self, x: &mut B::Buf, carry: Option<Carry<B>>) -> Result<()> {
        match carry {
            Some(k) => self.hc_combine(x, &k.y, Some(&k.inj)),
            None => Ok(()),
        }
    }

    /// `hc`'s mix of the streams, after adding the carried block output (one backend operation,
    /// the combine fused into the mix's norm).
    fn carry_mix(
        &self,
        hc: &HcW<B::Weight>,
        x: &mut B::Buf,
        carry: Option<Carry<B>>,
    ) -> Result<(B::Buf, Option<B::Buf>)> {
        match carry {
            Some(k) => self
                .backend
                .hc_combine_mix(x, &k.y, Some(&k.inj), &self.hc_weights(hc)),
            None => self.hc_mix(hc, x),
        }
    }

    // ---- §4 hyper-connections

    /// A hyper-connection module's weights as the family operations take them.
    pub fn hc_weights<'w>(&self, hc: &'w HcW<B::Weight>) -> HcWeights<'w, B::Weight> {
        HcWeights {
            norm: &hc.norm,
            down: &hc.down,
            up: &hc.up,
            inject: hc.inject.as_ref(),
            streams: self.config.hc_streams,
            eps: self.config.eps,
        }
    }

    fn hc_mix(&self, hc: &HcW<B::Weight>, x: &B::Buf) -> Result<(B::Buf, Option<B::Buf>)> {
        self.backend.hc_mix(&self.hc_weights(hc), x)
    }

    /// The token mixer's combine, then the MoE's mix (one backend operation: a GPU fuses the
    /// combine into the mix's norm).
    fn hc_combine_mix(
        &self,
        x: &mut B::Buf,
        y: &B::Buf,
        inj: Option<&B::Buf>,
        hc: &HcW<B::Weight>,
    ) -> Result<(B::Buf, Option<B::Buf>)> {
        let inj =
            inj.ok_or_else(|| EngineError::shape("hc_combine", "mix without inject weights"))?;
        self.backend
            .hc_combine_mix(x, y, Some(inj), &self.hc_weights(hc))
    }

    fn hc_combine(&self, x: &mut B::Buf, y: &B::Buf, inj: Option<&B::Buf>) -> Result<()> {
        let inj =
            inj.ok_or_else(|| EngineError::shape("hc_combine", "mix without inject weights"))?;
        self.backend.hc_combine(x, y, Some(inj))
    }

    // ---- §5 PLE

    /// `X += G + silu(conv(RMSg(G)))`, `G_s = γ_s·V`, `γ_s` from the key/query agreement; the
    /// conv over each sequence's rows continues its own history (`hists`).
    fn ple_block(
        &self,
        pw: &PleW<B::Weight>,
        ids: &B::Ids,
        x: &mut B::Buf,
        rows: Rows<'_, B>,
        hists: &mut [Option<&mut B::Buf>],
        recs: &mut [Option<&mut Option<B::Buf>>],
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        let (Some(pc), Some(table)) = (&c.ple, &self.weights.ple_table) else {
            return Err(EngineError::shape(
                "ple",
                "PLE layer without its table or state",
            ));
        };
        let (h, eps) = (c.n_embd, c.eps);
        let n = x.rows();
        // e_t = concat_j T[id_j]
        let e = b.embed_rows(table, ids, 1)?;
        let e = b.reshape(e, n, pc.embed_dim())?;
        let [k, v] = b.matmuls([&pw.key, &pw.value], &e)?;
        let k = b.rms_norm(&k, &pw.norm_key, h, eps)?;
        let q = b.rms_norm(x, &pw.norm_query, h, eps)?;
        let mut g = b.ple_gate(&k, &q, &v, c.hc_streams)?;
        let cn = b.rms_norm(&g, &pw.norm_conv, h, eps)?;
        let conv = rows.each(b, vec![cn], |i, _, mut parts| {
            let (Some(cn), Some(Some(hist))) = (parts.pop(), hists.get_mut(i)) else {
                return Err(EngineError::shape(
                    "ple",
                    "PLE layer without its table or state",
                ));
            };
            let conv = b.conv1d_silu(&cn, &pw.conv, hist, pc.ngram_size)?;
            if let Some(Some(rec)) = recs.get_mut(i) {
                **rec = Some(cn);
            }
            Ok(conv)
        })?;
        b.add_assign(&mut g, &conv)?;
        b.add_assign(x, &g)
    }

    // ---- §6 Gated DeltaNet

    /// The projections over every row; the conv and the recurrence over each sequence's rows
    /// from its own state.
    fn gated_deltanet(
        &self,
        gw: &GdnW<B::Weight>,
        u: &B::Buf,
        rows: Rows<'_, B>,
        sts: &mut [&mut LayerState<B>],
        recs: &mut [Option<&mut Option<GdnRecord<B>>>],
    ) -> Result<B::Buf> {
        let b = &self.backend;
        let [raw, z, beta, alpha] = b.matmuls([&gw.qkv, &gw.z, &gw.beta, &gw.alpha], u)?;
        let o = rows.each(b, vec![raw, z, alpha, beta], |i, _, parts| {
            let Ok([raw, z, alpha, beta]) = <[B::Buf; 4]>::try_from(parts) else {
                return Err(EngineError::shape("gdn", "projection split"));
            };
            let Some(LayerState::Gdn { conv, s }) = sts.get_mut(i).map(|s| &mut **s) else {
                return Err(EngineError::Input(
                    "a layer's state does not match the model".to_string(),
                ));
            };
            let m = b.conv1d_silu(&raw, &gw.conv, conv, 1)?;
            let o = b.gdn_step(&self.gdn_params(gw), &m, &z, &alpha, &beta, s)?;
            if let Some(Some(rec)) = recs.get_mut(i) {
                // Everything the recurrence read, kept (not copied) for a later partial replay.
                **rec = Some(GdnRecord {
                    raw,
                    qkv: m,
                    z,
                    alpha,
                    beta,
                });
            }
            Ok(o)
        })?;
        b.matmul(&gw.out, &o)
    }

    fn gdn_params<'a>(&self, gw: &'a GdnW<B::Weight>) -> GdnParams<'a, B::Weight> {
        GdnParams {
            a: &gw.a,
            dt_bias: &gw.dt_bias,
            norm: &gw.norm,
            dims: self.config.gdn,
            eps: self.config.eps,
        }
    }

    // ---- §7 QSA attention

    /// The projections over every row; the rest (the queries' and keys' norms and RoPE at each
    /// row's position, the cache writes, the block selection, attention and its output gate)
    /// over each sequence's rows against its own cache; the output projection over every row
    /// again.
    fn qsa_attention(
        &self,
        aw: &AttnW<B::Weight>,
        u: &B::Buf,
        rows: Rows<'_, B>,
        sts: &mut [&mut LayerState<B>],
        ratio: Option<usize>,
    ) -> Result<B::Buf> {
        let b = &self.backend;
        let c = &self.config;
        let indexed = aw.indexer.as_ref().zip(ratio);
        // Every projection of `u` in one call (one quantization of `u` per activation format).
        let projected: Vec<B::Buf> = match indexed {
            Some((ix, _)) => b.matmuls([&aw.q, &aw.k, &aw.v, &ix.q, &ix.k], u)?.into(),
            None => b.matmuls([&aw.q, &aw.k, &aw.v], u)?.into(),
        };
        let a = rows.each(b, projected, |i, at, parts| {
            let mut parts = parts.into_iter();
            let (Some(qg), Some(k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(EngineError::shape("qsa", "projection split"));
            };
            let index = parts.next().zip(parts.next());
            let Some(LayerState::Attn(cache)) = sts.get_mut(i).map(|s| &mut **s) else {
                return Err(EngineError::Input(
                    "a layer's state does not match the model".to_string(),
                ));
            };
            let w = self.qsa_prep_weights(aw, at, ratio);
            let p = b.qsa_prepare(&w, QsaRows { qg, k, v, index }, at.inputs, cache.stores())?;
            let sel = match (indexed, p.qi) {
                (Some((_, ratio)), Some(qi)) => self.qsa_select(qi, at, cache, ratio)?,
                _ => b.select_causal(&at.inputs.positions)?,
            };
            b.attend_gated(
                &p.q,
                &p.gate,
                &cache.k.buf,
                &cache.v.buf,
                &sel,
                c.attn,
                c.kv_type,
            )
        })?;
        b.matmul(&aw.o, &a)
    }

    /// The norms, RoPE geometry and (when the layer selects) the indexer's of a QSA layer.
    fn qsa_prep_weights<'w>(
        &self,
        aw: &'w AttnW<B::Weight>,
        at: At<'_, B>,
        ratio: Option<usize>,
    ) -> QsaPrepW<'w, B::Weight> {
        let c = &self.config;
        QsaPrepW {
            q_norm: &aw.q_norm,
            k_norm: &aw.k_norm,
            index: aw.indexer.as_ref().zip(ratio).map(|(ix, ratio)| QsaIndexW {
                q_norm: &ix.q_norm,
                k_norm: &ix.k_norm,
                head_dim: c.indexer.head_dim,
                ratio,
            }),
            head_dim: c.attn.head_dim,
            rot: c.rot_dims,
            theta: at.theta,
            eps: c.eps,
        }
    }

    /// §7.1–7.3, the cache side alone (a cache-only pass): keys (normed, rotated) and values
    /// written at the rows' positions, raw indexer keys written and the blocks the rows
    /// complete pooled, normed, rotated at their first token and written at their slots, the
    /// composition [`Qwen4expOps::qsa_prepare`] keeps the bits of.
    fn qsa_store(
        &self,
        aw: &AttnW<B::Weight>,
        keys: QsaKeys<B>,
        at: At<'_, B>,
        cache: &mut AttnCache<B>,
        ratio: Option<usize>,
    ) -> Result<()> {
        let w = self.qsa_prep_weights(aw, at, ratio);
        ops::qsa_write_keys_composed(
            &self.backend,
            &w,
            keys.k,
            keys.v,
            keys.kraw,
            at.inputs,
            cache.stores(),
        )
    }

    /// §7.3, the query side: the indexer queries (normed and rotated by
    /// [`Qwen4expOps::qsa_prepare`]) against the pooled blocks.
    fn qsa_select(
        &self,
        qi: B::Buf,
        at: At<'_, B>,
        cache: &AttnCache<B>,
        ratio: usize,
    ) -> Result<B::Selection> {
        let c = &self.config;
        let sel = QsaSelect {
            ratio,
            budget: c.indexer.budget,
            rule: c.qsa_rule,
        };
        self.backend
            .qsa_select(&qi, &cache.blocks.buf, &at.inputs.positions, sel)
    }

    /// One attention layer over `x`'s rows (n > 1) when only the last row's output is read
    /// (a last-logits prefill, an MTP catch-up): the rows before the last only write the
    /// layer's caches, the last runs the whole layer. Returns the last row after the layer;
    /// the caches and that row are the bits of [`Self::decoder_layer`] over every row.
    pub(crate) fn attention_layer_last_row(
        &self,
        kind: &LayerKind,
        lw: &LayerW<B::Weight>,
        x: B::Buf,
        at: At<'_, B>,
        st: &mut LayerState<B>,
    ) -> Result<B::Buf> {
        let b = &self.backend;
        let n = x.rows();
        let mut before = b.copy(&x)?;
        b.truncate_rows(&mut before, n - 1)?;
        let (head_in, tail_in) = (at.inputs.range(b, 0, n - 1)?, at.inputs.range(b, n - 1, 1)?);
        let head = At {
            inputs: &head_in,
            theta: at.theta,
        };
        self.attention_cache_only(kind, lw, &before, head, st)?;
        let mut last = b.last_row(x)?;
        let tail = At {
            inputs: &tail_in,
            theta: at.theta,
        };
        self.decoder_layer(kind, lw, &mut last, tail, st, None)?;
        Ok(last)
    }

    /// An attention layer's cache writes for `x`'s rows and nothing else. The caches end up
    /// exactly as after [`Self::decoder_layer`] over the same rows.
    fn attention_cache_only(
        &self,
        kind: &LayerKind,
        lw: &LayerW<B::Weight>,
        x: &B::Buf,
        at: At<'_, B>,
        st: &mut LayerState<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let (MixerW::Attn(aw), LayerState::Attn(cache), LayerKind::Attention { ratio }) =
            (&lw.mixer, st, kind)
        else {
            return Err(EngineError::Input(
                "a cache-only pass needs an attention layer".to_string(),
            ));
        };
        let (u, _) = self.hc_mix(&lw.hc_attn, x)?;
        let keys = match aw.indexer.as_ref().filter(|_| ratio.is_some()) {
            Some(ix) => {
                let [k, v, kraw] = b.matmuls([&aw.k, &aw.v, &ix.k], &u)?;
                QsaKeys {
                    k,
                    v,
                    kraw: Some(kraw),
                }
            }
            None => {
                let [k, v] = b.matmuls([&aw.k, &aw.v], &u)?;
                QsaKeys { k, v, kraw: None }
            }
        };
        self.qsa_store(aw, keys, at, cache, *ratio)
    }

    // ---- §8 MoE

    /// Router → top-k routed experts, plus the gated shared expert (one family operation,
    /// [`Qwen4expOps::moe_block`], whose default is the composition of core operations).
    fn moe(&self, mw: &MoeW<B::Weight>, u: &B::Buf) -> Result<B::Buf> {
        self.backend.moe_block(mw, u, self.config.moe.n_used)
    }

    // ---- §9 final mixer and LM head

    fn lm_head(&self, x: &mut B::Buf, carry: Option<Carry<B>>) -> Result<B::Buf> {
        let (h, _) = self.carry_mix(&self.weights.output_hc, x, carry)?;
        self.backend.matmul(&self.weights.output, &h)
    }
}

pub(crate) fn cache_buffers<B: Backend>(
    b: &B,
    name: &str,
    c: &AttnCache<B>,
) -> Result<Vec<(String, Vec<f32>)>> {
    // Only the valid rows: rows past a store's length (a rejected draft's) are not state.
    let valid = |st: &crate::backend::RowStore<B>| -> Result<Vec<f32>> {
        let mut v = b.download(&st.buf)?;
        v.truncate(st.len() * st.buf.cols());
        Ok(v)
    };
    Ok(vec![
        (format!("{name}.k"), valid(&c.k)?),
        (format!("{name}.v"), valid(&c.v)?),
        (format!("{name}.kraw"), valid(&c.kraw)?),
        (format!("{name}.blocks"), valid(&c.blocks)?),
    ])
}

/// Decides each attention layer's QSA block size from the file, the indexer tensors present and
/// the user's override; warns about the converter fault that writes zero ratios.
fn resolve_qsa_ratios<W>(
    config: &mut Config,
    weights: &Weights<W>,
    opts: &LoadOptions,
    file: &str,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let budget = config.indexer.budget;
    if opts.qsa_ratio == Some(0) {
        return Err(EngineError::Input(
            "--qsa-ratio must be greater than zero".to_string(),
        ));
    }
    let mut zeroed = Vec::new();
    for (l, (kind, lw)) in config.layers.iter_mut().zip(&weights.layers).enumerate() {
        let LayerKind::Attention { ratio } = kind else {
            continue;
        };
        let has_indexer = matches!(&lw.mixer, MixerW::Attn(a) if a.indexer.is_some());
        if !has_indexer {
            if ratio.is_some() {
                warnings.push(format!(
                    "{file}: layer {l} has a QSA compress ratio but no indexer tensors; it runs dense causal attention"
                ));
            }
            *ratio = None;
            continue;
        }
        let chosen = match (opts.qsa_ratio, *ratio) {
            (Some(r), Some(f)) => {
                if r != f {
                    warnings.push(format!(
                        "{file}: layer {l}: QSA ratio {r} (--qsa-ratio) replaces the file's {f}"
                    ));
                }
                r
            }
            (None, Some(f)) => f,
            (over, None) => {
                zeroed.push(l);
                over.unwrap_or(DOCUMENTED_QSA_RATIO)
            }
        };
        if budget / chosen == 0 {
            return Err(EngineError::BadKey {
                file: file.to_string(),
                key: format!("{}.attention.indexer.top_k", config::ARCH),
                problem: format!(
                    "budget {budget} holds no whole block of {chosen} tokens (layer {l})"
                ),
            });
        }
        *ratio = Some(chosen);
    }
    if !zeroed.is_empty() {
        let how = match opts.qsa_ratio {
            Some(r) => format!("using ratio {r} from --qsa-ratio"),
            None => format!(
                "using ratio {DOCUMENTED_QSA_RATIO}, the model's documented indexer_compress_ratio (override with --qsa-ratio)"
            ),
        };
        warnings.push(format!(
            "{file}: {}.attention.compress_ratios is 0 for QSA layer(s) {zeroed:?}, which carry indexer tensors \
             (a known llama.cpp converter fault: newer transformers rename the layer type, and the converter then \
             writes 0, which llama.cpp runs as dense attention); {how}",
            config::ARCH
        ));
    }
    Ok(())
}
