//! Activation images: the formats a row of activations is prepared in before a GEMV (the
//! weight type's `vec_dot_type`, FORMATS.md "Activation pairing"), and the quantizers that make
//! them. These are the same functions as `strata_quant::quantize` for the activation types
//! (ggml's x86 CPU-backend `from_float`), written block by block so the CUDA kernels can mirror
//! them operation for operation; a test binds the two.

use strata_quant::dot::f32_to_f16;
use strata_quant::fp::f32_to_bf16;
use strata_quant::GgmlType;

/// An activation format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActFmt {
    F32,
    Bf16,
    Q8_0,
    Q8K,
}

impl ActFmt {
    pub const ALL: [ActFmt; 4] = [ActFmt::F32, ActFmt::Bf16, ActFmt::Q8_0, ActFmt::Q8K];

    pub fn ggml_type(self) -> GgmlType {
        match self {
            ActFmt::F32 => GgmlType::F32,
            ActFmt::Bf16 => GgmlType::BF16,
            ActFmt::Q8_0 => GgmlType::Q8_0,
            ActFmt::Q8K => GgmlType::Q8_K,
        }
    }

    /// The activation format that weights of type `ty` take (None when the pairing is not one
    /// of these four).
    pub fn for_weight(ty: GgmlType) -> Option<ActFmt> {
        match ty.vec_dot_type()? {
            GgmlType::F32 => Some(ActFmt::F32),
            GgmlType::BF16 => Some(ActFmt::Bf16),
            GgmlType::Q8_0 => Some(ActFmt::Q8_0),
            GgmlType::Q8_K => Some(ActFmt::Q8K),
            _ => None,
        }
    }

    /// The numeric code the CUDA kernels take.
    pub fn code(self) -> u32 {
        match self {
            ActFmt::F32 => 0,
            ActFmt::Bf16 => 1,
            ActFmt::Q8_0 => 2,
            ActFmt::Q8K => 3,
        }
    }

    pub fn name(self) -> &'static str {
        self.ggml_type().name()
    }

    /// Elements per block.
    pub fn block(self) -> usize {
        self.ggml_type().block_size()
    }

    /// Bytes of `n` elements, or None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        self.ggml_type().row_bytes(n)
    }
}

/// Q8_0 (ggml's x86 `quantize_row_q8_0`): `d = amax/127`, multiplier `127/amax`, ties to
/// even, saturating to −128..=127 (as Rust's float-to-int `as`).
pub fn q8_0_block(x: &[f32], out: &mut [u8]) {
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = m / 127.0;
    let id = if m != 0.0 { 127.0 / m } else { 0.0 };
    out[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, &v) in out[2..34].iter_mut().zip(x) {
        *o = rne(v * id) as i8 as u8;
    }
}

/// Round half to even for the products above: `|v| <= 127·(1 + ulp)`, ±inf or NaN (a
/// denormal block maximum makes `127/amax` infinite). Adding and removing 1.5·2^23 rounds a
/// finite value of that size to an integer with ties to even, infinities and NaN pass
/// through, so this equals `round_ties_even` on every such input (and, unlike it, needs no
/// libm call on a baseline x86-64 target).
#[inline(always)]
fn rne(v: f32) -> f32 {
    const C: f32 = 12582912.0;
    if v.abs() < 4194304.0 {
        (v + C) - C
    } else {
        v
    }
}

/// ggml's `nearest_int` bit trick (ties to even; out-of-range inputs give ggml's garbage).
#[inline(always)]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0f32;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Q8_K (`quantize_row_q8_K_ref`): the first element of largest magnitude sets
/// `iscale = −127/max`, codes are `min(127, nearest_int(iscale·x))`, `d = 1/iscale` (f32), and
/// the 16 group sums follow. An all-zero block is all zero bytes.
pub fn q8k_block(x: &[f32], out: &mut [u8]) {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        out[..292].fill(0);
        return;
    }
    let iscale = -127.0f32 / max;
    out[0..4].copy_from_slice(&(1.0f32 / iscale).to_le_bytes());
    for g in 0..16 {
        let mut s = 0i32;
        for l in 0..16 {
            let q = nearest_int(iscale * x[16 * g + l]).min(127) as i8;
            out[4 + 16 * g + l] = q as u8;
            s += q as i32;
        }
        out[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
    }
}

/// Quantizes `x` (a whole number of blocks) into `out`.
pub fn quantize_row(fmt: ActFmt, x: &[f32], out: &mut [u8]) {
    match fmt {
        ActFmt::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActFmt::Bf16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        ActFmt::Q8_0 => {
            for (xb, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
                q8_0_block(xb, o);
            }
        }
        ActFmt::Q8K => {
            for (xb, o) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
                q8k_block(xb, o);
            }
        }
    }
}

/// The values an activation image stands for (for tolerances and tests).
pub fn dequantize_row(
    fmt: ActFmt,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), strata_quant::QuantError> {
    strata_quant::dequantize(fmt.ggml_type(), bytes, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::Rng;

    #[test]
    fn quantizers_equal_strata_quant() {
        let mut rng = Rng::new(11);
        for trial in 0..20 {
            let n = 2560;
            let mut x = rng.f32_vec_special(n, 1.0 + trial as f32);
            if trial == 3 {
                // An all-zero block and an all −0.0 block.
                x[..256].fill(0.0);
                x[256..512].fill(-0.0);
            }
            for fmt in ActFmt::ALL {
                let bytes = fmt.row_bytes(n).unwrap();
                let mut a = vec![0u8; bytes];
                let mut b = vec![0xAAu8; bytes];
                quantize_row(fmt, &x, &mut a);
                strata_quant::quantize(fmt.ggml_type(), &x, &mut b).unwrap();
                assert_eq!(a, b, "{fmt:?} trial {trial}");
            }
        }
    }

    #[test]
    fn pairing() {
        assert_eq!(ActFmt::for_weight(GgmlType::Q2_0), Some(ActFmt::Q8_0));
        assert_eq!(ActFmt::for_weight(GgmlType::Q4_K), Some(ActFmt::Q8K));
        assert_eq!(ActFmt::for_weight(GgmlType::IQ3_S), Some(ActFmt::Q8K));
        assert_eq!(ActFmt::for_weight(GgmlType::BF16), Some(ActFmt::Bf16));
        assert_eq!(ActFmt::Q8K.row_bytes(2560), Some(2920));
    }
}
