//! The MTP draft head (spec §10): its weights (from a separate MTP GGUF written by
//! `strata convert-mtp`, or from the model file when that carries `mtp.*`), its per-sequence
//! state (the MTP layer's own KV, raw indexer keys and pooled blocks) and its forward step.
//!
//! Draft position `p` pairs the trunk's pre-mixer state `X_p` (or, in a chain, the previous
//! draft step's pre-mixer output) with token `x_{p+1}`, uses RoPE position `p`, and predicts
//! `x_{p+2}`. `pre_fc_norm_hidden` is ONE RMS norm over all `S·H` values (not per stream), and the
//! same `fc_hidden` maps each of the four normed streams. The layout of the tensors is in
//! docs/MTP-GGUF.md.

use std::path::Path;
use std::sync::Arc;

use strata_gguf::GgufFile;

use crate::backend::{Backend, DeviceBuf, StepInputs, StepKey, StepKind, Usage};
use crate::error::{EngineError, Result};

use super::config::{self, Config, LayerKind, DOCUMENTED_QSA_RATIO};
use super::ops::Qwen4expOps;
use super::state::{AttnCache, LayerState};
use super::weights::{Binder, HcW, LayerW, MixerW};
use super::{At, Model, State, Want};

/// `general.architecture` of a stand-alone MTP GGUF; its keys live under this prefix.
pub const MTP_ARCH: &str = "qwen4exp_mtp";

/// The tensor whose presence marks a file as carrying an MTP head.
const MARKER: &str = "mtp.fc_hidden.weight";

/// Whether `file` carries an MTP head (`mtp.*` tensors).
pub fn file_has_head(file: &GgufFile) -> bool {
    file.tensor(MARKER).is_some()
}

/// The next tokens of an MTP step: host ids (a catch-up's known tokens), or entries
/// `from..from + n` of a device id buffer (a draft chain's previous pick).
pub(crate) enum DraftTokens<'a, B: Backend> {
    Host(&'a [u32]),
    Device {
        ids: &'a B::Ids,
        from: usize,
        n: usize,
    },
}

impl<B: Backend> DraftTokens<'_, B> {
    fn len(&self) -> usize {
        match self {
            DraftTokens::Host(t) => t.len(),
            DraftTokens::Device { n, .. } => *n,
        }
    }
}

/// The MTP layer's own settings (everything else is the trunk's).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpConfig {
    /// QSA block size of the MTP layer; None for dense causal attention (no indexer).
    pub ratio: Option<usize>,
    pub rope_theta: f32,
    /// The head brings its own embedding and LM head instead of sharing the trunk's.
    pub dedicated_embeddings: bool,
    /// The file the head came from (for messages).
    pub source: String,
}

pub struct MtpHead<W> {
    pub(crate) fc_embedding: W,
    pub(crate) fc_hidden: W,
    pub(crate) norm_embedding: W,
    pub(crate) norm_hidden: W,
    pub(crate) layer: LayerW<W>,
    pub(crate) output_hc: HcW<W>,
    pub(crate) token_embd: Option<W>,
    pub(crate) output: Option<W>,
    pub(crate) config: MtpConfig,
    /// Keeps the mapped file alive as long as the weights borrow from it.
    _file: Arc<GgufFile>,
}

/// One sequence's MTP state: the MTP layer's caches, position = rows cached.
pub struct MtpState<B: Backend> {
    /// The head's sequence id in step keys (`backend::sequence_id`).
    pub(crate) id: u64,
    pub(crate) pos: usize,
    pub(crate) layer: LayerState<B>,
}

impl<B: Backend> MtpState<B> {
    /// Draft positions cached so far.
    pub fn position(&self) -> usize {
        self.pos
    }
}

