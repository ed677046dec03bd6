//! Converting the MTP head (`mtp.*`) of a qwen4_exp Hugging Face checkpoint (one safetensors
//! file, or shards listed in `model.safetensors.index.json`) into a stand-alone MTP GGUF that
//! `strata_engine::qwen4exp::Model::load_mtp` attaches beside a trunk GGUF. Names and transforms
//! follow llama.cpp's trunk converter (norms stored as 1 + w, indexer projection split into q/k,
//! experts split into gate/up/down); docs/MTP-GGUF.md has the full table.
//!
//! Everything is checked against `config.json` before a byte is written: a missing or mis-shaped
//! tensor is an error naming it, its file and the expected shape.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value as Json;
use strata_gguf::{GgufWriter, Value};
use strata_quant::GgmlType;

use strata_engine::{EngineError, Result};

use strata_engine::qwen4exp::mtp::MTP_ARCH;

/// The weight format of the converted matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutType {
    F32,
    Bf16,
    Q8_0,
}

impl std::str::FromStr for OutType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(OutType::F32),
            "bf16" => Ok(OutType::Bf16),
            "q8_0" => Ok(OutType::Q8_0),
            _ => Err(format!("unknown type '{s}'; expected f32, bf16 or q8_0")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub out_type: OutType,
    /// Also copy the trunk's `embed_tokens` and `lm_head` into the file as the head's dedicated
    /// `mtp.token_embd` / `mtp.output` (a checkpoint's own `mtp.embed_tokens` /
    /// `mtp.shared_head.head` are always taken when present).
    pub include_shared: bool,
}

/// What was written, for the user.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    /// `(name, ggml dims, type)` of every tensor, in file order.
    pub tensors: Vec<(String, Vec<u64>, GgmlType)>,
    /// Tensors written in another type than asked, and why.
    pub notes: Vec<String>,
}

/// The hyper-parameters the head's shapes follow (from config.json).
#[derive(Clone, Debug)]
struct HfConfig {
    h: usize,
    s: usize,
    r: usize,
    vocab: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    ix_heads: usize,
    ix_dim: usize,
    ix_budget: usize,
    ratio: usize,
    n_expert: usize,
    n_used: usize,
    ff: usize,
    ff_shared: usize,
    eps: f32,
    rope_theta: f32,
    rot_dims: usize,
    n_layer: usize,
}

fn cfg_err(path: &Path, key: &str, problem: impl Into<String>) -> EngineError {
    EngineError::BadKey {
        file: path.display().to_string(),
        key: key.to_string(),
        problem: problem.into(),
    }
}

