//! qwen2 on small random F32 models written in memory (always available, no download), against
//! the architecture written out directly in f64 in this file: embedding, RMSNorm, biased q/k/v,
//! NeoX RoPE, causal GQA, SwiGLU, final norm, tied or untied head. F32 weights pair with F32
//! activations, so nothing is quantized and the two must agree to f32 rounding.

use std::sync::Arc;

use strata_engine::qwen2::{LoadOptions, Model};
use strata_engine::{CpuBackend, KvType};
use strata_gguf::{GgufFile, GgufWriter, Value};
use strata_quant::GgmlType;

const H: usize = 16;
const N_HEAD: usize = 4;
const N_KV: usize = 2;
const HD: usize = H / N_HEAD;
const FF: usize = 24;
const LAYERS: usize = 2;
const VOCAB: usize = 11;
const EPS: f64 = 1e-6;
const THETA: f64 = 10000.0;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.8
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Named tensors: (name, ggml dims, values row-major with `dims[0]` the row length).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn random_model(seed: u64, tied: bool, biases: bool) -> Tensors {
    let mut r = Rng(seed);
    let mut t: Tensors = Vec::new();
    let mut add = |name: &str, dims: &[usize], r: &mut Rng| {
        let n = dims.iter().product();
        t.push((name.to_string(), dims.to_vec(), r.vec(n)));
    };
    add("token_embd.weight", &[H, VOCAB], &mut r);
    if !tied {
        add("output.weight", &[H, VOCAB], &mut r);
    }
    add("output_norm.weight", &[H], &mut r);
    for l in 0..LAYERS {
        let p = |n: &str| format!("blk.{l}.{n}");
        add(&p("attn_norm.weight"), &[H], &mut r);
        add(&p("attn_q.weight"), &[H, H], &mut r);
        add(&p("attn_k.weight"), &[H, N_KV * HD], &mut r);
        add(&p("attn_v.weight"), &[H, N_KV * HD], &mut r);
        if biases {
            add(&p("attn_q.bias"), &[H], &mut r);
            add(&p("attn_k.bias"), &[N_KV * HD], &mut r);
            add(&p("attn_v.bias"), &[N_KV * HD], &mut r);
        }
        add(&p("attn_output.weight"), &[H, H], &mut r);
        add(&p("ffn_norm.weight"), &[H], &mut r);
        add(&p("ffn_gate.weight"), &[H, FF], &mut r);
        add(&p("ffn_up.weight"), &[H, FF], &mut r);
        add(&p("ffn_down.weight"), &[FF, H], &mut r);
    }
    // Norm weights near 1, as trained models have them.
    for (name, _, v) in t.iter_mut() {
        if name.ends_with("norm.weight") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
    }
    t
}

fn gguf(tensors: &Tensors, ctx: u32) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    let a = "qwen2";
    w.add_kv("general.architecture", Value::String(a.into()))
        .add_kv(format!("{a}.embedding_length"), Value::U32(H as u32))
        .add_kv(format!("{a}.block_count"), Value::U32(LAYERS as u32))
        .add_kv(format!("{a}.feed_forward_length"), Value::U32(FF as u32))
        .add_kv(
            format!("{a}.attention.head_count"),
            Value::U32(N_HEAD as u32),
        )
        .add_kv(
            format!("{a}.attention.head_count_kv"),
            Value::U32(N_KV as u32),
        )
        .add_kv(format!("{a}.rope.freq_base"), Value::F32(THETA as f32))
        .add_kv(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(EPS as f32),
        )
        .add_kv(format!("{a}.context_length"), Value::U32(ctx));
    for (name, dims, v) in tensors {
        let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.add_tensor_owned(name, &d, GgmlType::F32, bytes).unwrap();
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "synthetic-qwen2.gguf").unwrap())
}