/// Host copies of an MTP forward's results.
#[derive(Clone, Debug, Default)]
pub struct MtpOutputs {
    /// `[rows, cols]`: rows = tokens (or 1 with `last_only`), cols = vocabulary or draft rows.
    pub logits: Vec<f32>,
    pub cols: usize,
    /// `[rows, S·H]` (rows as for `logits`): the MTP layer's pre-mixer output (the next
    /// chained step's `Hp`).
    pub hidden: Vec<f32>,
}

/// Reads and checks the stand-alone file's hyper-parameters against the trunk's.
fn mtp_config(file: &GgufFile, trunk: &Config) -> Result<MtpConfig> {
    let name = file.name().to_string();
    let key = |k: &str| format!("{MTP_ARCH}.{k}");
    let bad = |k: &str, problem: String| EngineError::BadKey {
        file: name.clone(),
        key: key(k),
        problem,
    };
    let u = |k: &str| -> Result<usize> { Ok(file.get_u32(&key(k))? as usize) };
    let checks: [(&str, usize); 14] = [
        ("embedding_length", trunk.n_embd),
        ("vocab_size", trunk.n_vocab),
        ("hyper_connection.count", trunk.hc_streams),
        ("hyper_connection.low_rank", trunk.hc_rank),
        ("attention.head_count", trunk.attn.n_head),
        ("attention.head_count_kv", trunk.attn.n_head_kv),
        ("attention.key_length", trunk.attn.head_dim),
        ("attention.indexer.head_count", trunk.indexer.n_head),
        ("attention.indexer.key_length", trunk.indexer.head_dim),
        ("attention.indexer.top_k", trunk.indexer.budget),
        ("expert_count", trunk.moe.n_expert),
        ("expert_used_count", trunk.moe.n_used),
        ("expert_feed_forward_length", trunk.moe.ff),
        ("rope.dimension_count", trunk.rot_dims),
    ];
    for (k, want) in checks {
        let got = u(k)?;
        if got != want {
            return Err(bad(
                k,
                format!("{got}, but the trunk model has {want}: the head belongs to another model"),
            ));
        }
    }
    let blocks = u("block_count")?;
    if blocks != 1 {
        return Err(bad(
            "block_count",
            format!("{blocks}; only MTP heads of one layer are supported"),
        ));
    }
    let ratio = u("attention.compress_ratio")?;
    if ratio > 0 && trunk.indexer.budget / ratio == 0 {
        return Err(bad(
            "attention.compress_ratio",
            format!(
                "{ratio}: the budget of {} tokens holds no whole block",
                trunk.indexer.budget
            ),
        ));
    }
    let rope_theta = file.get_f32(&key("rope.freq_base"))?;
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(bad("rope.freq_base", format!("{rope_theta}; expected > 0")));
    }
    Ok(MtpConfig {
        ratio: (ratio > 0).then_some(ratio),
        rope_theta,
        dedicated_embeddings: file.tensor("mtp.token_embd.weight").is_some(),
        source: name,
    })
}

/// The settings of a head carried inside the trunk file: the trunk's own, the MTP layer's
/// block size from `qwen4exp.mtp.compress_ratio` when written, else the trunk's QSA layers'.
fn embedded_config(file: &GgufFile, trunk: &Config) -> Result<MtpConfig> {
    let key = format!("{}.mtp.compress_ratio", config::ARCH);
    let ratio = match file.get(&key) {
        Some(_) => file.get_u32(&key)? as usize,
        None => trunk
            .layers
            .iter()
            .find_map(|k| match k {
                LayerKind::Attention { ratio: Some(r) } => Some(*r),
                _ => None,
            })
            .unwrap_or(DOCUMENTED_QSA_RATIO),
    };
    Ok(MtpConfig {
        ratio: (ratio > 0).then_some(ratio),
        rope_theta: trunk.rope_theta,
        dedicated_embeddings: file.tensor("mtp.token_embd.weight").is_some(),
        source: file.name().to_string(),
    })
}