impl HfConfig {
    fn read(dir: &Path) -> Result<HfConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| EngineError::Input(format!("{}: {e}", path.display())))?;
        let root: Json = serde_json::from_str(&text)
            .map_err(|e| EngineError::Input(format!("{}: not JSON: {e}", path.display())))?;
        let tc = root.get("text_config").unwrap_or(&root);
        let find = |k: &str| tc.get(k).or_else(|| root.get(k));
        let num = |k: &str| -> Result<Option<f64>> {
            match find(k) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| cfg_err(&path, k, format!("{v}; expected a number"))),
            }
        };
        let int = |k: &str, default: Option<usize>| -> Result<usize> {
            match num(k)? {
                Some(v) if v >= 0.0 && v.fract() == 0.0 => Ok(v as usize),
                Some(v) => Err(cfg_err(&path, k, format!("{v}; expected a whole number"))),
                None => default.ok_or_else(|| cfg_err(&path, k, "missing")),
            }
        };
        let model_type = root.get("model_type").and_then(Json::as_str).unwrap_or("");
        if !model_type.starts_with("qwen4_exp") {
            return Err(cfg_err(
                &path,
                "model_type",
                format!("'{model_type}'; expected qwen4_exp"),
            ));
        }
        let rope = find("rope_parameters");
        let rope_num = |k: &str| rope.and_then(|r| r.get(k)).and_then(Json::as_f64);
        let head_dim = int("head_dim", None)?;
        let partial = rope_num("partial_rotary_factor")
            .or(num("partial_rotary_factor")?)
            .unwrap_or(1.0);
        let mut theta = rope_num("rope_theta")
            .or(num("rope_theta")?)
            .ok_or_else(|| cfg_err(&path, "rope_parameters.rope_theta", "missing"))?;
        // An `mtp` block may carry the head's own RoPE base and layer count.
        let mtp = find("mtp");
        if let Some(t) = mtp.and_then(|m| m.get("rope_theta")).and_then(Json::as_f64) {
            theta = t;
        }
        let mtp_layers = match mtp
            .and_then(|m| m.get("num_hidden_layers"))
            .and_then(Json::as_u64)
        {
            Some(n) => n as usize,
            None => int("mtp_num_hidden_layers", Some(1))?,
        };
        if mtp_layers != 1 {
            return Err(cfg_err(
                &path,
                "mtp_num_hidden_layers",
                format!("{mtp_layers}; only one MTP layer is supported"),
            ));
        }
        let rot = head_dim as f64 * partial;
        if rot.fract() != 0.0 || !(rot as usize).is_multiple_of(2) {
            return Err(cfg_err(
                &path,
                "partial_rotary_factor",
                format!("{partial} × head_dim {head_dim} is not an even whole number"),
            ));
        }
        let c = HfConfig {
            h: int("hidden_size", None)?,
            s: int("hc_count", Some(4))?,
            r: int("hc_lowrank", Some(320))?,
            vocab: int("vocab_size", None)?,
            n_head: int("num_attention_heads", None)?,
            n_head_kv: int("num_key_value_heads", None)?,
            head_dim,
            ix_heads: int("indexer_n_heads", None)?,
            ix_dim: int("indexer_head_dim", None)?,
            ix_budget: int("indexer_budget", None)?,
            ratio: int("indexer_compress_ratio", None)?,
            n_expert: int("num_experts", None)?,
            n_used: int("num_experts_per_tok", None)?,
            ff: int("moe_intermediate_size", None)?,
            ff_shared: int("shared_expert_intermediate_size", None)?,
            eps: num("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: theta as f32,
            rot_dims: rot as usize,
            n_layer: int("num_hidden_layers", None)?,
        };
        for (k, v) in [
            ("hidden_size", c.h),
            ("hc_count", c.s),
            ("hc_lowrank", c.r),
            ("vocab_size", c.vocab),
            ("num_attention_heads", c.n_head),
            ("num_key_value_heads", c.n_head_kv),
            ("head_dim", c.head_dim),
            ("indexer_n_heads", c.ix_heads),
            ("indexer_head_dim", c.ix_dim),
            ("num_experts", c.n_expert),
            ("num_experts_per_tok", c.n_used),
            ("moe_intermediate_size", c.ff),
            ("shared_expert_intermediate_size", c.ff_shared),
        ] {
            if v == 0 {
                return Err(cfg_err(&path, k, "is 0; expected a positive number"));
            }
        }
        Ok(c)
    }
}

/// One safetensors file, mapped; tensors are read straight from the mapping.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    header: usize,
    meta: Metadata,
}

