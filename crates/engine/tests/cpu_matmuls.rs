//! `Backend::matmuls` (several products of one input, the input quantized once per activation
//! format) against one `matmul` per weight: bit for bit, for weights of every activation pairing
//! the models use (Q8_0, Q8_K, BF16 and F32 activations), one to nine input rows, both float
//! activation modes, and the shape errors.

use std::sync::Arc;

use strata_engine::{Backend, CpuBackend, CpuBuf, FloatActivations};
use strata_gguf::{GgufFile, GgufWriter, Value};
use strata_quant::GgmlType;

const K: usize = 512;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// Weights of `K` columns: (name, type, rows).
const WEIGHTS: [(&str, GgmlType, usize); 6] = [
    ("q8_0", GgmlType::Q8_0, 24),
    ("q4_k", GgmlType::Q4_K, 17),
    ("q6_k", GgmlType::Q6_K, 9),
    ("bf16", GgmlType::BF16, 12),
    ("f32", GgmlType::F32, 5),
    ("q5_0", GgmlType::Q5_0, 33),
];

fn file() -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("test".into()));
    for (i, (name, ty, rows)) in WEIGHTS.iter().enumerate() {
        let x = values(i as u64 + 1, rows * K);
        let mut bytes = vec![0u8; ty.row_bytes(K).unwrap() * rows];
        for (src, dst) in x.chunks(K).zip(bytes.chunks_mut(ty.row_bytes(K).unwrap())) {
            strata_quant::quantize(*ty, src, dst).unwrap();
        }
        w.add_tensor_owned(name, &[K as u64, *rows as u64], *ty, bytes)
            .unwrap();
    }
    w.add_tensor_owned("narrow", &[256, 3], GgmlType::F32, vec![0u8; 256 * 3 * 4])
        .unwrap();
    Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "matmuls.gguf").unwrap())
}

#[test]
fn matmuls_equal_one_matmul_per_weight_bitwise() {
    let f = file();
    for mode in [FloatActivations::Paired, FloatActivations::F32] {
        let b = CpuBackend::new(2).unwrap().with_float_activations(mode);
        let w: Vec<_> = WEIGHTS
            .iter()
            .map(|(name, ..)| b.load_weight(&f, f.tensor(name).unwrap()).unwrap())
            .collect();
        for rows in [1, 2, 3, 8, 9] {
            let x = b
                .upload(rows, K, &values(100 + rows as u64, rows * K))
                .unwrap();
            let [a, c, d, e, g, h] = b
                .matmuls([&w[0], &w[1], &w[2], &w[3], &w[4], &w[5]], &x)
                .unwrap();
            // Twice the same format in one call, and a pair, must reuse the first preparation.
            let [p, q] = b.matmuls([&w[5], &w[0]], &x).unwrap();
            for (i, y) in [a, c, d, e, g, h].iter().enumerate() {
                let one = b.download(&b.matmul(&w[i], &x).unwrap()).unwrap();
                let many = b.download(y).unwrap();
                assert_eq!(one.len(), rows * WEIGHTS[i].2);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&one),
                    bits(&many),
                    "{} rows={rows} {mode:?}",
                    WEIGHTS[i].0
                );
            }
            assert_eq!(
                b.download(&p).unwrap(),
                b.download(&b.matmul(&w[5], &x).unwrap()).unwrap()
            );
            assert_eq!(
                b.download(&q).unwrap(),
                b.download(&b.matmul(&w[0], &x).unwrap()).unwrap()
            );
        }
    }
}

#[test]
fn matmuls_name_the_weight_that_does_not_fit() {
    let f = file();
    let b = CpuBackend::new(1).unwrap();
    let ok = b.load_weight(&f, f.tensor("q8_0").unwrap()).unwrap();
    let narrow = b.load_weight(&f, f.tensor("narrow").unwrap()).unwrap();
    let x: CpuBuf = b.upload(2, K, &values(7, 2 * K)).unwrap();
    let err = b.matmuls([&ok, &narrow], &x).unwrap_err().to_string();
    assert!(err.contains("narrow") && err.contains("512"), "{err}");
}
