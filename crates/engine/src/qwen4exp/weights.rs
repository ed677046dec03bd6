//! Binding a qwen4exp GGUF's tensors (llama.cpp's layout, fixtures/qwen4exp/README.md) to the
//! backend: every tensor is looked up by name, its shape checked against the hyper-parameters and
//! its type against what the backend can do with it, before any of it is used.

use std::sync::Arc;

use strata_gguf::GgufFile;

use crate::backend::{Backend, Usage};
use crate::error::{type_name, EngineError, Result};

use super::config::{Config, LayerKind};

pub struct HcW<W> {
    pub norm: W,
    pub down: W,
    pub up: W,
    pub inject: Option<W>,
}

/// Gated DeltaNet projections and constants (value heads in the file's tiled order).
pub struct GdnW<W> {
    pub qkv: W,
    pub z: W,
    pub alpha: W,
    pub beta: W,
    pub a: W,
    pub dt_bias: W,
    pub conv: W,
    pub norm: W,
    pub out: W,
}

pub struct IndexerW<W> {
    pub q: W,
    pub k: W,
    pub q_norm: W,
    pub k_norm: W,
}

pub struct AttnW<W> {
    /// Per head `[q | gate]`.
    pub q: W,
    pub k: W,
    pub v: W,
    pub o: W,
    pub q_norm: W,
    pub k_norm: W,
    pub indexer: Option<IndexerW<W>>,
}

pub enum MixerW<W> {
    Gdn(GdnW<W>),
    Attn(AttnW<W>),
}

pub struct MoeW<W> {
    pub router: W,
    pub gate_exps: W,
    pub up_exps: W,
    pub down_exps: W,
    pub gate_shexp: W,
    pub up_shexp: W,
    pub down_shexp: W,
    pub shexp_gate: W,
}

pub struct PleW<W> {
    pub key: W,
    pub value: W,
    pub norm_key: W,
    pub norm_query: W,
    pub norm_conv: W,
    pub conv: W,
}

pub struct LayerW<W> {
    pub hc_attn: HcW<W>,
    pub hc_ffn: HcW<W>,
    pub mixer: MixerW<W>,
    pub moe: MoeW<W>,
    pub ple: Option<PleW<W>>,
}

pub struct Weights<W> {
    pub token_embd: W,
    pub output: W,
    pub output_hc: HcW<W>,
    pub ple_table: Option<W>,
    pub layers: Vec<LayerW<W>>,
}

/// Looks tensors up, checks them and hands them to the backend.
pub(crate) struct Binder<'a, B: Backend> {
    pub file: &'a Arc<GgufFile>,
    pub backend: &'a B,
}