/// The checkpoint's tensors by name, across shards.
struct Checkpoint {
    shards: Vec<Shard>,
    by_name: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Opens the single file or the shards that hold `wanted(name)` tensors.
    fn open(dir: &Path, wanted: impl Fn(&str) -> bool) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| EngineError::Input(format!("{}: {e}", index.display())))?;
            let j: Json = serde_json::from_str(&text)
                .map_err(|e| EngineError::Input(format!("{}: not JSON: {e}", index.display())))?;
            let map = j
                .get("weight_map")
                .and_then(Json::as_object)
                .ok_or_else(|| cfg_err(&index, "weight_map", "missing or not an object"))?;
            let mut set = BTreeSet::new();
            for (name, f) in map {
                if wanted(name) {
                    let f = f.as_str().ok_or_else(|| {
                        cfg_err(&index, &format!("weight_map.{name}"), "not a file name")
                    })?;
                    set.insert(dir.join(f));
                }
            }
            set.into_iter().collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut ck = Checkpoint {
            shards: Vec::new(),
            by_name: BTreeMap::new(),
        };
        for path in files {
            let file = File::open(&path)
                .map_err(|e| EngineError::Input(format!("{}: {e}", path.display())))?;
            // SAFETY: the mapping is read-only and lives as long as the shard; a checkpoint
            // modified while it is converted is outside what any reader can guard against.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| EngineError::Input(format!("{}: cannot map: {e}", path.display())))?;
            let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                EngineError::Input(format!("{}: not a safetensors file: {e}", path.display()))
            })?;
            let i = ck.shards.len();
            for name in meta.tensors().keys() {
                ck.by_name.entry(name.clone()).or_insert(i);
            }
            ck.shards.push(Shard {
                path,
                map,
                header,
                meta,
            });
        }
        Ok(ck)
    }

    fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.by_name.keys()
    }

    /// A tensor's shape, after checking it is `expected`.
    fn shape(&self, name: &str, expected: &[usize]) -> Result<&Shard> {
        let shard = self.shard(name, expected)?;
        let info = shard
            .meta
            .info(name)
            .ok_or_else(|| self.missing(name, expected))?;
        if info.shape != expected {
            return Err(EngineError::TensorShape {
                file: shard.path.display().to_string(),
                tensor: name.to_string(),
                found: info.shape.iter().map(|&d| d as u64).collect(),
                expected: expected.iter().map(|&d| d as u64).collect(),
            });
        }
        Ok(shard)
    }

    fn shard(&self, name: &str, expected: &[usize]) -> Result<&Shard> {
        self.by_name
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(|| self.missing(name, expected))
    }

    fn missing(&self, name: &str, expected: &[usize]) -> EngineError {
        let file = match self.shards.as_slice() {
            [one] => one.path.display().to_string(),
            _ => "the checkpoint".to_string(),
        };
        EngineError::MissingTensor {
            file,
            tensor: name.to_string(),
            expected: format!("HF shape {expected:?}"),
        }
    }

    /// Elements `[start, start + len)` (row-major) of tensor `name` (of shape `shape`) as f32.
    fn read(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Vec<f32>> {
        let shard = self.shape(name, shape)?;
        let info = shard
            .meta
            .info(name)
            .ok_or_else(|| self.missing(name, shape))?;
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(EngineError::Input(format!(
                    "{}: tensor '{name}' is {other:?}; expected F32, BF16 or F16",
                    shard.path.display()
                )))
            }
        };
        let base = 8 + shard.header + info.data_offsets.0;
        let bytes = shard
            .map
            .get(base + start * width..base + (start + len) * width)
            .ok_or_else(|| {
                EngineError::Input(format!(
                    "{}: tensor '{name}': elements {start}..{} lie outside the file",
                    shard.path.display(),
                    start + len
                ))
            })?;
        Ok(match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}

/// How the values of one GGUF tensor are made from the checkpoint.
enum Src {
    /// A whole tensor, row-major as stored (`[out, in]` becomes ggml `{in, out}`).
    Whole(String),
    /// A norm weight stored as 1 + w.
    Norm(String),
    /// Rows `[first, first + count)` of a 2-D tensor.
    Rows(String, usize, usize),
    /// Per expert, rows `[first, first + count)` of a 3-D `[E, rows, cols]` stack.
    ExpertRows(String, usize, usize),
    /// One 2-D tensor per expert (`{e}` in the name), stacked.
    PerExpert(String),
}

/// What a tensor is, for choosing its output type.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// 1-D: always F32.
    Vector,
    /// Router-like matrices llama.cpp keeps in F32.
    KeepF32,
    /// Never block-quantized (llama.cpp keeps the indexer projections in BF16).
    NoBlockQuant,
    Matrix,
}