impl<B: Qwen4expOps> Model<B> {
    /// Loads an MTP GGUF (`strata convert-mtp`'s output) and attaches it to this model.
    pub fn load_mtp(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let file = Arc::new(GgufFile::open(path)?);
        self.attach_mtp(file)
    }

    /// Attaches the MTP head in `file`: a stand-alone MTP GGUF (architecture `qwen4exp_mtp`,
    /// checked against this trunk) or a qwen4exp file that carries `mtp.*` tensors.
    pub fn attach_mtp(&mut self, file: Arc<GgufFile>) -> Result<()> {
        let arch = file.architecture()?;
        let cfg = if arch == MTP_ARCH {
            mtp_config(&file, &self.config)?
        } else if arch == config::ARCH {
            embedded_config(&file, &self.config)?
        } else {
            return Err(EngineError::UnsupportedArch {
                file: file.name().to_string(),
                found: arch.to_string(),
                expected: format!(
                    "{MTP_ARCH} (an MTP head) or {} carrying mtp.*",
                    config::ARCH
                ),
            });
        };
        if !file_has_head(&file) {
            return Err(EngineError::MissingTensor {
                file: file.name().to_string(),
                tensor: MARKER.to_string(),
                expected: "the MTP head's tensors (mtp.*)".to_string(),
            });
        }
        let head = bind_head(&file, &self.backend, &self.config, cfg)?;
        self.mtp = Some(head);
        Ok(())
    }

    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    pub fn mtp_config(&self) -> Option<&MtpConfig> {
        self.mtp.as_ref().map(|h| &h.config)
    }

    fn head(&self) -> Result<&MtpHead<B::Weight>> {
        self.mtp.as_ref().ok_or_else(|| {
            EngineError::Input("no MTP head is attached to this model (use --mtp)".to_string())
        })
    }

    /// A fresh MTP state (draft position 0).
    pub fn new_mtp_state(&self) -> Result<MtpState<B>> {
        let _ = self.head()?;
        let b = &self.backend;
        let c = &self.config;
        let kv = c.attn.n_head_kv * c.attn.head_dim;
        Ok(MtpState {
            id: crate::backend::sequence_id(),
            pos: 0,
            layer: LayerState::Attn(AttnCache::new(b, c.n_ctx, kv, c.indexer.head_dim)?),
        })
    }

    /// Cuts the MTP state back to `pos` draft positions.
    pub fn mtp_truncate(&self, st: &mut MtpState<B>, pos: usize) -> Result<()> {
        let ratio = self.head()?.config.ratio;
        if pos > st.pos {
            return Err(EngineError::Input(format!(
                "cannot truncate the MTP state at {} to {pos}",
                st.pos
            )));
        }
        if let LayerState::Attn(cache) = &mut st.layer {
            cache.set_len(pos, ratio)?;
        }
        st.pos = pos;
        Ok(())
    }

    /// The MTP state's buffers, downloaded and named (for bit-for-bit comparisons).
    pub fn mtp_state_buffers(&self, st: &MtpState<B>) -> Result<Vec<(String, Vec<f32>)>> {
        match &st.layer {
            LayerState::Attn(c) => super::cache_buffers(&self.backend, "mtp", c),
            LayerState::Gdn { .. } => Err(EngineError::Input(
                "the MTP state holds no attention cache".to_string(),
            )),
        }
    }

