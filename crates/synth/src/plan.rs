//! The tensor plan and metadata of a synthetic qwen4exp file: names, ggml `ne`, types and
//! counts of `../shared/tools/README.md`'s table (the public Q2_0 release's mix as far as its
//! notes pin it down; the per-layer placement of the mixed `attn_qkv` and shared-expert types is
//! the reference writer's even interleave), and the `qwen4exp.*` keys in the order llama.cpp's
//! converter writes them. The MTP head's plan (a separate `qwen4exp_mtp` file, docs/MTP-GGUF.md)
//! uses `strata convert-mtp --type q8_0`'s types at the real geometry.

use strata_gguf::{Array, GgmlType, Value};

use crate::vocab::{synthetic_vocab, CONTROL};
use crate::{Result, SynthError};

pub const N_EMBD: u64 = 2560;
/// The real vocabulary (Qwen3.5's 248,320 ids).
pub const FULL_VOCAB: usize = 248_320;
const N_HEAD: u64 = 24;
const N_HEAD_KV: u64 = 2;
const HEAD_DIM: u64 = 256;
const N_ROT: u32 = 64;
const ROPE_BASE: f32 = 1.0e7;
const ROPE_SECTIONS: [i32; 4] = [11, 11, 10, 0];
const RMS_EPS: f32 = 1e-6;
const SSM_D_STATE: u64 = 128;
const SSM_N_GROUP: u64 = 16;
const SSM_DT_RANK: u64 = 48;
const SSM_D_CONV: u64 = 4;
const SSM_D_INNER: u64 = SSM_D_STATE * SSM_DT_RANK; // 6144
const CONV_DIM: u64 = 2 * SSM_D_STATE * SSM_N_GROUP + SSM_D_INNER; // 10240
const IDX_HEADS: u64 = 4;
const IDX_DIM: u64 = 128;
const IDX_TOPK: u32 = 2048;
const IDX_RATIO: i32 = 4;
const HC: u64 = 4;
const HC_LR: u64 = 320;
const HC_DIM: u64 = HC * N_EMBD; // 10240
const N_FF_EXP: u64 = 640;
const N_FF_SHEXP: u64 = 640;
const FULL_ATTN_INTERVAL: usize = 4;
const PLE_LAYER: usize = 1;
const PLE_NGRAM: u32 = 3;
const PLE_HEADS_PER_NGRAM: u32 = 8;
const PLE_CONV_K: u64 = 4;
const PLE_HEAD_DIM: u64 = 160;
const PLE_N_HEADS: usize = ((PLE_NGRAM - 1) * PLE_HEADS_PER_NGRAM) as usize; // 16
/// The checkpoint's n-gram hash constants.
const PLE_MULTIPLIERS: [u64; 3] = [23_703_573_157_769, 20_109_073_645_365, 8_052_911_324_071];
/// llama.cpp's file type for the Q2_0 mix (`LLAMA_FTYPE_MOSTLY_Q2_0`, as the small fixture's
/// `q2_0-mix.gguf` records it).
const FILE_TYPE_Q2_0: u32 = 41;
const IMAGE_TOKEN_OFFSET: usize = 12; // <|image_pad|> among the specials

/// What to generate.
#[derive(Clone, Debug)]
pub struct Options {
    pub layers: usize,
    pub experts: usize,
    /// Top-k (capped at `experts`).
    pub expert_used: usize,
    /// PLE n-gram table rows per head (0: no PLE block). The real table has ~20,000,000.
    pub ple_rows_per_head: u64,
    pub seed: u64,
    /// Vocabulary size (the real 248,320, or fewer for small test files).
    pub vocab: usize,
    /// `context_length`.
    pub ctx: u32,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            layers: 48,
            experts: 512,
            expert_used: 10,
            ple_rows_per_head: 65_536,
            seed: 1234,
            vocab: FULL_VOCAB,
            ctx: 262_144,
        }
    }
}

/// How a tensor's bytes are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Tiled from the type's random block pool.
    Pool,
    /// Norm gammas, 1 + N(0, 0.02).
    Norm,
    /// Negative decays.
    SsmA,
    DtBias,
    /// Convolution taps, N(0, 0.2).
    Conv,
}

