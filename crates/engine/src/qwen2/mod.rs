//! The dense qwen2 architecture (Qwen2 / Qwen2.5 and their Coder variants, the default model),
//! written once against [`Backend`]: pre-norm decoder blocks of causal GQA attention (q/k/v
//! biases, NeoX RoPE over whole heads) and a SwiGLU MLP, RMSNorm with a plain weight, and an
//! output head that is either its own tensor or the tied embedding.

pub mod config;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use strata_gguf::GgufFile;

use crate::backend::{
    Backend, DeviceBuf, DevicePick, Prepared, RowStore, StepInputs, StepKey, StepKind,
};
use crate::batch::{self, Split};
use crate::error::{EngineError, Result};

pub use config::{Config, LoadOptions, ARCH};
use weights::{LayerW, Weights};

/// Host copy of a forward call's logits, row-major `[rows, n_vocab]`.
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    pub logits: Vec<f32>,
    pub n_vocab: usize,
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

/// One layer's attention cache: keys after RoPE, values, one row per position.
struct KvCache<B: Backend> {
    k: RowStore<B>,
    v: RowStore<B>,
}

/// One sequence's state: create with [`Model::new_state`], advance with [`Model::forward`],
/// roll back with [`Model::truncate`] (a dense model's state is only its caches).
pub struct State<B: Backend> {
    /// The sequence's id in step keys (`backend::sequence_id`).
    id: u64,
    pos: usize,
    tokens: Vec<u32>,
    layers: Vec<KvCache<B>>,
}

impl<B: Backend> State<B> {
    /// Tokens consumed so far (the position of the next token).
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// One sequence's rows in [`Model::forward_batch`]: its tokens continue `state`.
pub struct BatchItem<'a, B: Backend> {
    pub state: &'a mut State<B>,
    pub tokens: &'a [u32],
    /// Logits of the last token only (a prefill chunk); else of every token.
    pub last_only: bool,
}

/// [`StepKey::outputs`] of a batched step (bit 0 is a solo step's `last_only`).
const OUT_BATCH: u32 = 2;

pub struct Model<B: Backend> {
    backend: B,
    config: Config,
    weights: Weights<B::Weight>,
    file: Arc<GgufFile>,
}

impl<B: Backend> Model<B> {
    /// Opens a qwen2 GGUF and binds every tensor on `backend`.
    pub fn load(path: impl AsRef<Path>, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        let file = Arc::new(GgufFile::open(path)?);
        Self::from_file(file, backend, opts)
    }