    /// The MTP head over `n` draft positions continuing `st`: `hidden` is `[n, S·H]` (trunk
    /// pre-mixer states, or a chain's previous outputs), `next_tokens` the `n` tokens
    /// `x_{p+1}`. `rows` restricts the LM head to those vocabulary rows (a draft vocabulary).
    /// With `last_only`, only the last position's logits and output are computed: the others
    /// only fill the head's caches (an MTP catch-up), which end up as after the full pass.
    pub fn mtp_forward(
        &self,
        st: &mut MtpState<B>,
        hidden: &[f32],
        next_tokens: &[u32],
        last_only: bool,
        rows: Option<&[u32]>,
    ) -> Result<MtpOutputs> {
        let b = &self.backend;
        let sh = self.config.residual_dim();
        let n = next_tokens.len();
        if hidden.len() != n * sh {
            return Err(EngineError::Input(format!(
                "MTP input: {} hidden values for {n} tokens of {sh}",
                hidden.len()
            )));
        }
        let h = b.upload(n, sh, hidden)?;
        let rows = rows.map(|r| b.upload_ids(r)).transpose()?;
        let (logits, hid) = self.mtp_forward_dev(st, &h, next_tokens, last_only, rows.as_ref())?;
        Ok(MtpOutputs {
            cols: logits.cols(),
            logits: b.download(&logits)?,
            hidden: b.download(&hid)?,
        })
    }

    /// Runs `tokens` through the trunk and the head together, for a caller that keeps both
    /// states at one position (a prompt's chunk, when the token after it is known): the trunk
    /// alone, then the head follows it over the rows ([`Model::mtp_follow`]: the tokens after
    /// them are `tokens[1..]` and `next`). Returns the trunk's logits after the last token. A
    /// batch runs the same two halves: the trunk's rows as a batch item with `hidden`, then
    /// `mtp_follow` per sequence.
    pub fn forward_with_head(
        &self,
        st: &mut State<B>,
        mtp: &mut MtpState<B>,
        tokens: &[u32],
        next: u32,
    ) -> Result<Vec<f32>> {
        if mtp.position() != st.position() {
            return Err(EngineError::Input(format!(
                "the MTP state holds {} positions, the trunk {}",
                mtp.position(),
                st.position()
            )));
        }
        let want = Want {
            hidden: true,
            last_only: true,
            ..Want::default()
        };
        let out = self.forward_dev(st, tokens, want, None)?;
        let hidden = out
            .hidden
            .ok_or_else(|| EngineError::shape("forward", "no pre-mixer rows for the MTP head"))?;
        self.mtp_follow(st, mtp, &hidden, next)?;
        self.backend.download(&out.logits)
    }

    /// The head follows the trunk over the rows the trunk ran since the head's position: row
    /// `p` takes the trunk's pre-mixer residual `h_p` (`hidden`, `[rows, S·H]`, from a pass
    /// with `Want::hidden` or a batch item's `hidden`) and the token after it, `x_{p+1}` (the
    /// trunk's own tokens, and `next` after its last), only filling the head's caches. A
    /// prompt's rows run this way chunk by chunk, in the trunk's pass alone or in a batch.
    pub fn mtp_follow(
        &self,
        st: &State<B>,
        mtp: &mut MtpState<B>,
        hidden: &B::Buf,
        next: u32,
    ) -> Result<()> {
        let from = mtp.position();
        if from >= st.position() || hidden.rows() != st.position() - from {
            return Err(EngineError::Input(format!(
                "the MTP head follows the trunk: it holds {from} positions, the trunk {}, and \
                 {} pre-mixer rows came for the rows between",
                st.position(),
                hidden.rows()
            )));
        }
        let mut next_tokens = st.tokens()[from + 1..].to_vec();
        next_tokens.push(next);
        self.mtp_forward_dev(mtp, hidden, &next_tokens, true, None)?;
        Ok(())
    }

