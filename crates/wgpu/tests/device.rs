//! The device layer on whatever adapter is here (lavapipe on CI; skipped with a message when
//! there is none): the arithmetic helpers against the CPU's IEEE operations, the adapter
//! selection's errors, and the binding limit.

use strata_quant::dot::{f16_to_f32, f32_to_f16};
use strata_quant::fp::f32_to_bf16;
use strata_wgpu::{Wgpu, WgpuError};

fn adapter() -> Option<Wgpu> {
    match Wgpu::new() {
        Ok(g) => Some(g),
        Err(WgpuError::NoAdapter(m)) => {
            eprintln!("SKIPPED: no wgpu adapter here ({m})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Random f32 bit patterns: every exponent (subnormals, infinities and NaN included), and
/// values near 1 where most of the kernels' divisions live.
fn patterns(n: usize, seed: u64) -> Vec<f32> {
    let mut r = strata_quant::synth::SplitMix64(seed);
    (0..n)
        .map(|i| {
            let u = r.next_u64() as u32;
            match i % 4 {
                0 => f32::from_bits(u),
                1 => f32::from_bits(u & 0x807f_ffff),
                2 => f32::from_bits((u & 0x807f_ffff) | 0x3f00_0000),
                _ => f32::from_bits((u & 0x80ff_ffff) | 0x4000_0000),
            }
        })
        .collect()
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn soft_division_sqrt_and_conversions_match_the_cpu() {
    let Some(g) = adapter() else { return };
    let n = 1 << 16;
    let a = patterns(n, 1);
    let mut b = patterns(n, 2);
    // Some exact specials: zeros, infinities, 127 and 1 (the kernels' divisors).
    for (i, v) in [0.0f32, -0.0, f32::INFINITY, 127.0, 1.0, f32::MIN_POSITIVE]
        .into_iter()
        .enumerate()
    {
        b[i * 7] = v;
    }
    let (da, db) = (g.upload("a", &a).unwrap(), g.upload("b", &b).unwrap());
    let out = g.upload("out", &vec![0u32; 4 * n]).unwrap();
    let l = g
        .launch(
            "selftest",
            "arith",
            &[],
            &[n as u32],
            &[&da, &db, &out],
            ((n / 64) as u32, 1, 1),
        )
        .unwrap();
    g.run(&[&l], 1).unwrap();
    let o: Vec<u32> = g.download(&out).unwrap();
    let mut bad = Vec::new();
    for i in 0..n {
        let (x, y) = (a[i], b[i]);
        let div = f32::from_bits(o[4 * i]);
        if !same(div, x / y) {
            bad.push(format!("{x:e} / {y:e}: {div:e} vs {:e}", x / y));
        }
        let sq = f32::from_bits(o[4 * i + 1]);
        if !same(sq, x.abs().sqrt()) {
            bad.push(format!("sqrt {x:e}: {sq:e} vs {:e}", x.abs().sqrt()));
        }
        let h = o[4 * i + 2] & 0xffff;
        let want_h = f32_to_f16(x) as u32;
        let nan_ok = x.is_nan() && f16_to_f32(h as u16).is_nan();
        if h != want_h && !nan_ok {
            bad.push(format!("f16 of {x:e}: {h:#06x} vs {want_h:#06x}"));
        }
        let bf = o[4 * i + 2] >> 16;
        if bf != f32_to_bf16(x) as u32 {
            bad.push(format!(
                "bf16 of {x:e}: {bf:#06x} vs {:#06x}",
                f32_to_bf16(x)
            ));
        }
        let back = f32::from_bits(o[4 * i + 3]);
        let want = f16_to_f32(y.to_bits() as u16);
        if !same(back, want) {
            bad.push(format!(
                "f16 {:#06x} to f32: {back:e} vs {want:e}",
                y.to_bits() as u16
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} mismatches, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(8)]
    );
}

#[test]
fn unknown_adapter_is_a_clear_error() {
    match Wgpu::open(Some("no-such-adapter-anywhere")) {
        Err(WgpuError::NoAdapter(m)) => {
            assert!(
                m.contains("no-such-adapter-anywhere") || m.contains("adapter"),
                "{m}"
            )
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(g) => panic!("opened {}", g.describe()),
    }
}

#[test]
fn binding_limit_is_respected() {
    let Some(mut g) = adapter() else { return };
    let d = g.describe();
    assert!(d.contains("storage binding"), "{d}");
    eprintln!("{d}");
    g.force_binding_limit(4096);
    assert!(g.upload("small", &[0u8; 4096]).is_ok());
    match g.upload("big", &[0u8; 4100]) {
        Err(WgpuError::TooLarge { bytes, limit, .. }) => {
            assert_eq!((bytes, limit), (4100, 4096));
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a buffer over the binding limit was accepted"),
    }
}

#[test]
fn bad_shapes_are_errors() {
    let Some(g) = adapter() else { return };
    let x = g.upload("x", &[0f32; 100]).unwrap();
    let out = g.upload("out", &[0u8; 64]).unwrap();
    let r = strata_wgpu::ops::rms_xprep(
        &g,
        "optimized",
        &x,
        &x,
        &out,
        1,
        2560,
        1e-6,
        strata_engine::kernels::ActFmt::Q8_0,
    );
    assert!(matches!(r, Err(WgpuError::Launch { .. })), "{:?}", r.err());
    let r = strata_wgpu::ops::route(&g, "fastest", &x, &x, &x, 1, 64, 4);
    assert!(matches!(r, Err(WgpuError::Kernel(_))), "{:?}", r.err());
}