struct Plan {
    name: String,
    /// ggml order.
    dims: Vec<u64>,
    src: Src,
    /// The HF shape of the source tensor.
    src_shape: Vec<usize>,
    role: Role,
}

fn plan(c: &HfConfig, ck: &Checkpoint, opts: &ConvertOptions) -> Result<Vec<Plan>> {
    let (h, s, r) = (c.h, c.s, c.r);
    let sh = s * h;
    let u = |v: usize| v as u64;
    let mut p = Vec::new();
    let mut add = |name: &str, dims: &[usize], src: Src, src_shape: &[usize], role: Role| {
        p.push(Plan {
            name: name.to_string(),
            dims: dims.iter().map(|&d| u(d)).collect(),
            src,
            src_shape: src_shape.to_vec(),
            role,
        })
    };
    let m = |n: &str| format!("mtp.{n}");
    add(
        "mtp.fc_embedding.weight",
        &[h, h],
        Src::Whole(m("fc_embedding.weight")),
        &[h, h],
        Role::Matrix,
    );
    add(
        "mtp.fc_hidden.weight",
        &[h, h],
        Src::Whole(m("fc_hidden.weight")),
        &[h, h],
        Role::Matrix,
    );
    add(
        "mtp.pre_fc_norm_embedding.weight",
        &[h],
        Src::Norm(m("pre_fc_norm_embedding.weight")),
        &[h],
        Role::Vector,
    );
    add(
        "mtp.pre_fc_norm_hidden.weight",
        &[sh],
        Src::Norm(m("pre_fc_norm_hidden.weight")),
        &[sh],
        Role::Vector,
    );
    let mut hc = |gguf: &str, hf: &str, inject: bool| {
        add(
            &format!("{gguf}_norm.weight"),
            &[sh],
            Src::Norm(format!("{hf}.hc_norm.weight")),
            &[sh],
            Role::Vector,
        );
        add(
            &format!("{gguf}_down.weight"),
            &[sh, r],
            Src::Whole(format!("{hf}.input_mix_weight_down.weight")),
            &[r, sh],
            Role::Matrix,
        );
        add(
            &format!("{gguf}_up.weight"),
            &[r, sh],
            Src::Whole(format!("{hf}.input_mix_weight_up.weight")),
            &[sh, r],
            Role::Matrix,
        );
        if inject {
            add(
                &format!("{gguf}_inject.weight"),
                &[sh, s],
                Src::Whole(format!("{hf}.block_inject_weight.weight")),
                &[s, sh],
                Role::Matrix,
            );
        }
    };
    hc("mtp.output_hc", "mtp.hyper_connection_mixer", false);
    let l = "mtp.layers.0";
    hc(
        "mtp.blk.0.hc_attn",
        &format!("{l}.attn_hyper_connection"),
        true,
    );
    hc(
        "mtp.blk.0.hc_ffn",
        &format!("{l}.mlp_hyper_connection"),
        true,
    );

    let (nh, nkv, hd) = (c.n_head, c.n_head_kv, c.head_dim);
    let b = "mtp.blk.0";
    let a = format!("{l}.self_attn");
    add(
        &format!("{b}.attn_q.weight"),
        &[h, 2 * nh * hd],
        Src::Whole(format!("{a}.q_proj.weight")),
        &[2 * nh * hd, h],
        Role::Matrix,
    );
    for (g, hf) in [("attn_k", "k_proj"), ("attn_v", "v_proj")] {
        add(
            &format!("{b}.{g}.weight"),
            &[h, nkv * hd],
            Src::Whole(format!("{a}.{hf}.weight")),
            &[nkv * hd, h],
            Role::Matrix,
        );
    }
    add(
        &format!("{b}.attn_output.weight"),
        &[nh * hd, h],
        Src::Whole(format!("{a}.o_proj.weight")),
        &[h, nh * hd],
        Role::Matrix,
    );
    for (g, hf) in [("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")] {
        add(
            &format!("{b}.{g}.weight"),
            &[hd],
            Src::Norm(format!("{a}.{hf}.weight")),
            &[hd],
            Role::Vector,
        );
    }
    let (ni, di) = (c.ix_heads, c.ix_dim);
    let qk = format!("{a}.indexer.index_qk_proj.weight");
    let qk_shape = [ni * di + di, h];
    add(
        &format!("{b}.indexer.q_proj.weight"),
        &[h, ni * di],
        Src::Rows(qk.clone(), 0, ni * di),
        &qk_shape,
        Role::NoBlockQuant,
    );
    add(
        &format!("{b}.indexer.k_proj.weight"),
        &[h, di],
        Src::Rows(qk, ni * di, di),
        &qk_shape,
        Role::NoBlockQuant,
    );
    for (g, hf) in [("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")] {
        add(
            &format!("{b}.indexer.{g}.weight"),
            &[di],
            Src::Norm(format!("{a}.indexer.{hf}.weight")),
            &[di],
            Role::Vector,
        );
    }

    let mlp = format!("{l}.mlp");
    let (e, ff, ffs) = (c.n_expert, c.ff, c.ff_shared);
    add(
        &format!("{b}.ffn_gate_inp.weight"),
        &[h, e],
        Src::Whole(format!("{mlp}.gate.weight")),
        &[e, h],
        Role::KeepF32,
    );
    let fused = format!("{mlp}.experts.gate_up_proj");
    if ck.has(&fused) {
        add(
            &format!("{b}.ffn_gate_exps.weight"),
            &[h, ff, e],
            Src::ExpertRows(fused.clone(), 0, ff),
            &[e, 2 * ff, h],
            Role::Matrix,
        );
        add(
            &format!("{b}.ffn_up_exps.weight"),
            &[h, ff, e],
            Src::ExpertRows(fused, ff, ff),
            &[e, 2 * ff, h],
            Role::Matrix,
        );
        add(
            &format!("{b}.ffn_down_exps.weight"),
            &[ff, h, e],
            Src::Whole(format!("{mlp}.experts.down_proj")),
            &[e, h, ff],
            Role::Matrix,
        );
    } else {
        // Per-expert tensors (the qwen2_moe naming some third-party checkpoints use).
        for (g, hf, shape) in [
            ("ffn_gate_exps", "gate_proj", [ff, h]),
            ("ffn_up_exps", "up_proj", [ff, h]),
            ("ffn_down_exps", "down_proj", [h, ff]),
        ] {
            add(
                &format!("{b}.{g}.weight"),
                &[shape[1], shape[0], e],
                Src::PerExpert(format!("{mlp}.experts.{{e}}.{hf}.weight")),
                &shape,
                Role::Matrix,
            );
        }
    }
    for (g, hf, shape) in [
        ("ffn_gate_shexp", "gate_proj", [ffs, h]),
        ("ffn_up_shexp", "up_proj", [ffs, h]),
        ("ffn_down_shexp", "down_proj", [h, ffs]),
    ] {
        add(
            &format!("{b}.{g}.weight"),
            &[shape[1], shape[0]],
            Src::Whole(format!("{mlp}.shared_expert.{hf}.weight")),
            &shape,
            Role::Matrix,
        );
    }
    add(
        &format!("{b}.ffn_gate_inp_shexp.weight"),
        &[h, 1],
        Src::Whole(format!("{mlp}.shared_expert_gate.weight")),
        &[1, h],
        Role::KeepF32,
    );

    // Dedicated embeddings: the checkpoint's own, or (asked for) copies of the trunk's.
    let v = c.vocab;
    let emb = ["mtp.embed_tokens.weight"]
        .into_iter()
        .find(|n| ck.has(n))
        .map(str::to_string)
        .or_else(|| {
            opts.include_shared.then(|| {
                [
                    "model.language_model.embed_tokens.weight",
                    "model.embed_tokens.weight",
                ]
                .into_iter()
                .find(|n| ck.has(n))
                .unwrap_or("model.language_model.embed_tokens.weight")
                .to_string()
            })
        });
    let head = ["mtp.shared_head.head.weight", "mtp.lm_head.weight"]
        .into_iter()
        .find(|n| ck.has(n))
        .map(str::to_string)
        .or_else(|| opts.include_shared.then(|| "lm_head.weight".to_string()));
    if let Some(n) = emb {
        add(
            "mtp.token_embd.weight",
            &[h, v],
            Src::Whole(n),
            &[v, h],
            Role::Matrix,
        );
    }
    if let Some(n) = head {
        add(
            "mtp.output.weight",
            &[h, v],
            Src::Whole(n),
            &[v, h],
            Role::Matrix,
        );
    }
    Ok(p)
}

