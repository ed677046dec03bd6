//! qwen4exp hyper-parameters, read from a GGUF file's metadata as llama.cpp's converter writes
//! them (fixtures/qwen4exp/README.md, "Metadata"). Every required key is checked here, so the
//! forward pass can trust the numbers.

use strata_gguf::{Array, GgufFile};

use super::ops::{GdnDims, QsaRule};
use crate::backend::{AttnDims, KvType};
use crate::error::{EngineError, Result};

pub const ARCH: &str = "qwen4exp";

/// The indexer compress ratio the model documents (`indexer_compress_ratio` = 4 in every
/// published config); used when a converter wrote zeros.
pub const DOCUMENTED_QSA_RATIO: usize = 4;

/// Options chosen by the user at load time.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub qsa_rule: QsaRule,
    /// Block size for QSA layers whose file ratio is 0 (or, when set, for every QSA layer).
    pub qsa_ratio: Option<usize>,
    /// Attention reads K/V at this precision (F16 reproduces llama.cpp's default cache).
    pub kv_type: KvType,
    /// Positions a sequence may hold (the capacity of its caches); None: the file's
    /// `context_length`, or [`DEFAULT_CTX`] when it states none.
    pub ctx: Option<usize>,
}

/// The cache capacity of a file that states no `context_length` (the model's documented
/// native context). The CPU commits cache memory only as positions are used.
pub const DEFAULT_CTX: usize = 262_144;

/// What kind of token mixer a layer has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    Gdn,
    /// Attention; `ratio` is the QSA block size, None for dense causal attention (no indexer).
    Attention { ratio: Option<usize> },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub n_head: usize,
    pub head_dim: usize,
    /// Budget in tokens (`attention.indexer.top_k`); `budget / ratio` blocks are kept.
    pub budget: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub n_expert: usize,
    pub n_used: usize,
    pub ff: usize,
    pub ff_shared: usize,
}

/// The hashed n-gram embedding (spec §5), with its constants from the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleConfig {
    /// 0-based layer the block runs before.
    pub layer: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub conv_kernel: usize,
    pub eos: u32,
    pub head_dim: usize,
    pub multipliers: Vec<u64>,
    pub offsets: Vec<u64>,
    pub vocab_sizes: Vec<u64>,
}

impl PleConfig {
    pub fn n_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    pub fn embed_dim(&self) -> usize {
        self.n_heads() * self.head_dim
    }
    /// Rows the table must have for every head's range.
    pub fn min_rows(&self) -> u64 {
        self.offsets
            .iter()
            .zip(&self.vocab_sizes)
            .map(|(o, v)| o + v)
            .max()
            .unwrap_or(0)
    }
    /// Conv history rows: `(K − 1) · dilation`, dilation = n-gram size.
    pub fn history(&self) -> usize {
        (self.conv_kernel - 1) * self.ngram_size
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_vocab: usize,
    pub hc_streams: usize,
    pub hc_rank: usize,
    pub eps: f32,
    pub attn: AttnDims,
    pub rot_dims: usize,
    pub rope_theta: f32,
    pub gdn: GdnDims,
    pub indexer: IndexerDims,
    pub moe: MoeDims,
    pub ple: Option<PleConfig>,
    pub layers: Vec<LayerKind>,
    pub qsa_rule: QsaRule,
    pub kv_type: KvType,
    /// Positions a sequence may hold: every cache's capacity.
    pub n_ctx: usize,
}

/// Key lookups that name the file and the key in every error.
pub(crate) struct Meta<'a> {
    pub file: &'a GgufFile,
}

impl Meta<'_> {
    pub fn key(&self, k: &str) -> String {
        format!("{ARCH}.{k}")
    }

    pub fn bad(&self, k: &str, problem: impl Into<String>) -> EngineError {
        EngineError::BadKey {
            file: self.file.name().to_string(),
            key: self.key(k),
            problem: problem.into(),
        }
    }

    pub fn usize(&self, k: &str) -> Result<usize> {
        Ok(self.file.get_u32(&self.key(k))? as usize)
    }

    pub fn positive(&self, k: &str) -> Result<usize> {
        let v = self.usize(k)?;
        if v == 0 {
            return Err(self.bad(k, "must be greater than zero, found 0"));
        }
        Ok(v)
    }

    pub fn has(&self, k: &str) -> bool {
        self.file.get(&self.key(k)).is_some()
    }

    /// A per-layer integer array, or a single integer applied to every layer.
    pub fn per_layer_u32(&self, k: &str, n_layer: usize) -> Result<Vec<u32>> {
        let key = self.key(k);
        let v = match self.file.get(&key) {
            Some(strata_gguf::Value::Array(_)) => self.file.get_array_u32(&key)?,
            Some(_) => vec![self.file.get_u32(&key)?; n_layer],
            None => return Err(self.bad(k, "missing; expected one value per layer")),
        };
        if v.len() != n_layer {
            return Err(self.bad(
                k,
                format!(
                    "has {} entries; expected {n_layer} (one per layer)",
                    v.len()
                ),
            ));
        }
        Ok(v)
    }
}