#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    /// ggml `ne` (ne[0] contiguous).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub fill: Fill,
}

impl TensorSpec {
    pub fn elements(&self) -> u64 {
        self.ne.iter().product()
    }
    pub fn bytes(&self) -> u64 {
        self.elements() / self.ty.block_size() as u64 * self.ty.type_size() as u64
    }
}

/// A whole file: metadata in order and tensors in order.
#[derive(Clone, Debug)]
pub struct Plan {
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<TensorSpec>,
}

impl Plan {
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::bytes).sum()
    }
    pub fn params(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::elements).sum()
    }
}

pub fn is_qsa(layer: usize) -> bool {
    (layer + 1).is_multiple_of(FULL_ATTN_INTERVAL)
}

/// `n` items split in proportion to `weights` (largest remainder, ties to the earlier entry),
/// interleaved evenly: the reference writer's deterministic `spread`.
fn spread(n: usize, weights: &[(GgmlType, usize)]) -> Vec<GgmlType> {
    let total: usize = weights.iter().map(|w| w.1).sum();
    let exact: Vec<f64> = weights
        .iter()
        .map(|w| n as f64 * w.1 as f64 / total as f64)
        .collect();
    let mut cnt: Vec<usize> = exact.iter().map(|&e| e as usize).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    // A stable sort keeps insertion order among equal remainders, as Python's sorted does.
    order.sort_by(|&a, &b| {
        let (ra, rb) = (exact[a] - cnt[a] as f64, exact[b] - cnt[b] as f64);
        rb.partial_cmp(&ra).unwrap_or(std::cmp::Ordering::Equal)
    });
    let short = n - cnt.iter().sum::<usize>();
    for &k in order.iter().take(short) {
        cnt[k] += 1;
    }
    let mut got = vec![0usize; weights.len()];
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut best: Option<(usize, f64)> = None;
        for k in 0..weights.len() {
            if got[k] >= cnt[k] {
                continue;
            }
            let v = cnt[k] as f64 * (i + 1) as f64 / n as f64 - got[k] as f64;
            if best.is_none_or(|(_, bv)| v > bv + 1e-12) {
                best = Some((k, v));
            }
        }
        let (k, _) = best.expect("counts sum to n");
        out.push(weights[k].0);
        got[k] += 1;
    }
    out
}

fn bad(option: &'static str, problem: impl Into<String>) -> SynthError {
    SynthError::Option {
        option,
        problem: problem.into(),
    }
}

fn check(o: &Options) -> Result<()> {
    if o.layers == 0 || o.layers > 4096 {
        return Err(bad("--layers", format!("{}; expected 1..4096", o.layers)));
    }
    if o.experts == 0 || o.experts > 65_536 {
        return Err(bad(
            "--experts",
            format!("{}; expected 1..65536", o.experts),
        ));
    }
    if o.expert_used == 0 {
        return Err(bad("--expert-used", "must be at least 1"));
    }
    if o.vocab < 1024 || o.vocab > 1 << 24 {
        return Err(bad(
            "--vocab",
            format!("{}; expected 1024..16777216", o.vocab),
        ));
    }
    if o.ple_rows_per_head > 1 << 32 {
        return Err(bad(
            "--ple-rows-per-head",
            format!("{}; expected at most 2^32", o.ple_rows_per_head),
        ));
    }
    if o.ctx == 0 {
        return Err(bad("--ctx", "must be greater than zero"));
    }
    Ok(())
}

fn primes_from(start: u64, n: usize) -> Vec<u64> {
    let is_prime = |x: u64| {
        if x < 2 {
            return false;
        }
        if x.is_multiple_of(2) {
            return x == 2;
        }
        let mut f = 3;
        while f * f <= x {
            if x.is_multiple_of(f) {
                return false;
            }
            f += 2;
        }
        true
    };
    (start..).filter(|&x| is_prime(x)).take(n).collect()
}