impl<B: Backend> Binder<'_, B> {
    fn file_name(&self) -> String {
        self.file.name().to_string()
    }

    /// The tensor `name`, which must have one of `shapes` and a type usable for `usage`.
    pub fn get(&self, name: &str, shapes: &[&[usize]], usage: Usage) -> Result<B::Weight> {
        self.opt(name, shapes, usage)?
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.file_name(),
                tensor: name.to_string(),
                expected: format!("shape {}", describe(shapes)),
            })
    }

    pub fn opt(&self, name: &str, shapes: &[&[usize]], usage: Usage) -> Result<Option<B::Weight>> {
        let Some(info) = self.file.tensor(name) else {
            return Ok(None);
        };
        if !shapes.iter().any(|s| {
            s.len() == info.dims.len() && s.iter().zip(&info.dims).all(|(&a, &b)| a as u64 == b)
        }) {
            return Err(EngineError::TensorShape {
                file: self.file_name(),
                tensor: name.to_string(),
                found: info.dims.clone(),
                expected: shapes
                    .first()
                    .map(|s| s.iter().map(|&d| d as u64).collect())
                    .unwrap_or_default(),
            });
        }
        let ty = strata_quant::GgmlType::from_id(info.ty.id());
        match ty {
            Some(t) if self.backend.supports(t, usage) => {}
            _ => {
                return Err(EngineError::UnsupportedType {
                    file: self.file_name(),
                    tensor: name.to_string(),
                    ty: type_name(ty, info.ty.id()),
                    backend: self.backend.name().to_string(),
                    usage: usage.describe(),
                })
            }
        }
        Ok(Some(self.backend.load_weight(self.file, info)?))
    }

    pub fn hc(&self, prefix: &str, c: &Config, inject: bool) -> Result<HcW<B::Weight>> {
        let (h, s, r) = (c.n_embd, c.hc_streams, c.hc_rank);
        let sh = s * h;
        Ok(HcW {
            norm: self.get(
                &format!("{prefix}_norm.weight"),
                &[&[sh], &[h, s]],
                Usage::Values,
            )?,
            down: self.get(&format!("{prefix}_down.weight"), &[&[sh, r]], Usage::MatMul)?,
            up: self.get(&format!("{prefix}_up.weight"), &[&[r, sh]], Usage::MatMul)?,
            inject: if inject {
                Some(self.get(
                    &format!("{prefix}_inject.weight"),
                    &[&[sh, s]],
                    Usage::MatMul,
                )?)
            } else {
                None
            },
        })
    }

    fn gdn(&self, l: usize, c: &Config) -> Result<GdnW<B::Weight>> {
        let p = |n: &str| format!("blk.{l}.{n}");
        let h = c.n_embd;
        let d = c.gdn;
        let (conv, vd, nv) = (d.conv_dim(), d.value_dim(), d.n_v_heads);
        Ok(GdnW {
            qkv: self.get(&p("attn_qkv.weight"), &[&[h, conv]], Usage::MatMul)?,
            z: self.get(&p("attn_gate.weight"), &[&[h, vd]], Usage::MatMul)?,
            alpha: self.get(&p("ssm_alpha.weight"), &[&[h, nv]], Usage::MatMul)?,
            beta: self.get(&p("ssm_beta.weight"), &[&[h, nv]], Usage::MatMul)?,
            a: self.get(&p("ssm_a"), &[&[nv]], Usage::Values)?,
            dt_bias: self.get(&p("ssm_dt.bias"), &[&[nv]], Usage::Values)?,
            conv: self.get(
                &p("ssm_conv1d.weight"),
                &[&[d.conv_kernel, conv]],
                Usage::Values,
            )?,
            norm: self.get(&p("ssm_norm.weight"), &[&[d.head_v]], Usage::Values)?,
            out: self.get(&p("ssm_out.weight"), &[&[vd, h]], Usage::MatMul)?,
        })
    }

    /// The attention tensors under `blk` (`blk.N` in the trunk, `mtp.blk.0` in the MTP head).
    pub fn attn(&self, blk: &str, c: &Config) -> Result<AttnW<B::Weight>> {
        let p = |n: &str| format!("{blk}.{n}");
        let h = c.n_embd;
        let a = c.attn;
        let (hd, qd, kvd) = (a.head_dim, a.n_head * a.head_dim, a.n_head_kv * a.head_dim);
        let ix = &c.indexer;
        let names = [
            "indexer.q_proj.weight",
            "indexer.k_proj.weight",
            "indexer.q_norm.weight",
            "indexer.k_norm.weight",
        ];
        let present = names
            .iter()
            .filter(|n| self.file.tensor(&p(n)).is_some())
            .count();
        let indexer = if present == 0 {
            None
        } else {
            Some(IndexerW {
                q: self.get(
                    &p(names[0]),
                    &[&[h, ix.n_head * ix.head_dim]],
                    Usage::MatMul,
                )?,
                k: self.get(&p(names[1]), &[&[h, ix.head_dim]], Usage::MatMul)?,
                q_norm: self.get(&p(names[2]), &[&[ix.head_dim]], Usage::Values)?,
                k_norm: self.get(&p(names[3]), &[&[ix.head_dim]], Usage::Values)?,
            })
        };
        Ok(AttnW {
            q: self.get(&p("attn_q.weight"), &[&[h, 2 * qd]], Usage::MatMul)?,
            k: self.get(&p("attn_k.weight"), &[&[h, kvd]], Usage::MatMul)?,
            v: self.get(&p("attn_v.weight"), &[&[h, kvd]], Usage::MatMul)?,
            o: self.get(&p("attn_output.weight"), &[&[qd, h]], Usage::MatMul)?,
            q_norm: self.get(&p("attn_q_norm.weight"), &[&[hd]], Usage::Values)?,
            k_norm: self.get(&p("attn_k_norm.weight"), &[&[hd]], Usage::Values)?,
            indexer,
        })
    }

    pub fn moe(&self, blk: &str, c: &Config) -> Result<MoeW<B::Weight>> {
        let p = |n: &str| format!("{blk}.{n}");
        let h = c.n_embd;
        let m = &c.moe;
        let (e, i, is) = (m.n_expert, m.ff, m.ff_shared);
        Ok(MoeW {
            router: self.get(&p("ffn_gate_inp.weight"), &[&[h, e]], Usage::MatMul)?,
            gate_exps: self.get(&p("ffn_gate_exps.weight"), &[&[h, i, e]], Usage::MatMul)?,
            up_exps: self.get(&p("ffn_up_exps.weight"), &[&[h, i, e]], Usage::MatMul)?,
            down_exps: self.get(&p("ffn_down_exps.weight"), &[&[i, h, e]], Usage::MatMul)?,
            gate_shexp: self.get(&p("ffn_gate_shexp.weight"), &[&[h, is]], Usage::MatMul)?,
            up_shexp: self.get(&p("ffn_up_shexp.weight"), &[&[h, is]], Usage::MatMul)?,
            down_shexp: self.get(&p("ffn_down_shexp.weight"), &[&[is, h]], Usage::MatMul)?,
            shexp_gate: self.get(
                &p("ffn_gate_inp_shexp.weight"),
                &[&[h], &[h, 1]],
                Usage::MatMul,
            )?,
        })
    }

    fn ple(&self, l: usize, c: &Config) -> Result<PleW<B::Weight>> {
        let p = |n: &str| format!("blk.{l}.{n}");
        let (h, s) = (c.n_embd, c.hc_streams);
        let sh = s * h;
        let (ed, k) = match &c.ple {
            Some(pc) => (pc.embed_dim(), pc.conv_kernel),
            None => (0, 0),
        };
        Ok(PleW {
            key: self.get(&p("ple_key.weight"), &[&[ed, sh]], Usage::MatMul)?,
            value: self.get(&p("ple_value.weight"), &[&[ed, h]], Usage::MatMul)?,
            norm_key: self.get(&p("ple_norm_key.weight"), &[&[sh], &[h, s]], Usage::Values)?,
            norm_query: self.get(
                &p("ple_norm_query.weight"),
                &[&[sh], &[h, s]],
                Usage::Values,
            )?,
            norm_conv: self.get(&p("ple_norm_conv.weight"), &[&[sh], &[h, s]], Usage::Values)?,
            conv: self.get(&p("ple_conv1d.weight"), &[&[k, sh]], Usage::Values)?,
        })
    }

    /// Every tensor of the model.
    pub fn weights(&self, c: &Config) -> Result<Weights<B::Weight>> {
        let (h, v) = (c.n_embd, c.n_vocab);
        let token_embd = self.get("token_embd.weight", &[&[h, v]], Usage::Rows)?;
        // An untied head is the norm for qwen4exp; a file without one reuses the embedding, as
        // llama.cpp does.
        let output = match self.opt("output.weight", &[&[h, v]], Usage::MatMul)? {
            Some(w) => w,
            None => self.get("token_embd.weight", &[&[h, v]], Usage::MatMul)?,
        };
        let output_hc = self.hc("output_hc", c, false)?;
        let ple_table = match &c.ple {
            Some(pc) => {
                let name = "per_layer_token_embd.weight";
                let info = self
                    .file
                    .tensor(name)
                    .ok_or_else(|| EngineError::MissingTensor {
                        file: self.file_name(),
                        tensor: name.to_string(),
                        expected: format!(
                            "shape [{}, ≥{}] (the n-gram table)",
                            pc.head_dim,
                            pc.min_rows()
                        ),
                    })?;
                let rows = info.ne(1);
                if info.dims.len() != 2 || rows < pc.min_rows() {
                    return Err(EngineError::TensorShape {
                        file: self.file_name(),
                        tensor: name.to_string(),
                        found: info.dims.clone(),
                        expected: vec![pc.head_dim as u64, pc.min_rows()],
                    });
                }
                Some(self.get(name, &[&[pc.head_dim, rows as usize]], Usage::Rows)?)
            }
            None => None,
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        for (l, kind) in c.layers.iter().enumerate() {
            let mixer = match kind {
                LayerKind::Gdn => MixerW::Gdn(self.gdn(l, c)?),
                LayerKind::Attention { .. } => MixerW::Attn(self.attn(&format!("blk.{l}"), c)?),
            };
            let ple = match &c.ple {
                Some(pc) if pc.layer == l => Some(self.ple(l, c)?),
                _ => None,
            };
            layers.push(LayerW {
                hc_attn: self.hc(&format!("blk.{l}.hc_attn"), c, true)?,
                hc_ffn: self.hc(&format!("blk.{l}.hc_ffn"), c, true)?,
                mixer,
                moe: self.moe(&format!("blk.{l}"), c)?,
                ple,
            });
        }
        Ok(Weights {
            token_embd,
            output,
            output_hc,
            ple_table,
            layers,
        })
    }
}

fn describe(shapes: &[&[usize]]) -> String {
    shapes
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(" or ")
}