impl Config {
    /// Reads every hyper-parameter; `n_vocab` comes from the embedding tensor (the converter
    /// writes no vocabulary-size key).
    pub(crate) fn from_gguf(file: &GgufFile, n_vocab: usize, opts: &LoadOptions) -> Result<Config> {
        let m = Meta { file };
        let n_embd = m.positive("embedding_length")?;
        let n_layer = m.positive("block_count")?;
        let hc_streams = m.positive("hyper_connection.count")?;
        if hc_streams < 2 {
            return Err(m.bad(
                "hyper_connection.count",
                format!("must be at least 2, found {hc_streams}"),
            ));
        }
        let hc_rank = m.positive("hyper_connection.low_rank")?;
        let eps = file.get_f32(&m.key("attention.layer_norm_rms_epsilon"))?;

        let n_head = m.positive("attention.head_count")?;
        let n_head_kv = m.positive("attention.head_count_kv")?;
        let head_dim = m.positive("attention.key_length")?;
        let v_len = m.usize("attention.value_length")?;
        if v_len != head_dim {
            return Err(m.bad(
                "attention.value_length",
                format!("{v_len}; expected {head_dim} (= key_length)"),
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(m.bad(
                "attention.head_count_kv",
                format!("{n_head_kv} does not divide head_count {n_head}"),
            ));
        }
        let rot_dims = m.usize("rope.dimension_count")?;
        if rot_dims % 2 != 0 || rot_dims > head_dim {
            return Err(m.bad(
                "rope.dimension_count",
                format!("{rot_dims}; expected an even number ≤ key_length {head_dim}"),
            ));
        }
        let rope_theta = file.get_f32(&m.key("rope.freq_base"))?;

        let gdn = GdnDims {
            n_k_heads: m.positive("ssm.group_count")?,
            n_v_heads: m.positive("ssm.time_step_rank")?,
            head_k: m.positive("ssm.state_size")?,
            head_v: m.positive("ssm.state_size")?,
            conv_kernel: m.positive("ssm.conv_kernel")?,
        };
        if !gdn.n_v_heads.is_multiple_of(gdn.n_k_heads) {
            return Err(m.bad(
                "ssm.time_step_rank",
                format!(
                    "{} value heads are not a multiple of {} key heads",
                    gdn.n_v_heads, gdn.n_k_heads
                ),
            ));
        }
        let inner = m.usize("ssm.inner_size")?;
        if inner != gdn.value_dim() {
            return Err(m.bad(
                "ssm.inner_size",
                format!(
                    "{inner}; expected {} (value heads × state size)",
                    gdn.value_dim()
                ),
            ));
        }

        let moe = MoeDims {
            n_expert: m.positive("expert_count")?,
            n_used: m.positive("expert_used_count")?,
            ff: m.positive("expert_feed_forward_length")?,
            ff_shared: m.positive("expert_shared_feed_forward_length")?,
        };
        if moe.n_used > moe.n_expert {
            return Err(m.bad(
                "expert_used_count",
                format!("{} > expert_count {}", moe.n_used, moe.n_expert),
            ));
        }

        let indexer = IndexerDims {
            n_head: m.positive("attention.indexer.head_count")?,
            head_dim: m.positive("attention.indexer.key_length")?,
            budget: m.positive("attention.indexer.top_k")?,
        };
        if rot_dims > indexer.head_dim {
            return Err(m.bad(
                "attention.indexer.key_length",
                format!(
                    "{}; smaller than the rotary dims {rot_dims}",
                    indexer.head_dim
                ),
            ));
        }

        let recurrent = Self::recurrent_layers(&m, n_layer)?;
        let ratios = if m.has("attention.compress_ratios") {
            m.per_layer_u32("attention.compress_ratios", n_layer)?
        } else {
            vec![0; n_layer]
        };
        let layers = recurrent
            .iter()
            .zip(&ratios)
            .map(|(&rec, &r)| {
                if rec {
                    LayerKind::Gdn
                } else {
                    LayerKind::Attention {
                        ratio: (r > 0).then_some(r as usize),
                    }
                }
            })
            .collect::<Vec<_>>();

        let ple = Self::ple(&m, n_layer)?;
        if let Some(p) = &ple {
            if recurrent.get(p.layer) != Some(&true) {
                return Err(m.bad(
                    "ple.layers",
                    format!("layer {} is not a linear-attention layer", p.layer),
                ));
            }
        }

        Ok(Config {
            n_embd,
            n_layer,
            n_vocab,
            hc_streams,
            hc_rank,
            eps,
            attn: AttnDims {
                n_head,
                n_head_kv,
                head_dim,
            },
            rot_dims,
            rope_theta,
            gdn,
            indexer,
            moe,
            ple,
            layers,
            qsa_rule: opts.qsa_rule,
            kv_type: opts.kv_type,
            n_ctx: match opts.ctx {
                Some(0) => {
                    return Err(EngineError::Input(
                        "--ctx must be greater than zero".to_string(),
                    ))
                }
                Some(n) => n,
                None => m
                    .file
                    .get_u32_or(&m.key("context_length"), DEFAULT_CTX as u32)?
                    as usize,
            },
        })
    }

    fn recurrent_layers(m: &Meta<'_>, n_layer: usize) -> Result<Vec<bool>> {
        let k = "attention.recurrent_layers";
        if let Some(v) = m.file.get(&m.key(k)) {
            let flags: Vec<bool> = match v.as_array() {
                Some(Array::Bool(b)) => b.clone(),
                Some(_) => m
                    .file
                    .get_array_u32(&m.key(k))?
                    .into_iter()
                    .map(|i| i != 0)
                    .collect(),
                None => {
                    return Err(m.bad(k, format!("{}; expected an array of bool", v.describe())))
                }
            };
            if flags.len() != n_layer {
                return Err(m.bad(
                    k,
                    format!("has {} entries; expected {n_layer}", flags.len()),
                ));
            }
            return Ok(flags);
        }
        let interval = m.file.get_u32_or(&m.key("full_attention_interval"), 4)? as usize;
        if interval == 0 {
            return Err(m.bad(
                "full_attention_interval",
                "must be greater than zero, found 0",
            ));
        }
        Ok((0..n_layer).map(|i| (i + 1) % interval != 0).collect())
    }

    fn ple(m: &Meta<'_>, n_layer: usize) -> Result<Option<PleConfig>> {
        if !m.has("ple.layers") {
            return Ok(None);
        }
        let layers = m.file.get_array_u32(&m.key("ple.layers"))?;
        let layer = match layers.as_slice() {
            [] => return Ok(None),
            [l] => *l as usize,
            _ => {
                return Err(m.bad(
                    "ple.layers",
                    format!("lists {} layers; one PLE layer is supported", layers.len()),
                ))
            }
        };
        if layer >= n_layer {
            return Err(m.bad(
                "ple.layers",
                format!("layer {layer} is out of range (block_count {n_layer})"),
            ));
        }
        let ngram_size = m.usize("ple.ngram_size")?;
        if ngram_size < 2 {
            return Err(m.bad(
                "ple.ngram_size",
                format!("{ngram_size}; expected at least 2"),
            ));
        }
        let p = PleConfig {
            layer,
            ngram_size,
            heads_per_ngram: m.positive("ple.heads_per_ngram")?,
            conv_kernel: m.positive("ple.conv_kernel")?,
            eos: m.file.get_u32(&m.key("ple.eos_token_id"))?,
            head_dim: m.positive("embedding_length_per_layer_input")?,
            multipliers: m.file.get_array_u64(&m.key("ple.layer_multipliers"))?,
            offsets: m.file.get_array_u64(&m.key("ple.head_offsets"))?,
            vocab_sizes: m.file.get_array_u64(&m.key("ple.head_vocab_sizes"))?,
        };
        if p.multipliers.len() < ngram_size {
            return Err(m.bad(
                "ple.layer_multipliers",
                format!("has {} entries; expected {ngram_size}", p.multipliers.len()),
            ));
        }
        for (k, arr) in [
            ("ple.head_offsets", &p.offsets),
            ("ple.head_vocab_sizes", &p.vocab_sizes),
        ] {
            if arr.len() < p.n_heads() {
                return Err(m.bad(
                    k,
                    format!("has {} entries; expected {}", arr.len(), p.n_heads()),
                ));
            }
        }
        if let Some(i) = p.vocab_sizes.iter().take(p.n_heads()).position(|&v| v == 0) {
            return Err(m.bad(
                "ple.head_vocab_sizes",
                format!("head {i} has vocabulary size 0"),
            ));
        }
        if p.offsets
            .iter()
            .zip(&p.vocab_sizes)
            .any(|(o, v)| o.checked_add(*v).is_none())
        {
            return Err(m.bad("ple.head_offsets", "a head range overflows u64"));
        }
        Ok(Some(p))
    }

    pub fn gdn_dims(&self) -> GdnDims {
        self.gdn
    }

    /// The residual width S·H.
    pub fn residual_dim(&self) -> usize {
        self.hc_streams * self.n_embd
    }
}