/// The PLE table's head vocabularies (the first 16 primes ≥ R), their offsets and the table's
/// rows (rounded up to 128, as the checkpoint does).
fn ple_geometry(rows_per_head: u64) -> (Vec<u64>, Vec<u64>, u64) {
    let vocab = primes_from(rows_per_head, PLE_N_HEADS);
    let offsets: Vec<u64> = vocab
        .iter()
        .scan(0u64, |acc, &v| {
            let o = *acc;
            *acc += v;
            Some(o)
        })
        .collect();
    let end = offsets[PLE_N_HEADS - 1] + vocab[PLE_N_HEADS - 1];
    (vocab, offsets, end.div_ceil(128) * 128)
}

struct Tensors(Vec<TensorSpec>);

impl Tensors {
    fn add(&mut self, name: impl Into<String>, ne: &[u64], ty: GgmlType, fill: Fill) {
        self.0.push(TensorSpec {
            name: name.into(),
            ne: ne.to_vec(),
            ty,
            fill,
        });
    }
    fn pool(&mut self, name: impl Into<String>, ne: &[u64], ty: GgmlType) {
        self.add(name, ne, ty, Fill::Pool);
    }
    fn hc(&mut self, p: &str, inject: bool, norm_ty: GgmlType, mat_ty: GgmlType) {
        self.add(format!("{p}_norm.weight"), &[HC_DIM], norm_ty, Fill::Norm);
        self.pool(format!("{p}_down.weight"), &[HC_DIM, HC_LR], mat_ty);
        self.pool(format!("{p}_up.weight"), &[HC_LR, HC_DIM], mat_ty);
        if inject {
            self.pool(format!("{p}_inject.weight"), &[HC_DIM, HC], mat_ty);
        }
    }
    /// A QSA layer's attention and indexer (`p` = "blk.N" or "mtp.blk.0").
    fn qsa(&mut self, p: &str, q: GgmlType, k: GgmlType, v: GgmlType, o: GgmlType, ix: GgmlType) {
        use GgmlType::F32;
        self.pool(
            format!("{p}.attn_q.weight"),
            &[N_EMBD, HEAD_DIM * N_HEAD * 2],
            q,
        );
        self.pool(
            format!("{p}.attn_k.weight"),
            &[N_EMBD, HEAD_DIM * N_HEAD_KV],
            k,
        );
        self.pool(
            format!("{p}.attn_v.weight"),
            &[N_EMBD, HEAD_DIM * N_HEAD_KV],
            v,
        );
        self.pool(
            format!("{p}.attn_output.weight"),
            &[HEAD_DIM * N_HEAD, N_EMBD],
            o,
        );
        self.add(
            format!("{p}.attn_q_norm.weight"),
            &[HEAD_DIM],
            F32,
            Fill::Norm,
        );
        self.add(
            format!("{p}.attn_k_norm.weight"),
            &[HEAD_DIM],
            F32,
            Fill::Norm,
        );
        self.pool(
            format!("{p}.indexer.q_proj.weight"),
            &[N_EMBD, IDX_HEADS * IDX_DIM],
            ix,
        );
        self.pool(format!("{p}.indexer.k_proj.weight"), &[N_EMBD, IDX_DIM], ix);
        self.add(
            format!("{p}.indexer.q_norm.weight"),
            &[IDX_DIM],
            F32,
            Fill::Norm,
        );
        self.add(
            format!("{p}.indexer.k_norm.weight"),
            &[IDX_DIM],
            F32,
            Fill::Norm,
        );
    }
}

fn u32v(v: impl TryInto<u32>) -> Value {
    Value::U32(v.try_into().unwrap_or(u32::MAX))
}