    /// [`Model::mtp_forward`] on device buffers: returns the logits and the pre-mixer output.
    pub(crate) fn mtp_forward_dev(
        &self,
        st: &mut MtpState<B>,
        hidden: &B::Buf,
        next_tokens: &[u32],
        last_only: bool,
        rows: Option<&B::Ids>,
    ) -> Result<(B::Buf, B::Buf)> {
        let n_vocab = self.config.n_vocab;
        if let Some(&t) = next_tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::Input(format!(
                "token id {t} is out of range (vocabulary {n_vocab})"
            )));
        }
        self.mtp_forward_from(st, hidden, DraftTokens::Host(next_tokens), last_only, rows)
    }

    /// Refuses, before anything runs, `rows` more head positions than the head's cache holds.
    pub(crate) fn mtp_check_room(&self, st: &MtpState<B>, rows: usize) -> Result<()> {
        match &st.layer {
            LayerState::Attn(cache) => cache.check_room(st.pos + rows),
            _ => Err(EngineError::Input(
                "the MTP state holds no attention cache".to_string(),
            )),
        }
    }

    /// [`Model::mtp_forward_dev`] whose next tokens are host ids or ids already on the device
    /// (a draft chain's previous pick, embedded on the device: no host round trip). Device ids
    /// are not range-checked here: they never reach the host, and the only ones the chain
    /// passes are its picks, valid tokens by construction (`Backend::pick_draft_mapped`).
    pub(crate) fn mtp_forward_from(
        &self,
        st: &mut MtpState<B>,
        hidden: &B::Buf,
        next: DraftTokens<'_, B>,
        last_only: bool,
        rows: Option<&B::Ids>,
    ) -> Result<(B::Buf, B::Buf)> {
        let head = self.head()?;
        let c = &self.config;
        let sh = c.residual_dim();
        let n = next.len();
        if n == 0 {
            return Err(EngineError::Input("MTP forward: no tokens".to_string()));
        }
        if hidden.rows() != n || hidden.cols() != sh {
            return Err(EngineError::Input(format!(
                "MTP input: hidden {}×{} for {n} tokens of {sh}",
                hidden.rows(),
                hidden.cols()
            )));
        }
        let end = st.pos + n;
        let ratio = head.config.ratio;
        let LayerState::Attn(cache) = &st.layer else {
            return Err(EngineError::Input(
                "the MTP state holds no attention cache".to_string(),
            ));
        };
        cache.check_room(end)?;
        let b = &self.backend;
        let ratios: Vec<usize> = ratio.into_iter().collect();
        let start = st.pos;
        let on_device = matches!(next, DraftTokens::Device { .. });
        let key = StepKey {
            kind: StepKind::Draft,
            rows: n,
            // The tokens' source changes the step's inputs (an upload or a device copy).
            outputs: (last_only as u32)
                | ((rows.is_some() as u32) << 1)
                | ((on_device as u32) << 2),
            seq: st.id,
        };
        let out = b.step(key, || {
            let inputs = match next {
                DraftTokens::Host(t) => StepInputs::new(b, t, start, &ratios)?,
                DraftTokens::Device { ids, from, n } => {
                    StepInputs::with_tokens(b, ids, from, n, start, &ratios)?
                }
            };
            self.mtp_body(head, st, hidden, &inputs, last_only, rows)
        })?;
        if let LayerState::Attn(cache) = &mut st.layer {
            cache.set_len(end, ratio)?;
        }
        st.pos = end;
        Ok(out)
    }

    /// The body of [`Model::mtp_forward_dev`] (positions checked, state not yet advanced).
    #[allow(clippy::too_many_arguments)]
    fn mtp_body(
        &self,
        head: &MtpHead<B::Weight>,
        st: &mut MtpState<B>,
        hidden: &B::Buf,
        inputs: &StepInputs<B>,
        last_only: bool,
        rows: Option<&B::Ids>,
    ) -> Result<(B::Buf, B::Buf)> {
        let b = &self.backend;
        let c = &self.config;
        let (h, s, eps) = (c.n_embd, c.hc_streams, c.eps);
        let sh = s * h;
        let n = inputs.rows();
        // e = fc_embedding · RMS1p(E[x_{p+1}])
        let table = head.token_embd.as_ref().unwrap_or(&self.weights.token_embd);
        let emb = b.embed_rows(table, &inputs.tokens, 1)?;
        // (Each norm emits its rows with the image its product reads: the report's rms_xprep.)
        let en = b.rms_norm_prepared(&emb, &head.norm_embedding, h, eps, &[&head.fc_embedding])?;
        let e = b.matmul_prepared(&head.fc_embedding, &en)?;
        // hn = RMS1p(Hp) over all S·H values at once, then the shared fc_hidden per stream.
        let hn = b.rms_norm_prepared(hidden, &head.norm_hidden, sh, eps, &[&head.fc_hidden])?;
        let y = b.matmul_prepared(&head.fc_hidden, &b.reshape_prepared(hn, n * s, h)?)?;
        let mut x = b.reshape(y, n, sh)?;
        // Y_s = fc_hidden·hn_s + e: a combine with unit stream weights adds e to every stream.
        b.hc_combine(&mut x, &e, None)?;

        let kind = LayerKind::Attention {
            ratio: head.config.ratio,
        };
        let theta = head.config.rope_theta;
        // With `last_only`, the rows before the last only leave their keys in the layer's
        // caches (no one reads their outputs); the last row then runs the whole layer. Each
        // row's cache entries and the last row's outputs are the bits of the full batch.
        let at = At { inputs, theta };
        let x = if last_only && n > 1 {
            self.attention_layer_last_row(&kind, &head.layer, x, at, &mut st.layer)?
        } else {
            self.decoder_layer(&kind, &head.layer, &mut x, at, &mut st.layer, None)?;
            x
        };
        let hidden_out = b.copy(&x)?;
        let (mixed, _) = self.hc_mix(&head.output_hc, &x)?;
        let out = head.output.as_ref().unwrap_or(&self.weights.output);
        let logits = match rows {
            Some(r) => b.matmul_rows(out, r, &mixed)?,
            None => b.matmul(out, &mixed)?,
        };
        Ok((logits, hidden_out))
    }
}

