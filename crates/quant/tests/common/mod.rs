//! Loading the block-format test vectors (`fixtures/formats/`, written by ggml's C reference).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use strata_quant::GgmlType;

pub fn formats_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/formats")
}

/// One fixture file: every tensor's raw little-endian bytes and shape.
pub struct Vectors {
    pub ty: GgmlType,
    pub tensors: HashMap<String, (Vec<usize>, Vec<u8>)>,
}

impl Vectors {
    pub fn load(ty: GgmlType) -> Vectors {
        let path = formats_dir().join(format!("{}.safetensors", ty.name().to_lowercase()));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            tensors.insert(
                name.to_string(),
                (view.shape().to_vec(), view.data().to_vec()),
            );
        }
        Vectors { ty, tensors }
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn bytes(&self, name: &str) -> &[u8] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("{}: no tensor {name}", self.ty))
            .1
    }

    pub fn shape(&self, name: &str) -> &[usize] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("{}: no tensor {name}", self.ty))
            .0
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        self.bytes(name)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    pub fn f64s(&self, name: &str) -> Vec<f64> {
        self.bytes(name)
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// Assert two f32 slices are bitwise equal, naming the first difference.
pub fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: got {g:e} ({:#010x}), want {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// Assert byte slices are equal, naming the first differing byte and its block.
pub fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8], type_size: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} (block {}, offset {}): got {:#04x}, want {:#04x}",
            i / type_size,
            i % type_size,
            got[i],
            want[i]
        );
    }
}

/// The standard checks for a type, as far as the fixture holds the tensors:
/// dequantization of `blocks_raw` and `blocks_q`; quantization of `source` (when `quantize`);
/// activation quantization of `dot_x`, and the dot products against `dot_ref`/`dot_out`.
pub fn check_type(ty: GgmlType, check_quantize: bool, dot_rel_tol: f64) {
    let v = Vectors::load(ty);
    let ts = ty.type_size();
    for (blocks, deq) in [("blocks_raw", "deq_raw"), ("blocks_q", "deq_q")] {
        if v.has(blocks) && v.has(deq) {
            let want = v.f32s(deq);
            let mut got = vec![0f32; want.len()];
            strata_quant::dequantize(ty, v.bytes(blocks), &mut got).expect("dequantize");
            assert_bits_eq(&format!("{ty} {deq}"), &got, &want);
        }
    }
    if check_quantize && v.has("blocks_q") {
        let src = v.f32s("source");
        let mut got = vec![0u8; v.bytes("blocks_q").len()];
        strata_quant::quantize(ty, &src, &mut got).expect("quantize");
        assert_bytes_eq(&format!("{ty} blocks_q"), &got, v.bytes("blocks_q"), ts);
    }
    if v.has("dot_w") {
        let xty = ty.vec_dot_type().expect("weight type");
        let x = v.f32s("dot_x");
        let n = x.len();
        let mut xq = vec![0u8; xty.row_bytes(n).unwrap()];
        strata_quant::quantize(xty, &x, &mut xq).expect("activation quantize");
        assert_bytes_eq(
            &format!("{ty} dot_xq"),
            &xq,
            v.bytes("dot_xq"),
            xty.type_size(),
        );
        let rb = ty.row_bytes(n).unwrap();
        let w = v.bytes("dot_w");
        let want = v.f64s("dot_ref");
        let ggml = v.f32s("dot_out");
        for r in 0..want.len() {
            for isa in strata_quant::Isa::ALL {
                if !strata_quant::simd::supported(isa) {
                    continue;
                }
                let got = strata_quant::vec_dot_isa(ty, isa, n, &w[r * rb..(r + 1) * rb], &xq)
                    .expect("dot");
                let rel = (got as f64 - want[r]).abs() / want[r].abs().max(1e-30);
                assert!(
                    rel <= dot_rel_tol,
                    "{ty} row {r} {}: got {got:e}, dot_ref {:e} (ggml {:e}), rel {rel:e} > {dot_rel_tol:e}",
                    isa.name(),
                    want[r],
                    ggml[r]
                );
            }
        }
    }
}
