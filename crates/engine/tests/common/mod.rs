//! Shared helpers for the qwen4exp model tests: fixture paths, golden tensors, comparisons.
#![allow(dead_code)]

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

pub fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny")
}

/// The larger fixtures live next to the repository (`../shared/fixtures`); None when absent.
pub fn small_dir() -> Option<PathBuf> {
    let d =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/qwen4exp/small");
    if d.join("golden.safetensors").exists() {
        Some(d)
    } else {
        eprintln!(
            "SKIP: {} not found (the small qwen4exp fixtures are not on this machine)",
            d.display()
        );
        None
    }
}

/// Tensors of one safetensors file, as f32 (F32) or i64 (I64) vectors.
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub fn open(path: PathBuf) -> Golden {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Golden { bytes }
    }

    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("golden file parses");
        let t = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).expect("golden file parses");
        let t = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
        assert_eq!(t.dtype(), Dtype::I64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|c| {
                let v = i64::from_le_bytes(c.try_into().unwrap());
                u32::try_from(v).expect("token id fits u32")
            })
            .collect()
    }
}

/// Differences between two `[rows, cols]` matrices.
#[derive(Debug)]
pub struct Diff {
    pub max_abs: f32,
    pub mean_abs: f32,
    pub max_ref: f32,
    /// Rows whose argmax differs.
    pub argmax_mismatch: Vec<usize>,
    /// Rows whose argmax differs although the reference's top-2 gap exceeds `gap`.
    pub argmax_mismatch_clear: Vec<usize>,
    pub rows: usize,
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

fn top2_gap(v: &[f32]) -> f32 {
    let mut s: Vec<f32> = v.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[0] - s[1]
}

pub fn compare(got: &[f32], want: &[f32], cols: usize, gap: f32) -> Diff {
    assert_eq!(got.len(), want.len(), "sizes differ");
    let mut max_abs = 0f32;
    let mut sum = 0f64;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        assert!(d.is_finite(), "non-finite value");
        max_abs = max_abs.max(d);
        sum += d as f64;
    }
    let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let rows = want.len() / cols;
    let mut argmax_mismatch = vec![];
    let mut argmax_mismatch_clear = vec![];
    for r in 0..rows {
        let (g, w) = (
            &got[r * cols..(r + 1) * cols],
            &want[r * cols..(r + 1) * cols],
        );
        if argmax(g) != argmax(w) {
            argmax_mismatch.push(r);
            if top2_gap(w) > gap {
                argmax_mismatch_clear.push(r);
            }
        }
    }
    Diff {
        max_abs,
        mean_abs: (sum / want.len() as f64) as f32,
        max_ref,
        argmax_mismatch,
        argmax_mismatch_clear,
        rows,
    }
}

/// The default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) where `strata fetch` caches it (the
/// CLI's rules), or `STRATA_DEFAULT_MODEL`; None, with a SKIP message, when it is not there.
pub fn default_model() -> Option<PathBuf> {
    const MODEL_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = env("STRATA_DEFAULT_MODEL").or_else(|| {
        env("STRATA_CACHE")
            .map(|d| d.join("models"))
            .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("strata/models")))
            .or_else(|| env("HOME").map(|d| d.join(".cache/strata/models")))
            .map(|d| d.join(MODEL_FILE))
    })?;
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "SKIP: {} not found (run `strata fetch` to cache the default model)",
            path.display()
        );
        None
    }
}

/// `m` with the MTP head converted (F32) from the checkpoint in `hf` attached; `include_shared`
/// as the converter takes it (the small fixture's head carries its own shared tensors).
pub fn with_mtp_head<B: strata_engine::Qwen4expOps>(
    mut m: strata_engine::qwen4exp::Model<B>,
    hf: &std::path::Path,
    include_shared: bool,
) -> strata_engine::qwen4exp::Model<B> {
    use strata_convert::{convert_mtp, ConvertOptions, OutType};
    let (w, _) = convert_mtp(
        hf,
        &ConvertOptions {
            out_type: OutType::F32,
            include_shared,
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", hf.display()));
    let file = strata_gguf::GgufFile::from_bytes(w.to_bytes().unwrap(), "mtp.gguf").unwrap();
    m.attach_mtp(std::sync::Arc::new(file)).unwrap();
    m
}
