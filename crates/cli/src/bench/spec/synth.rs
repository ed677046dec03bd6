//! A synthetic qwen4exp trunk and MTP head at a chosen geometry, for `strata bench spec
//! --synthetic`: random but sane weights (Q8_0 matrices, F32 norms and routers) in llama.cpp's
//! layout and the MTP-GGUF layout, built in memory. The small fixture's weights fit in the CPU's
//! caches, so a verify window there costs about N single steps; a model whose weights must come
//! from memory each step is where speculation pays, and this is how to measure that without a
//! real checkpoint. Without PLE (it costs little and needs a table of its own).

use std::sync::Arc;

use anyhow::{bail, Result};
use strata_gguf::{Array, GgufFile, GgufWriter, Value};
use strata_quant::synth::SplitMix64;
use strata_quant::GgmlType;

/// The geometry of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub h: usize,
    pub layers: usize,
    pub experts: usize,
    pub used: usize,
    pub ff: usize,
    pub ff_shared: usize,
    pub vocab: usize,
    pub hc_rank: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub gdn_k_heads: usize,
    pub gdn_v_heads: usize,
    pub gdn_head: usize,
    pub ix_heads: usize,
    pub ix_dim: usize,
    pub budget: usize,
    pub ratio: usize,
}

const S: usize = 4;

impl Geometry {
    /// Named presets.
    pub fn preset(name: &str) -> Result<Geometry> {
        Ok(match name {
            // ~0.56 GB in Q8_0, ~0.2 GB read per token: memory-bound on a CPU core.
            "medium" => Geometry {
                h: 1024,
                layers: 8,
                experts: 32,
                used: 8,
                ff: 512,
                ff_shared: 512,
                vocab: 32768,
                hc_rank: 128,
                n_head: 8,
                n_head_kv: 2,
                head_dim: 128,
                gdn_k_heads: 4,
                gdn_v_heads: 8,
                gdn_head: 128,
                ix_heads: 4,
                ix_dim: 64,
                budget: 256,
                ratio: 4,
            },
            // Flash-Next's proportions at 1/5 of the width and 1/8 of the depth.
            "flash-mini" => Geometry {
                h: 512,
                layers: 6,
                experts: 128,
                used: 10,
                ff: 128,
                ff_shared: 128,
                vocab: 65536,
                hc_rank: 64,
                n_head: 8,
                n_head_kv: 2,
                head_dim: 64,
                gdn_k_heads: 4,
                gdn_v_heads: 12,
                gdn_head: 32,
                ix_heads: 4,
                ix_dim: 32,
                budget: 512,
                ratio: 4,
            },
            other => bail!("unknown synthetic model '{other}'; expected medium or flash-mini"),
        })
    }

    fn sh(&self) -> usize {
        S * self.h
    }
    fn conv_dim(&self) -> usize {
        2 * self.gdn_k_heads * self.gdn_head + self.gdn_v_heads * self.gdn_head
    }
    fn is_attn(&self, l: usize) -> bool {
        l % 4 == 3
    }
}

/// Random values drawn once and reused at varying offsets: timings need the bytes to exist and
/// the routing to vary, not independent weights.
struct Pool {
    vals: Vec<f32>,
    at: usize,
}

impl Pool {
    fn new(seed: u64) -> Pool {
        let mut rng = SplitMix64(seed);
        Pool {
            vals: (0..(1 << 22) + 7).map(|_| rng.next_normal()).collect(),
            at: 0,
        }
    }

    fn take(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let start = self.at % self.vals.len();
            let len = (n - out.len()).min(self.vals.len() - start);
            out.extend(
                self.vals[start..start + len]
                    .iter()
                    .map(|v| v * scale + offset),
            );
            self.at = start + len + 7919;
        }
        out
    }
}

struct Builder {
    w: GgufWriter,
    pool: Pool,
}

impl Builder {
    /// A matrix `{dims}` (ggml order), normal(0, 1/sqrt(row length)), in Q8_0 when its rows
    /// allow, else F32.
    fn matrix(&mut self, name: &str, dims: &[usize]) -> Result<()> {
        let row = dims[0];
        let n: usize = dims.iter().product();
        let vals = self.pool.take(n, 1.0 / (row as f32).sqrt(), 0.0);
        let dims64: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if row.is_multiple_of(32) {
            let rb = GgmlType::Q8_0.row_bytes(row).unwrap_or(0);
            let mut data = vec![0u8; n / row * rb];
            for (src, dst) in vals.chunks(row).zip(data.chunks_mut(rb)) {
                strata_quant::legacy::quantize_row_q8_0_ref(src, dst);
            }
            self.w
                .add_tensor_owned(name, &dims64, GgmlType::Q8_0, data)?;
        } else {
            self.f32(name, dims, &vals)?;
        }
        Ok(())
    }

