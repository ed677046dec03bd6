//! Fuzzing support shared by the short in-test run, the long mutation run and the cargo-fuzz
//! target: the property every input must satisfy (`check`), small valid seed files, and a
//! structure-unaware mutator. The properties: the reader never panics; whatever it accepts
//! has in-bounds tensor views and survives a write → read cycle unchanged.

use crate::{Array, GgmlType, GgufFile, GgufWriter, TensorType, Value};

/// Runs every reader entry point on `bytes` and checks the accept → rewrite → read property.
/// Panics (the fuzzing signal) only when a property is broken.
pub fn check(bytes: &[u8]) {
    let Ok(f) = GgufFile::from_bytes(bytes.to_vec(), "fuzz-input") else {
        return;
    };
    for (k, _) in f.metadata() {
        let _ = f.get_u32(k);
        let _ = f.get_i64(k);
        let _ = f.get_f32(k);
        let _ = f.get_bool(k);
        let _ = f.get_str(k);
        let _ = f.get_array_u32(k);
        let _ = f.get_array_f32(k);
        let _ = f.get_array_str(k);
        assert!(f.get(k).is_some());
    }
    let _ = f.architecture();
    let mut all_known = true;
    for t in f.tensors() {
        let _ = (t.n_rows(), t.ne(3), t.shape_rev());
        match (f.tensor_data(t), t.ty) {
            (Ok(d), TensorType::Known(_)) => {
                assert_eq!(d.len() as u64, t.n_bytes, "tensor view size")
            }
            (Err(_), TensorType::Unknown(_)) => all_known = false,
            (r, ty) => panic!(
                "tensor '{}' of type {ty}: unexpected view result {:?}",
                t.name,
                r.map(<[u8]>::len)
            ),
        }
        assert!(f.tensor(&t.name).is_some());
    }
    if !all_known {
        return;
    }
    let out = match GgufWriter::from_file(&f).and_then(|w| w.to_bytes()) {
        Ok(o) => o,
        Err(e) => panic!("an accepted file could not be rewritten: {e}"),
    };
    let g = match GgufFile::from_bytes(out.clone(), "fuzz-rewrite") {
        Ok(g) => g,
        Err(e) => panic!("a rewritten file was refused: {e}"),
    };
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!(
            (&a.name, &a.dims, a.ty, a.n_bytes),
            (&b.name, &b.dims, b.ty, b.n_bytes)
        );
        assert!(
            f.tensor_data(a).ok() == g.tensor_data(b).ok(),
            "tensor '{}' data changed",
            a.name
        );
    }
    // Values compare through their bytes (NaN != NaN as values).
    let again = GgufWriter::from_file(&g).and_then(|w| w.to_bytes());
    assert!(
        again.ok().as_deref() == Some(&out[..]),
        "rewrite is not idempotent"
    );
}

/// Small valid files covering every value type, nested arrays, several tensor types, both
/// versions and a non-default alignment.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("llama".into()))
        .add_kv("llama.block_count", Value::U32(2))
        .add_kv("llama.rope.freq_base", Value::F32(10000.0))
        .add_kv("general.flag", Value::Bool(true))
        .add_kv("k.u64", Value::U64(1 << 40))
        .add_kv("k.i8", Value::I8(-3))
        .add_kv("k.f64", Value::F64(0.5))
        .add_kv(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(vec!["a".into(), "bc".into(), "<s>".into()])),
        )
        .add_kv(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0, -1.0, -2.0])),
        )
        .add_kv(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![1, 1, 3])),
        )
        .add_kv(
            "k.nested",
            Value::Array(Array::Array(vec![
                Array::U16(vec![1, 2]),
                Array::Bool(vec![false]),
            ])),
        );
    let tensors: [(&str, &[u64], GgmlType); 4] = [
        ("token_embd.weight", &[32, 3], GgmlType::Q8_0),
        ("output_norm.weight", &[8], GgmlType::F32),
        ("blk.0.ffn_up.weight", &[256, 1], GgmlType::Q4_K),
        ("blk.0.attn_q.weight", &[64, 2], GgmlType::BF16),
    ];
    for (name, dims, ty) in tensors {
        let n = dims.iter().product::<u64>() as usize / ty.block_size() * ty.type_size();
        let data: Vec<u8> = (0..n).map(|i| (i * 37 % 251) as u8).collect();
        // Names, dims and sizes above are consistent by construction.
        if w.add_tensor(name, dims, ty, &data).is_err() {
            continue;
        }
    }
    out.extend(w.to_bytes().ok());
    let mut v2 = GgufWriter::new();
    v2.version(2).alignment(64);
    v2.add_kv("general.architecture", Value::String("x".into()));
    let _ = v2.add_tensor("a", &[4, 2], GgmlType::F16, &[1u8; 16]);
    let _ = v2.add_tensor("b", &[2], GgmlType::I32, &[2u8; 8]);
    out.extend(v2.to_bytes().ok());
    let mut empty = GgufWriter::new();
    empty.add_kv("general.architecture", Value::String("vocab".into()));
    out.extend(empty.to_bytes().ok());
    out
}

/// A small xorshift generator: fuzzing must be reproducible from a seed without dependencies.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in 0..n (n > 0; 0 gives 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

const INTERESTING_U64: [u64; 12] = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    64,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 62,
    u64::MAX,
];

/// Applies 1–4 random mutations to `seed`: bit flips, interesting bytes, overwritten
/// 32/64-bit fields (lengths, counts, type ids, offsets), truncation, inserted or deleted
/// runs, duplicated chunks and splices with `other`.
pub fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = b.len();
        match rng.below(10) {
            0 | 1 => {
                if len > 0 {
                    let i = rng.below(len);
                    b[i] ^= 1 << rng.below(8);
                }
            }
            2 => {
                if len > 0 {
                    let i = rng.below(len);
                    b[i] = [0u8, 1, 0x7f, 0x80, 0xff, 9, 12, 13][rng.below(8)];
                }
            }
            3 | 4 => {
                // A length/count/offset field: most live at 4- or 8-byte steps from the header.
                let width = if rng.below(2) == 0 { 4 } else { 8 };
                if len >= width {
                    let i = rng.below(len - width + 1);
                    let v = match rng.below(3) {
                        0 => INTERESTING_U64[rng.below(INTERESTING_U64.len())],
                        1 => (len as u64)
                            .wrapping_add(rng.below(64) as u64)
                            .wrapping_sub(32),
                        _ => rng.next_u64() >> rng.below(64),
                    };
                    b[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
                }
            }
            5 => b.truncate(rng.below(len + 1)),
            6 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                b.splice(i..i, ins);
            }
            7 => {
                if len > 0 {
                    let i = rng.below(len);
                    let n = 1 + rng.below((len - i).min(32));
                    b.drain(i..i + n);
                }
            }
            8 => {
                if len > 0 {
                    let i = rng.below(len);
                    let n = 1 + rng.below((len - i).min(64));
                    let chunk = b[i..i + n].to_vec();
                    let j = rng.below(len + 1);
                    b.splice(j..j, chunk);
                }
            }
            _ => {
                if !other.is_empty() {
                    let cut = rng.below(len + 1);
                    let from = rng.below(other.len());
                    b.truncate(cut);
                    b.extend_from_slice(&other[from..]);
                }
            }
        }
    }
    b
}
