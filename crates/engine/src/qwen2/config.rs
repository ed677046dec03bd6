//! qwen2 hyper-parameters, read from a GGUF file's metadata as llama.cpp's converter writes them
//! (`qwen2.*` keys). Every key the forward pass relies on is checked here.

use strata_gguf::GgufFile;

use crate::backend::{AttnDims, KvType};
use crate::error::{EngineError, Result};

pub const ARCH: &str = "qwen2";

/// Options chosen by the user at load time.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Attention reads K/V at this precision (F16 reproduces llama.cpp's default cache).
    pub kv_type: KvType,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_vocab: usize,
    pub n_ff: usize,
    /// Positions the model was trained for (`context_length`): the session limit.
    pub n_ctx_train: usize,
    pub eps: f32,
    pub attn: AttnDims,
    pub rope_theta: f32,
    pub kv_type: KvType,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.attn.n_head * self.attn.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.attn.n_head_kv * self.attn.head_dim
    }

    /// Reads every hyper-parameter; `n_vocab` comes from the embedding tensor.
    pub(crate) fn from_gguf(file: &GgufFile, n_vocab: usize, opts: &LoadOptions) -> Result<Config> {
        let key = |k: &str| format!("{ARCH}.{k}");
        let bad = |k: &str, problem: String| EngineError::BadKey {
            file: file.name().to_string(),
            key: key(k),
            problem,
        };
        let positive = |k: &str| -> Result<usize> {
            let v = file.get_u32(&key(k))? as usize;
            if v == 0 {
                return Err(bad(k, "must be greater than zero, found 0".to_string()));
            }
            Ok(v)
        };
        let n_embd = positive("embedding_length")?;
        let n_layer = positive("block_count")?;
        let n_ff = positive("feed_forward_length")?;
        let n_head = positive("attention.head_count")?;
        let n_head_kv = positive("attention.head_count_kv")?;
        if n_head % n_head_kv != 0 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{n_head_kv} does not divide head_count {n_head}"),
            ));
        }
        let default_hd = if n_embd % n_head == 0 {
            n_embd / n_head
        } else {
            0
        };
        let head_dim = file.get_u32_or(&key("attention.key_length"), default_hd as u32)? as usize;
        let v_len = file.get_u32_or(&key("attention.value_length"), head_dim as u32)? as usize;
        if head_dim == 0 || !head_dim.is_multiple_of(2) || v_len != head_dim {
            return Err(bad(
                "attention.key_length",
                format!(
                    "head size {head_dim} (value {v_len}); expected an even size equal for keys \
                     and values (embedding_length {n_embd} / head_count {n_head} by default)"
                ),
            ));
        }
        let rot = file.get_u32_or(&key("rope.dimension_count"), head_dim as u32)? as usize;
        if rot != head_dim {
            return Err(bad(
                "rope.dimension_count",
                format!("{rot}; qwen2 rotates whole heads ({head_dim})"),
            ));
        }
        // Scaled RoPE (YaRN for long contexts) changes the rotation; refuse it rather than run
        // with the wrong one.
        if file.get(&key("rope.scaling.type")).is_some() {
            let kind = file.get_str(&key("rope.scaling.type"))?;
            if kind != "none" {
                return Err(bad(
                    "rope.scaling.type",
                    format!("'{kind}' is not supported; expected 'none'"),
                ));
            }
        }
        let rope_theta = file.get_f32_or(&key("rope.freq_base"), 10000.0)?;
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(bad(
                "rope.freq_base",
                format!("{rope_theta}; expected a finite base above 1"),
            ));
        }
        let eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad(
                "attention.layer_norm_rms_epsilon",
                format!("{eps}; expected a small positive number"),
            ));
        }
        let n_ctx_train = positive("context_length")?;
        Ok(Config {
            n_embd,
            n_layer,
            n_vocab,
            n_ff,
            n_ctx_train,
            eps,
            attn: AttnDims {
                n_head,
                n_head_kv,
                head_dim,
            },
            rope_theta,
            kv_type: opts.kv_type,
        })
    }
}