/// The type a tensor is written in, and a note when it is not the one asked for.
fn choose_type(pl: &Plan, ty: OutType) -> (GgmlType, Option<String>) {
    let row = pl.dims.first().copied().unwrap_or(1) as usize;
    match (pl.role, ty) {
        (Role::Vector, _) | (Role::KeepF32, _) | (_, OutType::F32) => (GgmlType::F32, None),
        (_, OutType::Bf16) => (GgmlType::BF16, None),
        (Role::NoBlockQuant, OutType::Q8_0) => (GgmlType::BF16, None),
        (Role::Matrix, OutType::Q8_0) => {
            if row.is_multiple_of(GgmlType::Q8_0.block_size()) {
                (GgmlType::Q8_0, None)
            } else {
                (
                    GgmlType::BF16,
                    Some(format!(
                        "{}: rows of {row} are not whole Q8_0 blocks of {}; written as BF16",
                        pl.name,
                        GgmlType::Q8_0.block_size()
                    )),
                )
            }
        }
    }
}

/// Encodes f32 rows into `ty`.
fn encode(ty: GgmlType, vals: &[f32], row: usize, out: &mut Vec<u8>) -> Result<()> {
    let rb = ty
        .row_bytes(row)
        .ok_or_else(|| EngineError::Input(format!("rows of {row} are not whole {ty} blocks")))?;
    for r in vals.chunks(row) {
        let at = out.len();
        out.resize(at + rb, 0);
        let dst = &mut out[at..];
        if ty == GgmlType::Q8_0 {
            // Weights take ggml's reference quantizer (llama-quantize's), not the activation one.
            strata_quant::legacy::quantize_row_q8_0_ref(r, dst);
        } else {
            strata_quant::quantize(ty, r, dst)?;
        }
    }
    Ok(())
}

