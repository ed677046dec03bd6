//! The I-quant family: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and IQ4_XS (256-element
//! super-blocks, grid/codebook formats). This module owns their block layouts, the dequantizers
//! (bit-exact with ggml's `dequantize_row_*`) and the scalar reference dot products with Q8_K
//! activations that `simd::iquants_x86` reproduces bit for bit. There are no weight quantizers.
//!
//! # The reference dot product (every ISA reproduces it exactly)
//!
//! Every type decodes a block into 256 small signed integers `w[i]` and 16 integer scales
//! `ls[h]`, one per 16 elements, such that element `i` is worth `dw · ls[i/16] · w[i] · post`:
//!
//! | type | `w` | `ls` | `post` |
//! |---|---|---|---|
//! | IQ2_XXS, IQ2_XS, IQ2_S | ±grid (8..43) | 2·s+1 | 1/8 |
//! | IQ3_XXS | ±grid (4..62) | 2·s+1 | 1/4 |
//! | IQ3_S | ±grid (1..15) | 2·s+1 | 1 |
//! | IQ4_XS | kvalues_iq4nl | s−32 | 1 |
//! | IQ1_S, IQ1_M | 8·grid ± 1 (the ±1/8 delta, scaled by 8 so it stays an integer) | 2·s+1 | 1/8 |
//!
//! With `q` the Q8_K codes and `d = dw · dx` (one f32 product per block), each block adds to 8
//! f32 lanes: lane `l` takes the exact i32 sum `L[l] = Σ ls[i/16]·w[i]·q[i]` over the elements
//! `i` with `(i mod 32) / 4 == l` (four consecutive elements of each 32-element sub-block, what
//! one i32 lane of a `maddubs`+`madd` or `maddubs`+`vpdpwssd` result holds), then
//! `acc[l] = d.mul_add(L[l] as f32, acc[l])`. The result is `post · reduce8(acc)`.
//!
//! The SIMD kernels equal this reference for Q8_K codes in −127..=127, which is what the Q8_K
//! quantizer produces: they flip the sign of a code with byte arithmetic, which would wrap −128.

use crate::dot::{le_f16, le_u16, le_u32, reduce8};
use crate::grids::*;
use crate::{FormatFns, GgmlType};

/// Elements per super-block.
pub const QK_K: usize = 256;
/// Bytes of one Q8_K block: f32 d, i8 qs\[256\], i16 bsums\[16\].
pub const Q8K_BYTES: usize = 292;