/// The f64 forward pass: logits of every position.
fn reference(t: &Tensors, ids: &[u32]) -> Vec<Vec<f64>> {
    let get = |name: &str| -> Option<Vec<f64>> {
        t.iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, v)| v.iter().map(|&x| f64::from(x)).collect())
    };
    let w = |name: &str| get(name).unwrap_or_else(|| panic!("{name}"));
    // y = W x for a weight with rows of `k`.
    let mv = |m: &[f64], x: &[f64]| -> Vec<f64> {
        m.chunks(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rms = |x: &[f64], g: &[f64]| -> Vec<f64> {
        let s = (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS).sqrt();
        x.iter().zip(g).map(|(v, gw)| v / s * gw).collect()
    };
    let rope = |v: &mut [f64], pos: usize| {
        for head in v.chunks_mut(HD) {
            for i in 0..HD / 2 {
                let a = pos as f64 * THETA.powf(-2.0 * i as f64 / HD as f64);
                let (x0, x1) = (head[i], head[i + HD / 2]);
                head[i] = x0 * a.cos() - x1 * a.sin();
                head[i + HD / 2] = x1 * a.cos() + x0 * a.sin();
            }
        }
    };
    let add = |a: &mut Vec<f64>, b: &[f64]| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    let emb = w("token_embd.weight");
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&i| emb[i as usize * H..(i as usize + 1) * H].to_vec())
        .collect();
    for l in 0..LAYERS {
        let p = |n: &str| format!("blk.{l}.{n}");
        let (mut ks, mut vs, mut qs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms(x, &w(&p("attn_norm.weight")));
            let mut q = mv(&w(&p("attn_q.weight")), &h);
            let mut k = mv(&w(&p("attn_k.weight")), &h);
            let mut v = mv(&w(&p("attn_v.weight")), &h);
            for (y, b) in [
                (&mut q, "attn_q.bias"),
                (&mut k, "attn_k.bias"),
                (&mut v, "attn_v.bias"),
            ] {
                if let Some(bias) = get(&p(b)) {
                    add(y, &bias);
                }
            }
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut o = vec![0f64; H];
            for hh in 0..N_HEAD {
                let g = hh / (N_HEAD / N_KV);
                let q = &qs[pos][hh * HD..(hh + 1) * HD];
                let s: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let k = &ks[t][g * HD..(g + 1) * HD];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (HD as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (t, sv) in s.iter().enumerate() {
                    let pr = (sv - m).exp() / z;
                    for j in 0..HD {
                        o[hh * HD + j] += pr * vs[t][g * HD + j];
                    }
                }
            }
            add(x, &mv(&w(&p("attn_output.weight")), &o));
            let h = rms(x, &w(&p("ffn_norm.weight")));
            let gate = mv(&w(&p("ffn_gate.weight")), &h);
            let up = mv(&w(&p("ffn_up.weight")), &h);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            add(x, &mv(&w(&p("ffn_down.weight")), &act));
        }
    }
    let head = get("output.weight").unwrap_or(emb);
    xs.iter()
        .map(|x| mv(&head, &rms(x, &w("output_norm.weight"))))
        .collect()
}

fn check(tied: bool, biases: bool) {
    let t = random_model(7 + tied as u64 + 2 * biases as u64, tied, biases);
    let model = Model::from_file(
        gguf(&t, 64),
        CpuBackend::new(2).unwrap(),
        &LoadOptions {
            kv_type: KvType::F32,
        },
    )
    .unwrap();
    assert_eq!(model.tied_output(), tied);
    let ids = [3u32, 9, 0, 10, 4, 4, 7];
    let want = reference(&t, &ids);
    let mut st = model.new_state().unwrap();
    let out = model.forward(&mut st, &ids).unwrap();
    let mut worst = 0f64;
    for (p, w) in want.iter().enumerate() {
        for (a, b) in out.row(p).unwrap().iter().zip(w) {
            worst = worst.max((f64::from(*a) - b).abs());
        }
    }
    let scale = want.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
    assert!(
        worst <= 1e-5 * scale.max(1.0),
        "tied {tied}, biases {biases}: max|Δ| {worst:e} (logits up to {scale})"
    );
    // A prefill that wants only the last logits (its last layer runs the rows before the last
    // only as far as the cache): the same last row, and a cache that the next step reads to
    // the same bits as the full pass's.
    let mut st2 = model.new_state().unwrap();
    let last = model.forward_with(&mut st2, &ids[..6], true).unwrap();
    assert_eq!(last.row(0).unwrap(), out.row(5).unwrap());
    let next = model.forward(&mut st2, &ids[6..]).unwrap();
    assert_eq!(next.row(0).unwrap(), out.row(6).unwrap());
}

#[test]
fn forward_matches_the_f64_formula_untied_with_biases() {
    check(false, true);
}

#[test]
fn forward_matches_the_f64_formula_tied_without_biases() {
    check(true, false);
}

#[test]
fn context_and_bad_files_are_errors() {
    let t = random_model(1, true, true);
    let model = Model::from_file(
        gguf(&t, 4),
        CpuBackend::new(1).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    let mut st = model.new_state().unwrap();
    model.forward(&mut st, &[1, 2, 3]).unwrap();
    let err = model.forward(&mut st, &[4, 5]).unwrap_err().to_string();
    assert!(err.contains("context of 4"), "{err}");
    assert_eq!(st.position(), 3);

    // A q projection of the wrong shape names the tensor and both shapes.
    let mut bad = random_model(2, true, true);
    let q = bad
        .iter_mut()
        .find(|(n, _, _)| n == "blk.1.attn_q.weight")
        .unwrap();
    q.1 = vec![H, H - 4];
    q.2.truncate(H * (H - 4));
    let err = Model::from_file(
        gguf(&bad, 64),
        CpuBackend::new(1).unwrap(),
        &LoadOptions::default(),
    )
    .err()
    .expect("a mis-shaped tensor is refused")
    .to_string();
    assert!(
        err.contains("blk.1.attn_q.weight") && err.contains("[16, 12]"),
        "{err}"
    );

    // A missing layer tensor.
    let mut missing = random_model(3, true, true);
    missing.retain(|(n, _, _)| n != "blk.0.ffn_up.weight");
    let err = Model::from_file(
        gguf(&missing, 64),
        CpuBackend::new(1).unwrap(),
        &LoadOptions::default(),
    )
    .err()
    .expect("a missing tensor is refused")
    .to_string();
    assert!(err.contains("blk.0.ffn_up.weight"), "{err}");
}