    fn f32(&mut self, name: &str, dims: &[usize], vals: &[f32]) -> Result<()> {
        let dims64: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.w
            .add_tensor_owned(name, &dims64, GgmlType::F32, data)?;
        Ok(())
    }

    /// F32 values around `offset` (norms folded as 1 + w sit around 1).
    fn values(&mut self, name: &str, dims: &[usize], scale: f32, offset: f32) -> Result<()> {
        let vals = self.pool.take(dims.iter().product(), scale, offset);
        self.f32(name, dims, &vals)
    }

    fn hc(&mut self, p: &str, g: &Geometry, inject: bool) -> Result<()> {
        let (sh, r) = (g.sh(), g.hc_rank);
        self.values(&format!("{p}_norm.weight"), &[sh], 0.1, 1.0)?;
        self.matrix(&format!("{p}_down.weight"), &[sh, r])?;
        self.matrix(&format!("{p}_up.weight"), &[r, sh])?;
        if inject {
            self.matrix(&format!("{p}_inject.weight"), &[sh, S])?;
        }
        Ok(())
    }

    fn attn(&mut self, b: &str, g: &Geometry) -> Result<()> {
        let (h, hd) = (g.h, g.head_dim);
        self.matrix(&format!("{b}.attn_q.weight"), &[h, 2 * g.n_head * hd])?;
        self.matrix(&format!("{b}.attn_k.weight"), &[h, g.n_head_kv * hd])?;
        self.matrix(&format!("{b}.attn_v.weight"), &[h, g.n_head_kv * hd])?;
        self.matrix(&format!("{b}.attn_output.weight"), &[g.n_head * hd, h])?;
        self.values(&format!("{b}.attn_q_norm.weight"), &[hd], 0.1, 1.0)?;
        self.values(&format!("{b}.attn_k_norm.weight"), &[hd], 0.1, 1.0)?;
        self.matrix(
            &format!("{b}.indexer.q_proj.weight"),
            &[h, g.ix_heads * g.ix_dim],
        )?;
        self.matrix(&format!("{b}.indexer.k_proj.weight"), &[h, g.ix_dim])?;
        self.values(&format!("{b}.indexer.q_norm.weight"), &[g.ix_dim], 0.1, 1.0)?;
        self.values(&format!("{b}.indexer.k_norm.weight"), &[g.ix_dim], 0.1, 1.0)
    }

    fn moe(&mut self, b: &str, g: &Geometry) -> Result<()> {
        let (h, e) = (g.h, g.experts);
        self.values(
            &format!("{b}.ffn_gate_inp.weight"),
            &[h, e],
            1.0 / (h as f32).sqrt(),
            0.0,
        )?;
        self.matrix(&format!("{b}.ffn_gate_exps.weight"), &[h, g.ff, e])?;
        self.matrix(&format!("{b}.ffn_up_exps.weight"), &[h, g.ff, e])?;
        self.matrix(&format!("{b}.ffn_down_exps.weight"), &[g.ff, h, e])?;
        self.matrix(&format!("{b}.ffn_gate_shexp.weight"), &[h, g.ff_shared])?;
        self.matrix(&format!("{b}.ffn_up_shexp.weight"), &[h, g.ff_shared])?;
        self.matrix(&format!("{b}.ffn_down_shexp.weight"), &[g.ff_shared, h])?;
        self.values(
            &format!("{b}.ffn_gate_inp_shexp.weight"),
            &[h, 1],
            1.0 / (h as f32).sqrt(),
            0.0,
        )
    }

    fn gdn(&mut self, b: &str, g: &Geometry) -> Result<()> {
        let (h, nv) = (g.h, g.gdn_v_heads);
        let vd = nv * g.gdn_head;
        self.matrix(&format!("{b}.attn_qkv.weight"), &[h, g.conv_dim()])?;
        self.matrix(&format!("{b}.attn_gate.weight"), &[h, vd])?;
        self.matrix(&format!("{b}.ssm_alpha.weight"), &[h, nv])?;
        self.matrix(&format!("{b}.ssm_beta.weight"), &[h, nv])?;
        // ssm_a = −exp(A_log) with A_log = log U(1, 16): values in [−16, −1].
        let a: Vec<f32> = (0..nv)
            .map(|i| -1.0 - (i * 15 / nv.max(1)) as f32)
            .collect();
        self.f32(&format!("{b}.ssm_a"), &[nv], &a)?;
        self.values(&format!("{b}.ssm_dt.bias"), &[nv], 0.2, 0.0)?;
        self.values(
            &format!("{b}.ssm_conv1d.weight"),
            &[4, g.conv_dim()],
            0.5,
            0.0,
        )?;
        self.values(&format!("{b}.ssm_norm.weight"), &[g.gdn_head], 0.1, 1.0)?;
        self.matrix(&format!("{b}.ssm_out.weight"), &[vd, h])
    }
}

