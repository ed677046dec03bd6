//! Binding a qwen2 GGUF's tensors (llama.cpp's names and layout) to the backend: every tensor is
//! looked up by name, its shape checked against the hyper-parameters and its type against what
//! the backend can do with it, before any of it is used.

use std::sync::Arc;

use strata_gguf::GgufFile;

use crate::backend::{Backend, Usage};
use crate::error::Result;
use crate::qwen4exp::weights::Binder;

use super::config::Config;

/// One decoder block. The q/k/v biases are what set Qwen2 apart from Llama; they are optional
/// so that bias-free exports of the same graph load too.
pub struct LayerW<W> {
    pub attn_norm: W,
    pub q: W,
    pub k: W,
    pub v: W,
    pub q_bias: Option<W>,
    pub k_bias: Option<W>,
    pub v_bias: Option<W>,
    pub o: W,
    pub ffn_norm: W,
    pub gate: W,
    pub up: W,
    pub down: W,
}

pub struct Weights<W> {
    pub token_embd: W,
    pub output_norm: W,
    /// `output.weight`, or the embedding when the file ties them (no `output.weight`).
    pub output: W,
    pub output_bias: Option<W>,
    pub tied: bool,
    pub layers: Vec<LayerW<W>>,
}

pub(crate) fn bind<B: Backend>(
    file: &Arc<GgufFile>,
    backend: &B,
    c: &Config,
) -> Result<Weights<B::Weight>> {
    let bd = Binder { file, backend };
    let (h, v, ff) = (c.n_embd, c.n_vocab, c.n_ff);
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    let token_embd = bd.get("token_embd.weight", &[&[h, v]], Usage::Rows)?;
    let (output, tied) = match bd.opt("output.weight", &[&[h, v]], Usage::MatMul)? {
        Some(w) => (w, false),
        None => (
            bd.get("token_embd.weight", &[&[h, v]], Usage::MatMul)?,
            true,
        ),
    };
    let output_bias = bd.opt("output.bias", &[&[v]], Usage::Values)?;
    let output_norm = bd.get("output_norm.weight", &[&[h]], Usage::Values)?;
    let mut layers = Vec::with_capacity(c.n_layer);
    for l in 0..c.n_layer {
        let p = |n: &str| format!("blk.{l}.{n}");
        layers.push(LayerW {
            attn_norm: bd.get(&p("attn_norm.weight"), &[&[h]], Usage::Values)?,
            q: bd.get(&p("attn_q.weight"), &[&[h, qd]], Usage::MatMul)?,
            k: bd.get(&p("attn_k.weight"), &[&[h, kvd]], Usage::MatMul)?,
            v: bd.get(&p("attn_v.weight"), &[&[h, kvd]], Usage::MatMul)?,
            q_bias: bd.opt(&p("attn_q.bias"), &[&[qd]], Usage::Values)?,
            k_bias: bd.opt(&p("attn_k.bias"), &[&[kvd]], Usage::Values)?,
            v_bias: bd.opt(&p("attn_v.bias"), &[&[kvd]], Usage::Values)?,
            o: bd.get(&p("attn_output.weight"), &[&[qd, h]], Usage::MatMul)?,
            ffn_norm: bd.get(&p("ffn_norm.weight"), &[&[h]], Usage::Values)?,
            gate: bd.get(&p("ffn_gate.weight"), &[&[h, ff]], Usage::MatMul)?,
            up: bd.get(&p("ffn_up.weight"), &[&[h, ff]], Usage::MatMul)?,
            down: bd.get(&p("ffn_down.weight"), &[&[ff, h]], Usage::MatMul)?,
        });
    }
    Ok(Weights {
        token_embd,
        output_norm,
        output,
        output_bias,
        tied,
        layers,
    })
}