/// The values of one planned tensor, produced in chunks of whole rows (`emit` is called with
/// each chunk), so a large expert stack never sits in memory as f32 at once.
fn produce(ck: &Checkpoint, pl: &Plan, mut emit: impl FnMut(&[f32]) -> Result<()>) -> Result<()> {
    let shape = &pl.src_shape;
    match &pl.src {
        Src::Whole(n) => {
            let total: usize = shape.iter().product();
            let row = shape.last().copied().unwrap_or(1).max(1);
            let step = (1 << 22) / row * row;
            let step = step.max(row);
            let mut at = 0;
            while at < total {
                let len = step.min(total - at);
                emit(&ck.read(n, shape, at, len)?)?;
                at += len;
            }
            Ok(())
        }
        Src::Norm(n) => {
            let v = ck.read(n, shape, 0, shape.iter().product())?;
            emit(&v.iter().map(|w| 1.0 + w).collect::<Vec<f32>>())
        }
        Src::Rows(n, first, count) => {
            let cols = shape.get(1).copied().unwrap_or(0);
            emit(&ck.read(n, shape, first * cols, count * cols)?)
        }
        Src::ExpertRows(n, first, count) => {
            let (e, rows, cols) = match shape.as_slice() {
                [e, r, c] => (*e, *r, *c),
                _ => return Err(EngineError::Input(format!("{n}: expected a 3-D stack"))),
            };
            for x in 0..e {
                emit(&ck.read(n, shape, (x * rows + first) * cols, count * cols)?)?;
            }
            Ok(())
        }
        Src::PerExpert(pattern) => {
            let e = pl.dims.get(2).copied().unwrap_or(0) as usize;
            for x in 0..e {
                let n = pattern.replace("{e}", &x.to_string());
                emit(&ck.read(&n, shape, 0, shape.iter().product())?)?;
            }
            Ok(())
        }
    }
}