/// The trunk and the MTP head of geometry `g`, as open in-memory GGUF files.
pub fn build(g: &Geometry, seed: u64) -> Result<(Arc<GgufFile>, Arc<GgufFile>)> {
    let arch = "qwen4exp";
    let k = |n: &str| format!("{arch}.{n}");
    let u = |v: usize| Value::U32(v as u32);
    let mut b = Builder {
        w: GgufWriter::new(),
        pool: Pool::new(seed),
    };
    b.w.add_kv("general.architecture", Value::String(arch.to_string()));
    b.w.add_kv("general.name", Value::String(format!("synthetic {g:?}")));
    for (key, v) in [
        ("block_count", g.layers),
        ("embedding_length", g.h),
        ("attention.head_count", g.n_head),
        ("attention.head_count_kv", g.n_head_kv),
        ("attention.key_length", g.head_dim),
        ("attention.value_length", g.head_dim),
        ("rope.dimension_count", g.head_dim / 4),
        ("expert_count", g.experts),
        ("expert_used_count", g.used),
        ("expert_feed_forward_length", g.ff),
        ("expert_shared_feed_forward_length", g.ff_shared),
        ("ssm.conv_kernel", 4),
        ("ssm.state_size", g.gdn_head),
        ("ssm.group_count", g.gdn_k_heads),
        ("ssm.time_step_rank", g.gdn_v_heads),
        ("ssm.inner_size", g.gdn_v_heads * g.gdn_head),
        ("hyper_connection.count", S),
        ("hyper_connection.low_rank", g.hc_rank),
        ("attention.indexer.head_count", g.ix_heads),
        ("attention.indexer.key_length", g.ix_dim),
        ("attention.indexer.top_k", g.budget),
    ] {
        b.w.add_kv(k(key), u(v));
    }
    b.w.add_kv(k("rope.freq_base"), Value::F32(1e6));
    b.w.add_kv(k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    b.w.add_kv(
        k("attention.recurrent_layers"),
        Value::Array(Array::Bool((0..g.layers).map(|l| !g.is_attn(l)).collect())),
    );
    b.w.add_kv(
        k("attention.compress_ratios"),
        Value::Array(Array::I32(
            (0..g.layers)
                .map(|l| if g.is_attn(l) { g.ratio as i32 } else { 0 })
                .collect(),
        )),
    );
    b.matrix("token_embd.weight", &[g.h, g.vocab])?;
    b.matrix("output.weight", &[g.h, g.vocab])?;
    b.hc("output_hc", g, false)?;
    for l in 0..g.layers {
        let blk = format!("blk.{l}");
        b.hc(&format!("{blk}.hc_attn"), g, true)?;
        b.hc(&format!("{blk}.hc_ffn"), g, true)?;
        if g.is_attn(l) {
            b.attn(&blk, g)?;
        } else {
            b.gdn(&blk, g)?;
        }
        b.moe(&blk, g)?;
    }
    let trunk = Arc::new(GgufFile::from_bytes(b.w.to_bytes()?, "synthetic trunk")?);

    let mk = |n: &str| format!("qwen4exp_mtp.{n}");
    let mut m = Builder {
        w: GgufWriter::new(),
        pool: b.pool,
    };
    m.w.add_kv("general.architecture", Value::String("qwen4exp_mtp".into()));
    for (key, v) in [
        ("block_count", 1),
        ("embedding_length", g.h),
        ("vocab_size", g.vocab),
        ("hyper_connection.count", S),
        ("hyper_connection.low_rank", g.hc_rank),
        ("attention.head_count", g.n_head),
        ("attention.head_count_kv", g.n_head_kv),
        ("attention.key_length", g.head_dim),
        ("attention.indexer.head_count", g.ix_heads),
        ("attention.indexer.key_length", g.ix_dim),
        ("attention.indexer.top_k", g.budget),
        ("attention.compress_ratio", g.ratio),
        ("expert_count", g.experts),
        ("expert_used_count", g.used),
        ("expert_feed_forward_length", g.ff),
        ("rope.dimension_count", g.head_dim / 4),
    ] {
        m.w.add_kv(mk(key), u(v));
    }
    m.w.add_kv(mk("rope.freq_base"), Value::F32(1e6));
    m.matrix("mtp.fc_embedding.weight", &[g.h, g.h])?;
    m.matrix("mtp.fc_hidden.weight", &[g.h, g.h])?;
    m.values("mtp.pre_fc_norm_embedding.weight", &[g.h], 0.1, 1.0)?;
    m.values("mtp.pre_fc_norm_hidden.weight", &[g.sh()], 0.1, 1.0)?;
    m.hc("mtp.output_hc", g, false)?;
    m.hc("mtp.blk.0.hc_attn", g, true)?;
    m.hc("mtp.blk.0.hc_ffn", g, true)?;
    m.attn("mtp.blk.0", g)?;
    m.moe("mtp.blk.0", g)?;
    let mtp = Arc::new(GgufFile::from_bytes(m.w.to_bytes()?, "synthetic MTP head")?);
    Ok((trunk, mtp))
}