    /// As [`Model::load`], from a file already open.
    pub fn from_file(file: Arc<GgufFile>, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        let arch = file.architecture()?;
        if arch != ARCH {
            return Err(EngineError::UnsupportedArch {
                file: file.name().to_string(),
                found: arch.to_string(),
                expected: ARCH.to_string(),
            });
        }
        let n_embd = file.get_u32(&format!("{ARCH}.embedding_length"))? as u64;
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| EngineError::MissingTensor {
                file: file.name().to_string(),
                tensor: "token_embd.weight".to_string(),
                expected: format!("shape [{n_embd}, n_vocab]"),
            })?;
        if embd.dims.len() != 2 || embd.ne(0) != n_embd || embd.ne(1) == 0 {
            return Err(EngineError::TensorShape {
                file: file.name().to_string(),
                tensor: embd.name.clone(),
                found: embd.dims.clone(),
                expected: vec![n_embd, embd.ne(1).max(1)],
            });
        }
        let n_vocab = usize::try_from(embd.ne(1))
            .map_err(|_| EngineError::Input(format!("{}: vocabulary too large", file.name())))?;
        let config = Config::from_gguf(&file, n_vocab, opts)?;
        let weights = weights::bind(&file, &backend, &config)?;
        Ok(Model {
            backend,
            config,
            weights,
            file,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The bound weights (the parity harness runs the prepared operations on them).
    pub fn weights(&self) -> &Weights<B::Weight> {
        &self.weights
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// Whether the output head is the embedding (no `output.weight` in the file).
    pub fn tied_output(&self) -> bool {
        self.weights.tied
    }

    /// A fresh sequence state (position 0).
    pub fn new_state(&self) -> Result<State<B>> {
        let kv = self.config.kv_dim();
        let layers = (0..self.config.n_layer)
            .map(|_| {
                let cap = self.config.n_ctx_train;
                Ok(KvCache {
                    k: RowStore::new(&self.backend, "the K cache", cap, kv)?,
                    v: RowStore::new(&self.backend, "the V cache", cap, kv)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(State {
            id: crate::backend::sequence_id(),
            pos: 0,
            tokens: Vec::new(),
            layers,
        })
    }

    /// Rolls `st` back to position `pos` (≤ its position): later cache rows are dropped.
    pub fn truncate(&self, st: &mut State<B>, pos: usize) -> Result<()> {
        if pos > st.pos {
            return Err(EngineError::Input(format!(
                "cannot roll a sequence at position {} forward to {pos}",
                st.pos
            )));
        }
        for c in &mut st.layers {
            c.k.set_len(pos)?;
            c.v.set_len(pos)?;
        }
        st.pos = pos;
        st.tokens.truncate(pos);
        Ok(())
    }

    /// Logits of every token of `tokens`, continuing `st`.
    pub fn forward(&self, st: &mut State<B>, tokens: &[u32]) -> Result<Outputs> {
        self.forward_with(st, tokens, false)
    }

    /// Refuses an empty call, a token outside the vocabulary, or rows past the context.
    fn check(&self, st: &State<B>, tokens: &[u32]) -> Result<()> {
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
        let n = tokens.len();
        if st.pos + n > c.n_ctx_train {
            return Err(EngineError::Input(format!(
                "{} tokens at position {} exceed the model's context of {} positions",
                n, st.pos, c.n_ctx_train
            )));
        }
        Ok(())
    }

    /// After a step over `tokens`: the caches hold them, the state is past them.
    fn advance(&self, st: &mut State<B>, tokens: &[u32]) -> Result<()> {
        let end = st.pos + tokens.len();
        for c in &mut st.layers {
            c.k.set_len(end)?;
            c.v.set_len(end)?;
        }
        st.pos = end;
        st.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// The forward pass; with `last_only`, logits of the last token only (a prefill that only
    /// needs the next token skips the LM head for the others). Every operation works row by row,
    /// so N tokens in one call give the same bits as N calls of one token. On error the state is
    /// left part-way; truncate it back to its old position before using it again.
    pub fn forward_with(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        last_only: bool,
    ) -> Result<Outputs> {
        let logits = self.forward_step(st, tokens, last_only)?;
        let logits = self.backend.download(&logits)?;
        self.advance(st, tokens)?;
        Ok(Outputs {
            logits,
            n_vocab: self.config.n_vocab,
        })
    }

    /// [`Model::forward_with`] of `tokens` with the last token's logits left on the backend
    /// and `pick`'s token after it chosen there (`Backend::pick_rows`, at the next token's
    /// position): only the id crosses (plain decoding, `generate::Session::feed_picked`).
    pub fn forward_picked(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        pick: DevicePick,
    ) -> Result<u32> {
        let b = &self.backend;
        let at = (st.pos + tokens.len()) as u64;
        let logits = self.forward_step(st, tokens, true)?;
        let ids = b.download_ids(&b.pick_rows(&logits, pick, at)?)?;
        self.advance(st, tokens)?;
        match ids[..] {
            [id] => Ok(id),
            _ => Err(EngineError::shape(
                "forward_picked",
                format!("{} picks for one row", ids.len()),
            )),
        }
    }

    /// The step of [`Model::forward_with`]: its logits on the backend, the state not advanced.
    fn forward_step(&self, st: &mut State<B>, tokens: &[u32], last_only: bool) -> Result<B::Buf> {
        let b = &self.backend;
        self.check(st, tokens)?;
        let start = st.pos;
        let key = StepKey {
            kind: StepKind::Forward,
            rows: tokens.len(),
            outputs: last_only as u32,
            seq: st.id,
        };
        b.step(key, || {
            let inputs = StepInputs::new(b, tokens, start, &[])?;
            self.layers_and_head(&mut [&mut *st], &inputs, &Split::one(), last_only)
        })
    }

    /// Several sequences' rows in one forward pass (`crate::batch`): each item's tokens
    /// continue its state, and its logits (of every row, or of the last with `last_only`) are
    /// the bits of [`Model::forward_with`] on that sequence alone. Every item is checked before
    /// the step runs; on an error inside the step the states are left part-way.
    pub fn forward_batch(&self, items: &mut [BatchItem<'_, B>]) -> Result<Vec<Outputs>> {
        let b = &self.backend;
        let v = self.config.n_vocab;
        if items.len() == 1 || !b.batches_sequences() {
            // One sequence, or a backend that steps sequences apart: each its own step.
            for it in items.iter() {
                self.check(it.state, it.tokens)?;
            }
            return items
                .iter_mut()
                .map(|it| self.forward_with(it.state, it.tokens, it.last_only))
                .collect();
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut parts = Vec::with_capacity(items.len());
        for it in items.iter() {
            self.check(it.state, it.tokens)?;
            tokens.extend_from_slice(it.tokens);
            positions.extend(it.state.pos..it.state.pos + it.tokens.len());
            parts.push((it.state.id, it.tokens.len(), it.last_only as u32));
        }
        let (lens, lasts): (Vec<usize>, Vec<bool>) = items
            .iter()
            .map(|it| (it.tokens.len(), it.last_only))
            .unzip();
        let key = StepKey {
            kind: StepKind::Forward,
            rows: tokens.len(),
            outputs: OUT_BATCH,
            seq: batch::batch_key(&parts),
        };
        let (logits, ranges) = b.step(key, || {
            let inputs = StepInputs::at_positions(b, &tokens, &positions, &[])?;
            let split = Split::new(b, &inputs, &lens, &lasts)?;
            let mut sts: Vec<&mut State<B>> = items.iter_mut().map(|it| &mut *it.state).collect();
            let logits = self.layers_and_head(&mut sts, &inputs, &split, false)?;
            let ranges: Vec<(usize, usize)> = (0..sts.len())
                .map(|i| split.output_range(i, logits.rows()))
                .collect();
            Ok((logits, ranges))
        })?;
        let logits = b.download(&logits)?;
        let mut res = Vec::with_capacity(items.len());
        for (it, (start, len)) in items.iter_mut().zip(ranges) {
            self.advance(it.state, it.tokens)?;
            res.push(Outputs {
                logits: logits[start * v..(start + len) * v].to_vec(),
                n_vocab: v,
            });
        }
        Ok(res)
    }

    /// Embedding, every decoder layer, final norm and head, over the rows of the sequences
    /// `sts` (one, or a batch split by `split`).
    fn layers_and_head(
        &self,
        sts: &mut [&mut State<B>],
        inputs: &StepInputs<B>,
        split: &Split<B>,
        last_only: bool,
    ) -> Result<B::Buf> {
        let b = &self.backend;
        let w = &self.weights;
        let n = inputs.rows();
        let mut x = b.embed_rows(&w.token_embd, &inputs.tokens, 1)?;
        let layers = w.layers.len();
        for (i, lw) in w.layers.iter().enumerate() {
            if split.is_one() && last_only && n > 1 && i + 1 == layers {
                // Only the last row's output is read after the last layer: the rows before it
                // just leave their keys and values in its cache (the same bits as the full pass).
                let cache = &mut sts[0].layers[i];
                let mut before = b.copy(&x)?;
                b.truncate_rows(&mut before, n - 1)?;
                let h = b.rms_norm_prepared(
                    &before,
                    &lw.attn_norm,
                    self.config.n_embd,
                    self.config.eps,
                    &[&lw.k, &lw.v],
                )?;
                self.store_kv(lw, &h, &b.ids_range(&inputs.positions, 0, n - 1)?, cache)?;
                x = b.last_row(x)?;
                let last = inputs.range(b, n - 1, 1)?;
                self.decoder_layer(lw, &mut x, &last, &Split::one(), &mut [cache])?;
            } else {
                let mut caches: Vec<&mut KvCache<B>> =
                    sts.iter_mut().map(|s| &mut s.layers[i]).collect();
                self.decoder_layer(lw, &mut x, inputs, split, &mut caches)?;
            }
            // The device may start on the layers recorded so far while the host goes on.
            b.submit_part()?;
        }
        if !split.is_one() {
            // A batch: each sequence's last row, or all its rows.
            x = split.output_rows(b, x)?;
        } else if last_only {
            x = b.last_row(x)?;
        }
        self.lm_head(&x)
    }

    /// `x += attn(norm(x)); x += mlp(norm(x))`; `caches` holds each sequence's of this layer.
    fn decoder_layer(
        &self,
        lw: &LayerW<B::Weight>,
        x: &mut B::Buf,
        inputs: &StepInputs<B>,
        split: &Split<B>,
        caches: &mut [&mut KvCache<B>],
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        // Each norm emits its rows with the images its products read (quantized once).
        let h = b.rms_norm_prepared(x, &lw.attn_norm, c.n_embd, c.eps, &[&lw.q, &lw.k, &lw.v])?;
        let a = self.attention(lw, &h, inputs, split, caches)?;
        b.add_assign(x, &a)?;
        let h = b.rms_norm_prepared(x, &lw.ffn_norm, c.n_embd, c.eps, &[&lw.gate, &lw.up])?;
        let m = self.mlp(lw, &h)?;
        b.add_assign(x, &m)
    }

    /// Causal GQA over the cache: biased projections, NeoX RoPE on q and k, softmax
    /// attention scaled by 1/sqrt(head_dim), output projection (no bias). The projections run
    /// over every row; the cache writes and attention over each sequence's rows and cache.
    fn attention(
        &self,
        lw: &LayerW<B::Weight>,
        h: &Prepared<B>,
        inputs: &StepInputs<B>,
        split: &Split<B>,
        caches: &mut [&mut KvCache<B>],
    ) -> Result<B::Buf> {
        let b = &self.backend;
        let c = &self.config;
        let hd = c.attn.head_dim;
        let [mut q, k, v] = b.matmuls_prepared([&lw.q, &lw.k, &lw.v], h)?;
        if let Some(bw) = &lw.q_bias {
            b.add_bias(&mut q, bw)?;
        }
        b.rope_neox(&mut q, hd, hd, c.rope_theta, &inputs.positions)?;
        let a = split.each(b, inputs, vec![q, k, v], |i, inp, parts| {
            let Ok([q, k, v]) = <[B::Buf; 3]>::try_from(parts) else {
                return Err(EngineError::shape("attention", "projection split"));
            };
            let Some(cache) = caches.get_mut(i) else {
                return Err(EngineError::shape(
                    "attention",
                    "a sequence without a cache",
                ));
            };
            self.append_kv(lw, k, v, &inp.positions, cache)?;
            b.attend_causal(
                &q,
                &cache.k.buf,
                &cache.v.buf,
                &inp.positions,
                c.attn,
                c.kv_type,
            )
        })?;
        b.matmul(&lw.o, &a)
    }

    /// The keys and values of `h`'s rows into the cache, without the attention output.
    fn store_kv(
        &self,
        lw: &LayerW<B::Weight>,
        h: &Prepared<B>,
        positions: &B::Ids,
        cache: &mut KvCache<B>,
    ) -> Result<()> {
        let [k, v] = self.backend.matmuls_prepared([&lw.k, &lw.v], h)?;
        self.append_kv(lw, k, v, positions, cache)
    }

    /// Biased, rotated keys and biased values written into the cache at their positions.
    fn append_kv(
        &self,
        lw: &LayerW<B::Weight>,
        mut k: B::Buf,
        mut v: B::Buf,
        positions: &B::Ids,
        cache: &mut KvCache<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        let hd = c.attn.head_dim;
        for (y, bias) in [(&mut k, &lw.k_bias), (&mut v, &lw.v_bias)] {
            if let Some(bw) = bias {
                b.add_bias(y, bw)?;
            }
        }
        b.rope_neox(&mut k, hd, hd, c.rope_theta, positions)?;
        b.write_kv(&mut cache.k.buf, &k, positions, c.kv_type)?;
        b.write_kv(&mut cache.v.buf, &v, positions, c.kv_type)
    }

    /// `down(silu(gate·h) ⊙ up·h)`.
    fn mlp(&self, lw: &LayerW<B::Weight>, h: &Prepared<B>) -> Result<B::Buf> {
        let b = &self.backend;
        let [g, u] = b.matmuls_prepared([&lw.gate, &lw.up], h)?;
        let act = b.swiglu(&g, &u)?;
        b.matmul(&lw.down, &act)
    }

    fn lm_head(&self, x: &B::Buf) -> Result<B::Buf> {
        let b = &self.backend;
        let c = &self.config;
        let out = &self.weights.output;
        let h = b.rms_norm_prepared(x, &self.weights.output_norm, c.n_embd, c.eps, &[out])?;
        let mut y = b.matmul_prepared(out, &h)?;
        if let Some(bw) = &self.weights.output_bias {
            b.add_bias(&mut y, bw)?;
        }
        Ok(y)
    }
}