/// The trunk file: every tensor of the table, metadata and vocabulary.
pub fn trunk_plan(o: &Options) -> Result<Plan> {
    use GgmlType::*;
    check(o)?;
    let n_layer = o.layers;
    let n_exp = o.experts as u64;
    let used = o.expert_used.clamp(1, o.experts);
    let ple_on = o.ple_rows_per_head > 0 && n_layer > PLE_LAYER && !is_qsa(PLE_LAYER);
    let gdn_layers: Vec<usize> = (0..n_layer).filter(|&l| !is_qsa(l)).collect();
    let qkv_types = spread(
        gdn_layers.len(),
        &[(IQ4_XS, 13), (Q3_K, 18), (Q4_K, 4), (Q2_0, 1)],
    );
    let shg_types = spread(n_layer, &[(Q2_0, 21), (Q4_K, 27)]);
    let shu_types = spread(n_layer, &[(Q2_0, 13), (Q4_K, 35)]);
    let v = o.vocab as u64;

    let mut t = Tensors(Vec::new());
    t.pool("token_embd.weight", &[N_EMBD, v], Q4_K);
    for il in 0..n_layer {
        let p = format!("blk.{il}");
        t.hc(&format!("{p}.hc_attn"), true, F32, BF16);
        t.hc(&format!("{p}.hc_ffn"), true, F32, BF16);
        if is_qsa(il) {
            t.qsa(&p, Q2_0, Q5_K, Q6_K, Q4_K, BF16);
        } else {
            let g = gdn_layers.iter().position(|&l| l == il).unwrap_or(0);
            t.pool(
                format!("{p}.attn_qkv.weight"),
                &[N_EMBD, CONV_DIM],
                qkv_types[g],
            );
            t.pool(
                format!("{p}.attn_gate.weight"),
                &[N_EMBD, SSM_D_INNER],
                Q4_K,
            );
            t.add(
                format!("{p}.ssm_conv1d.weight"),
                &[SSM_D_CONV, CONV_DIM],
                F32,
                Fill::Conv,
            );
            t.add(
                format!("{p}.ssm_dt.bias"),
                &[SSM_DT_RANK],
                F32,
                Fill::DtBias,
            );
            t.add(format!("{p}.ssm_a"), &[SSM_DT_RANK], F32, Fill::SsmA);
            t.pool(format!("{p}.ssm_beta.weight"), &[N_EMBD, SSM_DT_RANK], BF16);
            t.pool(
                format!("{p}.ssm_alpha.weight"),
                &[N_EMBD, SSM_DT_RANK],
                BF16,
            );
            t.add(
                format!("{p}.ssm_norm.weight"),
                &[SSM_D_STATE],
                F32,
                Fill::Norm,
            );
            t.pool(format!("{p}.ssm_out.weight"), &[SSM_D_INNER, N_EMBD], Q5_K);
        }
        if ple_on && il == PLE_LAYER {
            t.pool(format!("{p}.ple_key.weight"), &[N_EMBD, HC_DIM], Q2_0);
            t.pool(format!("{p}.ple_value.weight"), &[N_EMBD, N_EMBD], BF16);
            for nm in ["key", "query", "conv"] {
                t.add(
                    format!("{p}.ple_norm_{nm}.weight"),
                    &[HC_DIM],
                    F32,
                    Fill::Norm,
                );
            }
            t.add(
                format!("{p}.ple_conv1d.weight"),
                &[PLE_CONV_K, HC_DIM],
                F16,
                Fill::Conv,
            );
        }
        t.pool(format!("{p}.ffn_gate_inp.weight"), &[N_EMBD, n_exp], BF16);
        t.pool(
            format!("{p}.ffn_gate_exps.weight"),
            &[N_EMBD, N_FF_EXP, n_exp],
            Q2_0,
        );
        t.pool(
            format!("{p}.ffn_up_exps.weight"),
            &[N_EMBD, N_FF_EXP, n_exp],
            Q2_0,
        );
        t.pool(
            format!("{p}.ffn_down_exps.weight"),
            &[N_FF_EXP, N_EMBD, n_exp],
            Q2_0,
        );
        t.pool(format!("{p}.ffn_gate_inp_shexp.weight"), &[N_EMBD], BF16);
        t.pool(
            format!("{p}.ffn_gate_shexp.weight"),
            &[N_EMBD, N_FF_SHEXP],
            shg_types[il],
        );
        t.pool(
            format!("{p}.ffn_up_shexp.weight"),
            &[N_EMBD, N_FF_SHEXP],
            shu_types[il],
        );
        t.pool(
            format!("{p}.ffn_down_shexp.weight"),
            &[N_FF_SHEXP, N_EMBD],
            Q8_0,
        );
    }
    t.hc("output_hc", false, F32, BF16);
    t.pool("output.weight", &[N_EMBD, v], Q6_K);
    let ple = ple_on.then(|| ple_geometry(o.ple_rows_per_head));
    if let Some((_, _, rows)) = &ple {
        t.pool(
            "per_layer_token_embd.weight",
            &[PLE_HEAD_DIM, *rows],
            IQ4_NL,
        );
    }

    // Metadata, in the converter's order (compare `strata inspect` on fixtures/qwen4exp/tiny).
    let voc = synthetic_vocab(o.vocab);
    let a = |k: &str| format!("qwen4exp.{k}");
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: String, v: Value| kv.push((k, v));
    put(
        "general.architecture".into(),
        Value::String("qwen4exp".into()),
    );
    put("general.type".into(), Value::String("model".into()));
    put(
        "general.name".into(),
        Value::String(format!(
            "Qwen3.8-Flash-Next SYNTHETIC random weights (q2_0 mix, {n_layer}L, {}E)",
            o.experts
        )),
    );
    put(
        "general.description".into(),
        Value::String(
            "Random weights for benchmarking only (strata synth); output text is meaningless."
                .into(),
        ),
    );
    put(a("block_count"), u32v(n_layer));
    put(a("context_length"), Value::U32(o.ctx));
    put(a("embedding_length"), u32v(N_EMBD));
    put(a("attention.head_count"), u32v(N_HEAD));
    put(a("attention.head_count_kv"), u32v(N_HEAD_KV));
    put(
        a("rope.dimension_sections"),
        Value::Array(Array::I32(ROPE_SECTIONS.to_vec())),
    );
    put(a("rope.freq_base"), Value::F32(ROPE_BASE));
    put(a("attention.layer_norm_rms_epsilon"), Value::F32(RMS_EPS));
    put(a("expert_count"), u32v(o.experts));
    put(a("expert_used_count"), u32v(used));
    put(a("attention.key_length"), u32v(HEAD_DIM));
    put(a("attention.value_length"), u32v(HEAD_DIM));
    put("general.file_type".into(), Value::U32(FILE_TYPE_Q2_0));
    put(a("expert_feed_forward_length"), u32v(N_FF_EXP));
    put(a("expert_shared_feed_forward_length"), u32v(N_FF_SHEXP));
    put(a("ssm.conv_kernel"), u32v(SSM_D_CONV));
    put(a("ssm.state_size"), u32v(SSM_D_STATE));
    put(a("ssm.group_count"), u32v(SSM_N_GROUP));
    put(a("ssm.time_step_rank"), u32v(SSM_DT_RANK));
    put(a("ssm.inner_size"), u32v(SSM_D_INNER));
    put(
        a("attention.recurrent_layers"),
        Value::Array(Array::Bool((0..n_layer).map(|l| !is_qsa(l)).collect())),
    );
    put(a("full_attention_interval"), u32v(FULL_ATTN_INTERVAL));
    put(a("rope.dimension_count"), Value::U32(N_ROT));
    put(a("hyper_connection.count"), u32v(HC));
    put(a("hyper_connection.low_rank"), u32v(HC_LR));
    put(a("attention.indexer.head_count"), u32v(IDX_HEADS));
    put(a("attention.indexer.key_length"), u32v(IDX_DIM));
    put(a("attention.indexer.top_k"), Value::U32(IDX_TOPK));
    put(
        a("attention.compress_ratios"),
        Value::Array(Array::I32(
            (0..n_layer)
                .map(|l| if is_qsa(l) { IDX_RATIO } else { 0 })
                .collect(),
        )),
    );
    if let Some((vocab, offsets, _)) = &ple {
        put(
            a("ple.layers"),
            Value::Array(Array::I32(vec![PLE_LAYER as i32])),
        );
        put(a("ple.ngram_size"), Value::U32(PLE_NGRAM));
        put(a("ple.heads_per_ngram"), Value::U32(PLE_HEADS_PER_NGRAM));
        put(a("ple.conv_kernel"), u32v(PLE_CONV_K));
        put(a("ple.eos_token_id"), u32v(voc.eos_base));
        put(
            a("ple.image_token_id"),
            u32v(voc.eos_base + IMAGE_TOKEN_OFFSET),
        );
        put(a("embedding_length_per_layer_input"), u32v(PLE_HEAD_DIM));
        put(
            a("ple.layer_multipliers"),
            Value::Array(Array::U64(PLE_MULTIPLIERS.to_vec())),
        );
        put(
            a("ple.head_offsets"),
            Value::Array(Array::U64(offsets.clone())),
        );
        put(
            a("ple.head_vocab_sizes"),
            Value::Array(Array::U64(vocab.clone())),
        );
    }
    put("general.quantization_version".into(), Value::U32(2));
    put("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    put("tokenizer.ggml.pre".into(), Value::String("qwen35".into()));
    put(
        "tokenizer.ggml.tokens".into(),
        Value::Array(Array::String(voc.tokens)),
    );
    put(
        "tokenizer.ggml.token_type".into(),
        Value::Array(Array::I32(voc.types)),
    );
    put(
        "tokenizer.ggml.merges".into(),
        Value::Array(Array::String(voc.merges)),
    );
    put("tokenizer.ggml.eos_token_id".into(), u32v(voc.eos));
    put("tokenizer.ggml.padding_token_id".into(), u32v(voc.eos_base));
    put("tokenizer.ggml.bos_token_id".into(), u32v(voc.eos_base));
    put("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    put("tokenizer.ggml.add_eos_token".into(), Value::Bool(false));
    put(
        "tokenizer.chat_template".into(),
        Value::String(CHAT_TEMPLATE.into()),
    );
    put(
        "synth.generator".into(),
        Value::String("strata synth".into()),
    );
    put("synth.recipe".into(), Value::String("q2_0".into()));
    put("synth.seed".into(), Value::U64(o.seed));
    put(
        "synth.ple_rows_per_head".into(),
        Value::U64(o.ple_rows_per_head),
    );
    debug_assert_eq!(CONTROL, 3);
    Ok(Plan {
        kvs: kv,
        tensors: t.0,
    })
}

/// ChatML, as the fixtures' converter writes it (the real template is not public).
const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The MTP head for a trunk made with the same options: a stand-alone `qwen4exp_mtp` file at
/// the real geometry (one QSA + MoE layer with hyper-connections), in `strata convert-mtp
/// --type q8_0`'s types: matrices Q8_0, routers F32, indexer BF16, norms F32. It shares the
/// trunk's embedding and LM head (Flash-Next's `mtp_use_dedicated_embeddings: false`).
pub fn mtp_plan(o: &Options) -> Result<Plan> {
    use GgmlType::*;
    check(o)?;
    let n_exp = o.experts as u64;
    let used = o.expert_used.clamp(1, o.experts);
    let mut t = Tensors(Vec::new());
    t.pool("mtp.fc_embedding.weight", &[N_EMBD, N_EMBD], Q8_0);
    t.pool("mtp.fc_hidden.weight", &[N_EMBD, N_EMBD], Q8_0);
    t.add(
        "mtp.pre_fc_norm_embedding.weight",
        &[N_EMBD],
        F32,
        Fill::Norm,
    );
    t.add("mtp.pre_fc_norm_hidden.weight", &[HC_DIM], F32, Fill::Norm);
    t.hc("mtp.output_hc", false, F32, Q8_0);
    let p = "mtp.blk.0";
    t.hc(&format!("{p}.hc_attn"), true, F32, Q8_0);
    t.hc(&format!("{p}.hc_ffn"), true, F32, Q8_0);
    t.qsa(p, Q8_0, Q8_0, Q8_0, Q8_0, BF16);
    t.pool(format!("{p}.ffn_gate_inp.weight"), &[N_EMBD, n_exp], F32);
    t.pool(
        format!("{p}.ffn_gate_exps.weight"),
        &[N_EMBD, N_FF_EXP, n_exp],
        Q8_0,
    );
    t.pool(
        format!("{p}.ffn_up_exps.weight"),
        &[N_EMBD, N_FF_EXP, n_exp],
        Q8_0,
    );
    t.pool(
        format!("{p}.ffn_down_exps.weight"),
        &[N_FF_EXP, N_EMBD, n_exp],
        Q8_0,
    );
    t.pool(
        format!("{p}.ffn_gate_shexp.weight"),
        &[N_EMBD, N_FF_SHEXP],
        Q8_0,
    );
    t.pool(
        format!("{p}.ffn_up_shexp.weight"),
        &[N_EMBD, N_FF_SHEXP],
        Q8_0,
    );
    t.pool(
        format!("{p}.ffn_down_shexp.weight"),
        &[N_FF_SHEXP, N_EMBD],
        Q8_0,
    );
    t.pool(format!("{p}.ffn_gate_inp_shexp.weight"), &[N_EMBD, 1], F32);

    let k = |n: &str| format!("qwen4exp_mtp.{n}");
    let mut kv: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("qwen4exp_mtp".into()),
        ),
        ("general.type".into(), Value::String("mtp".into())),
        (
            "general.name".into(),
            Value::String("MTP head of a SYNTHETIC Qwen3.8-Flash-Next (strata synth)".into()),
        ),
    ];
    for (key, v) in [
        ("block_count", 1),
        ("trunk_block_count", o.layers as u64),
        ("embedding_length", N_EMBD),
        ("vocab_size", o.vocab as u64),
        ("hyper_connection.count", HC),
        ("hyper_connection.low_rank", HC_LR),
        ("attention.head_count", N_HEAD),
        ("attention.head_count_kv", N_HEAD_KV),
        ("attention.key_length", HEAD_DIM),
        ("attention.value_length", HEAD_DIM),
        ("attention.indexer.head_count", IDX_HEADS),
        ("attention.indexer.key_length", IDX_DIM),
        ("attention.indexer.top_k", u64::from(IDX_TOPK)),
        ("attention.compress_ratio", IDX_RATIO as u64),
        ("expert_count", n_exp),
        ("expert_used_count", used as u64),
        ("expert_feed_forward_length", N_FF_EXP),
        ("expert_shared_feed_forward_length", N_FF_SHEXP),
        ("rope.dimension_count", u64::from(N_ROT)),
    ] {
        kv.push((k(key), u32v(v)));
    }
    kv.push((k("rope.freq_base"), Value::F32(ROPE_BASE)));
    kv.push((k("attention.layer_norm_rms_epsilon"), Value::F32(RMS_EPS)));
    kv.push(("synth.seed".into(), Value::U64(o.seed)));
    Ok(Plan {
        kvs: kv,
        tensors: t.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference writer's `spread` for the GDN `attn_qkv` mix over 36 layers, worked by
    /// hand: counts 13/18/4/1, and the interleave starts with the largest share.
    #[test]
    fn spread_keeps_counts_and_interleaves() {
        use GgmlType::*;
        let s = spread(36, &[(IQ4_XS, 13), (Q3_K, 18), (Q4_K, 4), (Q2_0, 1)]);
        let count = |t| s.iter().filter(|&&x| x == t).count();
        assert_eq!(
            [count(IQ4_XS), count(Q3_K), count(Q4_K), count(Q2_0)],
            [13, 18, 4, 1]
        );
        assert_eq!(s[0], Q3_K);
        let s = spread(4, &[(Q2_0, 21), (Q4_K, 27)]);
        assert_eq!(s.len(), 4);
        assert_eq!(s.iter().filter(|&&x| x == Q2_0).count(), 2);
    }

    #[test]
    fn bad_options_are_named() {
        let e = trunk_plan(&Options {
            layers: 0,
            ..Options::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("--layers"), "{e}");
        let e = trunk_plan(&Options {
            vocab: 10,
            ..Options::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("--vocab"), "{e}");
    }

    #[test]
    fn ple_heads_are_primes_from_r() {
        let (v, o, rows) = ple_geometry(65_536);
        assert_eq!(v[0], 65_537); // the first prime ≥ 2^16
        assert_eq!(o[1], 65_537);
        assert_eq!(rows, 1_049_472); // the README's table
    }
}
