//! The SIMD activation quantizers (`quantize_fn(ty, isa)`) against the scalar reference
//! (`quantize_fn(ty, Isa::Scalar)`), byte for byte: random rows over many magnitudes, halfway
//! points of the rounding, and the special values (±0, subnormals, ±inf, NaN, the largest
//! finite values), for every ISA this CPU supports.

use proptest::prelude::*;
use strata_quant::{quantize_fn, simd, GgmlType, Isa};

const TYPES: [GgmlType; 1] = [GgmlType::Q8_0];

fn check(ty: GgmlType, x: &[f32]) {
    let reference = quantize_fn(ty, Isa::Scalar).unwrap();
    let mut want = vec![0u8; ty.row_bytes(x.len()).unwrap()];
    reference(x, &mut want);
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !simd::supported(isa) {
            eprintln!("skipping {}: not supported by this CPU", isa.name());
            continue;
        }
        let f = quantize_fn(ty, isa).unwrap();
        let mut got = vec![0xa5u8; want.len()];
        f(x, &mut got);
        assert_eq!(got, want, "{ty} {} on {x:?}", isa.name());
    }
}

#[test]
fn special_values_and_halfway_points() {
    let specials = [
        0.0f32,
        -0.0,
        1e-45,
        -1e-45,
        1e-38,
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        1.0,
        -1.0,
        0.5,
        127.0,
        -128.0,
    ];
    for ty in TYPES {
        // Every special value in every position of a block of small values, and blocks made
        // only of specials.
        for (i, &s) in specials.iter().enumerate() {
            for pos in [0, 7, 16, 31] {
                let mut x: Vec<f32> = (0..32).map(|j| (j as f32 - 15.5) * 0.03).collect();
                x[pos] = s;
                check(ty, &x);
            }
            let x: Vec<f32> = (0..32)
                .map(|j| specials[(i + j) % specials.len()])
                .collect();
            check(ty, &x);
            check(ty, &[s; 32]);
        }
        // amax = 127 makes `id` 1, so these land exactly on halves.
        let x: Vec<f32> = (0..64)
            .map(|j| {
                if j == 0 {
                    127.0
                } else {
                    (j as f32 - 32.0) + 0.5
                }
            })
            .collect();
        check(ty, &x);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn random_rows_match_the_reference(
        blocks in 1usize..9,
        exp in -40i32..40,
        seed in any::<u64>(),
    ) {
        let mut s = seed | 1;
        let scale = 2f32.powi(exp);
        let x: Vec<f32> = (0..32 * blocks)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect();
        for ty in TYPES {
            check(ty, &x);
        }
    }
}