pub(crate) fn fns(ty: GgmlType) -> Option<FormatFns> {
    use GgmlType::*;
    let f = |dequantize: fn(&[u8], &mut [f32]), dot: fn(usize, &[u8], &[u8]) -> f32| FormatFns {
        dequantize: Some(dequantize),
        quantize: None,
        dot: Some(dot),
    };
    Some(match ty {
        IQ2_XXS => f(dequantize_iq2_xxs, dot_iq2_xxs),
        IQ2_XS => f(dequantize_iq2_xs, dot_iq2_xs),
        IQ2_S => f(dequantize_iq2_s, dot_iq2_s),
        IQ3_XXS => f(dequantize_iq3_xxs, dot_iq3_xxs),
        IQ3_S => f(dequantize_iq3_s, dot_iq3_s),
        IQ1_S => f(dequantize_iq1_s, dot_iq1_s),
        IQ1_M => f(dequantize_iq1_m, dot_iq1_m),
        IQ4_XS => f(dequantize_iq4_xs, dot_iq4_xs),
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Block layouts (bytes, little-endian):
//   IQ2_XXS (66):  d:f16 | qs:u16[32]  (per 32 elements two u32: 4 grid indices; 4×7 sign bits
//                  and a 4-bit scale in the top bits)
//   IQ2_XS  (74):  d | qs:u16[32] (9-bit grid index, 7 sign bits) | scales[8] (two nibbles)
//   IQ2_S   (82):  d | qs[32] (grid low 8 bits) | signs[32] | qh[8] (2 high bits ×4) | scales[8]
//   IQ3_XXS (98):  d | qs[64] (grid indices) | u32[8] (4×7 sign bits, 4-bit scale on top)
//   IQ3_S  (110):  d | qs[64] (grid low bits) | qh[8] (bit 8, one per index) | signs[32]
//                  | scales[4] (one nibble per 32 elements)
//   IQ1_S   (50):  d | qs[32] (grid low bits) | qh:u16[8] (3×3 high bits, 3-bit scale, delta sign)
//   IQ1_M   (56):  qs[32] | qh[16] (3 high bits + delta sign per 8) | scales:u16[4] (four 3-bit
//                  scales each, and a nibble of the f16 super-scale in the top 4 bits)
//   IQ4_XS (136):  d | scales_h:u16 | scales_l[4] | qs[128] (low nibble j, high nibble j+16)

/// One decoded block: the signed integer weights and their per-16 scales (see the module doc),
/// and for dequantization ggml's float scale per 16 elements.
struct Decoded {
    w: [i8; QK_K],
    ls: [i32; 16],
    db: [f32; 16],
}

impl Decoded {
    fn new() -> Decoded {
        Decoded {
            w: [0; QK_K],
            ls: [0; 16],
            db: [0.0; 16],
        }
    }
}

/// Byte `j` of a packed grid entry.
#[inline]
fn gbyte64(g: u64, j: usize) -> u8 {
    (g >> (8 * j)) as u8
}

#[inline]
fn gbyte32(g: u32, j: usize) -> u8 {
    (g >> (8 * j)) as u8
}

/// Magnitude `m` (below 128) negated when bit 0 of `sign` is set, without a branch.
#[inline]
fn signed(m: u8, sign: u8) -> i8 {
    let s = -((sign & 1) as i8);
    (m as i8 ^ s) - s
}

/// Write 8 grid magnitudes with signs: bit j of `signs` set makes element j negative.
#[inline]
fn put8(w: &mut [i8], grid: u64, signs: u8) {
    for (j, v) in w.iter_mut().enumerate().take(8) {
        *v = signed(gbyte64(grid, j), signs >> j);
    }
}

/// As [`put8`] for two 4-byte grid entries (IQ3 types).
#[inline]
fn put4x2(w: &mut [i8], g1: u32, g2: u32, signs: u8) {
    for j in 0..4 {
        w[j] = signed(gbyte32(g1, j), signs >> j);
        w[j + 4] = signed(gbyte32(g2, j), signs >> (j + 4));
    }
}

// The decoders. Each fills `o` and returns the block's f32 super-scale `dw`. Float scales `db`
// follow ggml's expressions operation by operation, so dequantization is bit-exact.

fn decode_iq2_xxs(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    for ib in 0..8 {
        let a0 = le_u32(b, 2 + 8 * ib);
        let a1 = le_u32(b, 6 + 8 * ib);
        let s = a1 >> 28;
        let db = d * (0.5 + s as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((a0 >> (8 * l)) & 0xff) as usize];
            let signs = KSIGNS_IQ2XS[((a1 >> (7 * l)) & 127) as usize];
            put8(&mut o.w[32 * ib + 8 * l..], grid, signs);
        }
        o.ls[2 * ib] = 2 * s as i32 + 1;
        o.ls[2 * ib + 1] = 2 * s as i32 + 1;
        o.db[2 * ib] = db;
        o.db[2 * ib + 1] = db;
    }
    d
}

fn decode_iq2_xs(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    for ib in 0..8 {
        let sc = b[66 + ib];
        for (h, s) in [(0, sc & 0xf), (1, sc >> 4)] {
            o.ls[2 * ib + h] = 2 * s as i32 + 1;
            o.db[2 * ib + h] = d * (0.5 + s as f32) * 0.25;
        }
        for l in 0..4 {
            let q = le_u16(b, 2 + 2 * (4 * ib + l));
            let grid = IQ2XS_GRID[(q & 511) as usize];
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            put8(&mut o.w[32 * ib + 8 * l..], grid, signs);
        }
    }
    d
}

fn decode_iq2_s(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    let (qs, signs, qh, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
    for ib in 0..8 {
        let sc = scales[ib];
        for (h, s) in [(0, sc & 0xf), (1, sc >> 4)] {
            o.ls[2 * ib + h] = 2 * s as i32 + 1;
            o.db[2 * ib + h] = d * (0.5 + s as f32) * 0.25;
        }
        for l in 0..4 {
            let idx = qs[4 * ib + l] as usize | (((qh[ib] as usize) << (8 - 2 * l)) & 0x300);
            put8(
                &mut o.w[32 * ib + 8 * l..],
                IQ2S_GRID[idx],
                signs[4 * ib + l],
            );
        }
    }
    d
}

fn decode_iq3_xxs(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    let qs = &b[2..66];
    for ib in 0..8 {
        let a = le_u32(b, 66 + 4 * ib);
        let s = a >> 28;
        let db = d * (0.5 + s as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize];
            let g1 = IQ3XXS_GRID[qs[8 * ib + 2 * l] as usize];
            let g2 = IQ3XXS_GRID[qs[8 * ib + 2 * l + 1] as usize];
            put4x2(&mut o.w[32 * ib + 8 * l..], g1, g2, signs);
        }
        o.ls[2 * ib] = 2 * s as i32 + 1;
        o.ls[2 * ib + 1] = 2 * s as i32 + 1;
        o.db[2 * ib] = db;
        o.db[2 * ib + 1] = db;
    }
    d
}

fn decode_iq3_s(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
    for ib in 0..8 {
        let s = (scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
        let ls = 1 + 2 * s as i32;
        let db = d * ls as f32;
        let h = qh[ib] as usize;
        for l in 0..4 {
            let i1 = qs[8 * ib + 2 * l] as usize | ((h << (8 - 2 * l)) & 256);
            let i2 = qs[8 * ib + 2 * l + 1] as usize | ((h << (7 - 2 * l)) & 256);
            put4x2(
                &mut o.w[32 * ib + 8 * l..],
                IQ3S_GRID[i1],
                IQ3S_GRID[i2],
                signs[4 * ib + l],
            );
        }
        o.ls[2 * ib] = ls;
        o.ls[2 * ib + 1] = ls;
        o.db[2 * ib] = db;
        o.db[2 * ib + 1] = db;
    }
    d
}

/// 8 IQ1 grid values scaled by 8 plus the delta sign (`delta` is +1 or −1).
#[inline]
fn put_iq1(w: &mut [i8], grid: u64, delta: i8) {
    for (j, v) in w.iter_mut().enumerate().take(8) {
        *v = 8 * (gbyte64(grid, j) as i8) + delta;
    }
}

fn decode_iq1_s(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    let qs = &b[2..34];
    for ib in 0..8 {
        let qh = le_u16(b, 34 + 2 * ib);
        let ls = 2 * ((qh >> 12) & 7) as i32 + 1;
        let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
        for l in 0..4 {
            let idx = qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
            put_iq1(&mut o.w[32 * ib + 8 * l..], IQ1S_GRID[idx], delta);
        }
        let dl = d * ls as f32;
        o.ls[2 * ib] = ls;
        o.ls[2 * ib + 1] = ls;
        o.db[2 * ib] = dl;
        o.db[2 * ib + 1] = dl;
    }
    d
}

/// IQ1_M's f16 super-scale, spread over the top nibbles of its four scale words.
#[inline]
fn iq1m_scale(b: &[u8]) -> f32 {
    let sc = |k: usize| le_u16(b, 48 + 2 * k);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
    crate::dot::f16_to_f32(bits)
}

fn decode_iq1_m(b: &[u8], o: &mut Decoded) -> f32 {
    let d = iq1m_scale(b);
    let (qs, qh) = (&b[0..32], &b[32..48]);
    for ib in 0..8 {
        let sc = le_u16(b, 48 + 2 * (ib / 2));
        for h in 0..2 {
            let ls = 2 * ((sc >> (6 * (ib % 2) + 3 * h)) & 7) as i32 + 1;
            o.ls[2 * ib + h] = ls;
            o.db[2 * ib + h] = d * ls as f32;
        }
        for l in 0..4 {
            let hb = qh[2 * ib + l / 2] as usize;
            let idx = qs[4 * ib + l] as usize | ((hb << (8 - 4 * (l % 2))) & 0x700);
            let delta = if hb & (0x08 << (4 * (l % 2))) != 0 {
                -1
            } else {
                1
            };
            put_iq1(&mut o.w[32 * ib + 8 * l..], IQ1S_GRID[idx], delta);
        }
    }
    d
}

fn decode_iq4_xs(b: &[u8], o: &mut Decoded) -> f32 {
    let d = le_f16(b, 0);
    let sh = le_u16(b, 2);
    let (sl, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..8 {
        let lo = (sl[ib / 2] >> (4 * (ib % 2))) & 0xf;
        let ls = (lo as i32 | ((((sh >> (2 * ib)) & 3) as i32) << 4)) - 32;
        let dl = d * ls as f32;
        for j in 0..16 {
            let q = qs[16 * ib + j];
            o.w[32 * ib + j] = KVALUES_IQ4NL[(q & 0xf) as usize];
            o.w[32 * ib + j + 16] = KVALUES_IQ4NL[(q >> 4) as usize];
        }
        o.ls[2 * ib] = ls;
        o.ls[2 * ib + 1] = ls;
        o.db[2 * ib] = dl;
        o.db[2 * ib + 1] = dl;
    }
    d
}

type Decoder = fn(&[u8], &mut Decoded) -> f32;

/// `y = db · v` where `v = w · unit` is the exact element value before scaling. Multiplying by
/// a signed magnitude rounds the same as ggml's magnitude-times-±1 (rounding is symmetric).
fn dequantize_with(src: &[u8], dst: &mut [f32], type_size: usize, decode: Decoder, unit: f32) {
    let mut o = Decoded::new();
    for (b, y) in src.chunks_exact(type_size).zip(dst.chunks_exact_mut(QK_K)) {
        decode(b, &mut o);
        for (i, v) in y.iter_mut().enumerate() {
            *v = o.db[i / 16] * (o.w[i] as f32 * unit);
        }
    }
}

/// The reference dot product (module doc): 8 lanes, exact i32 lane sums per block, one fused
/// multiply-add per lane per block, `reduce8`, then `post`.
fn dot_with(n: usize, w: &[u8], x: &[u8], type_size: usize, decode: Decoder, post: f32) -> f32 {
    let nb = n / QK_K;
    let mut o = Decoded::new();
    let mut acc = [0f32; 8];
    for (b, xb) in w
        .chunks_exact(type_size)
        .zip(x.chunks_exact(Q8K_BYTES))
        .take(nb)
    {
        let dw = decode(b, &mut o);
        let d = dw * f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]);
        let q = &xb[4..4 + QK_K];
        let mut lanes = [0i32; 8];
        for (i, (w4, q4)) in o.w.chunks_exact(4).zip(q.chunks_exact(4)).enumerate() {
            let s: i32 = w4
                .iter()
                .zip(q4)
                .map(|(&a, &b)| a as i32 * b as i8 as i32)
                .sum();
            lanes[i % 8] += o.ls[i / 4] * s;
        }
        for (a, &l) in acc.iter_mut().zip(&lanes) {
            *a = d.mul_add(l as f32, *a);
        }
    }
    post * reduce8(acc)
}

macro_rules! type_fns {
    ($deq:ident, $dot:ident, $size:expr, $decode:ident, $unit:expr, $post:expr) => {
        fn $deq(src: &[u8], dst: &mut [f32]) {
            dequantize_with(src, dst, $size, $decode, $unit)
        }
        pub(crate) fn $dot(n: usize, w: &[u8], x: &[u8]) -> f32 {
            dot_with(n, w, x, $size, $decode, $post)
        }
    };
}

type_fns!(
    dequantize_iq2_xxs,
    dot_iq2_xxs,
    66,
    decode_iq2_xxs,
    1.0,
    0.125
);
type_fns!(dequantize_iq2_xs, dot_iq2_xs, 74, decode_iq2_xs, 1.0, 0.125);
type_fns!(dequantize_iq2_s, dot_iq2_s, 82, decode_iq2_s, 1.0, 0.125);
type_fns!(
    dequantize_iq3_xxs,
    dot_iq3_xxs,
    98,
    decode_iq3_xxs,
    1.0,
    0.25
);
type_fns!(dequantize_iq3_s, dot_iq3_s, 110, decode_iq3_s, 1.0, 1.0);
type_fns!(dequantize_iq1_s, dot_iq1_s, 50, decode_iq1_s, 0.125, 0.125);
type_fns!(dequantize_iq1_m, dot_iq1_m, 56, decode_iq1_m, 0.125, 0.125);
type_fns!(dequantize_iq4_xs, dot_iq4_xs, 136, decode_iq4_xs, 1.0, 1.0);