/// Binds every tensor of the head (names in docs/MTP-GGUF.md), shapes checked against the trunk.
fn bind_head<B: Backend>(
    file: &Arc<GgufFile>,
    backend: &B,
    c: &Config,
    cfg: MtpConfig,
) -> Result<MtpHead<B::Weight>> {
    let bind = Binder { file, backend };
    let (h, sh, v) = (c.n_embd, c.residual_dim(), c.n_vocab);
    let attn = bind.attn("mtp.blk.0", c)?;
    if cfg.ratio.is_some() && attn.indexer.is_none() {
        return Err(EngineError::MissingTensor {
            file: file.name().to_string(),
            tensor: "mtp.blk.0.indexer.q_proj.weight".to_string(),
            expected: "the MTP layer's indexer (its compress ratio is not 0)".to_string(),
        });
    }
    let mut cfg = cfg;
    if attn.indexer.is_none() {
        cfg.ratio = None;
    }
    Ok(MtpHead {
        fc_embedding: bind.get("mtp.fc_embedding.weight", &[&[h, h]], Usage::MatMul)?,
        fc_hidden: bind.get("mtp.fc_hidden.weight", &[&[h, h]], Usage::MatMul)?,
        norm_embedding: bind.get("mtp.pre_fc_norm_embedding.weight", &[&[h]], Usage::Values)?,
        norm_hidden: bind.get("mtp.pre_fc_norm_hidden.weight", &[&[sh]], Usage::Values)?,
        layer: LayerW {
            hc_attn: bind.hc("mtp.blk.0.hc_attn", c, true)?,
            hc_ffn: bind.hc("mtp.blk.0.hc_ffn", c, true)?,
            mixer: MixerW::Attn(attn),
            moe: bind.moe("mtp.blk.0", c)?,
            ple: None,
        },
        output_hc: bind.hc("mtp.output_hc", c, false)?,
        token_embd: bind.opt("mtp.token_embd.weight", &[&[h, v]], Usage::Rows)?,
        output: bind.opt("mtp.output.weight", &[&[h, v]], Usage::MatMul)?,
        config: cfg,
        _file: Arc::clone(file),
    })
}