/// Reads the head of the checkpoint in `dir` and builds the MTP GGUF (not yet written).
pub fn convert_mtp(dir: &Path, opts: &ConvertOptions) -> Result<(GgufWriter, ConvertReport)> {
    let c = HfConfig::read(dir)?;
    let ck = Checkpoint::open(dir, |n| {
        n.starts_with("mtp.")
            || (opts.include_shared
                && (n.ends_with("embed_tokens.weight") || n == "lm_head.weight"))
    })?;
    if !ck.names().any(|n| n.starts_with("mtp.")) {
        return Err(EngineError::MissingTensor {
            file: dir.display().to_string(),
            tensor: "mtp.*".to_string(),
            expected: "the MTP head's tensors (this checkpoint has none)".to_string(),
        });
    }
    let plans = plan(&c, &ck, opts)?;
    // Check every source before converting anything.
    for pl in &plans {
        match &pl.src {
            Src::PerExpert(pattern) => {
                for x in 0..pl.dims.get(2).copied().unwrap_or(0) {
                    ck.shape(&pattern.replace("{e}", &x.to_string()), &pl.src_shape)?;
                }
            }
            Src::Whole(n) | Src::Norm(n) | Src::Rows(n, ..) | Src::ExpertRows(n, ..) => {
                ck.shape(n, &pl.src_shape)?;
            }
        }
    }

    let mut w = GgufWriter::new();
    let k = |n: &str| format!("{MTP_ARCH}.{n}");
    let u32v = |v: usize| Value::U32(v as u32);
    w.add_kv("general.architecture", Value::String(MTP_ARCH.to_string()));
    w.add_kv("general.type", Value::String("mtp".to_string()));
    w.add_kv(
        "general.name",
        Value::String(format!(
            "MTP head of {}",
            dir.file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        )),
    );
    for (key, v) in [
        ("block_count", 1),
        ("trunk_block_count", c.n_layer),
        ("embedding_length", c.h),
        ("vocab_size", c.vocab),
        ("hyper_connection.count", c.s),
        ("hyper_connection.low_rank", c.r),
        ("attention.head_count", c.n_head),
        ("attention.head_count_kv", c.n_head_kv),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("attention.indexer.head_count", c.ix_heads),
        ("attention.indexer.key_length", c.ix_dim),
        ("attention.indexer.top_k", c.ix_budget),
        ("attention.compress_ratio", c.ratio),
        ("expert_count", c.n_expert),
        ("expert_used_count", c.n_used),
        ("expert_feed_forward_length", c.ff),
        ("expert_shared_feed_forward_length", c.ff_shared),
        ("rope.dimension_count", c.rot_dims),
    ] {
        w.add_kv(k(key), u32v(v));
    }
    w.add_kv(k("rope.freq_base"), Value::F32(c.rope_theta));
    w.add_kv(k("attention.layer_norm_rms_epsilon"), Value::F32(c.eps));

    let mut report = ConvertReport::default();
    for pl in &plans {
        let (ty, note) = choose_type(pl, opts.out_type);
        if let Some(n) = note {
            report.notes.push(n);
        }
        let row = pl.dims.first().copied().unwrap_or(1) as usize;
        let mut data = Vec::new();
        produce(&ck, pl, |vals| encode(ty, vals, row, &mut data))?;
        w.add_tensor_owned(&pl.name, &pl.dims, ty, data)?;
        report.tensors.push((pl.name.clone(), pl.dims.clone(), ty));
    }
    Ok((w, report))
}
