//! The exact tensor-core products (kernels/mmq.cu, `model::matmul` beyond 8 rows and
//! `model::moe_matmul`; and the register-tiled BF16 product beside them) against the kernels whose order they reproduce: the tiled product
//! (`model::matmul_tiled`, bound to the GEMV and the CPU by tests/model_ops.rs), the GEMV itself
//! (`ops::gemv`, baseline variant) on the first rows, and the per-pair expert GEMV (`moe_gemv`).
//! Every comparison is bitwise, for every integer-dot format, on random valid blocks
//! (`testdata::weight_blocks`) and activations with −0.0, denormals and large magnitudes, at odd
//! row counts (partial 32-row tiles) and row lengths whose unit counts end mid-chunk.
//!
//! Needs a GPU: each test prints SKIPPED and passes without one (CI has none). Run on the GPU
//! machine with `--test-threads 1`.

use std::sync::OnceLock;

use cudarc::driver::CudaSlice;
use strata_cuda::model::{self as m, DevWeight};
use strata_cuda::{ops, Gpu};
use strata_engine::kernels::actq::{quantize_row, ActFmt};
use strata_engine::kernels::testdata::{weight_blocks, Rng};
use strata_gguf::GgmlType;

const FORMATS: [GgmlType; 12] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::IQ4_NL,
    GgmlType::Q2_0,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
];

fn gpu() -> Option<&'static Gpu> {
    static G: OnceLock<Result<Gpu, String>> = OnceLock::new();
    match G.get_or_init(|| Gpu::new(0).map_err(|e| e.to_string())) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED (no usable GPU): {e}");
            None
        }
    }
}

fn up<T: cudarc::driver::DeviceRepr>(g: &Gpu, v: &[T]) -> CudaSlice<T> {
    g.upload(v).expect("upload")
}

fn down(g: &Gpu, v: &CudaSlice<f32>) -> Vec<f32> {
    g.download(v).expect("download")
}

/// Bit for bit; a reference of only zeros (or only non-finite values) would prove nothing.
fn bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(
        want.iter().any(|v| *v != 0.0 && v.is_finite()),
        "{what}: the reference is all zeros or non-finite; the comparison would prove nothing"
    );
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} of {}: {:e} ({:#010x}) vs {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Inputs the activation quantizers keep finite (an F16 block scale overflows past 65504·127;
/// what an infinite scale gives then depends on the order of the sums on either side).
fn tame(v: Vec<f32>) -> Vec<f32> {
    v.into_iter()
        .map(|x| if x.abs() > 1e4 { 100f32.copysign(x) } else { x })
        .collect()
}

fn act_bytes(ty: GgmlType, x: &[f32], nt: usize, k: usize) -> Vec<u8> {
    let fmt = ActFmt::for_weight(ty).unwrap();
    let rb = fmt.row_bytes(k).unwrap();
    let mut out = vec![0u8; nt * rb];
    for t in 0..nt {
        quantize_row(fmt, &x[t * k..(t + 1) * k], &mut out[t * rb..(t + 1) * rb]);
    }
    out
}

/// Row lengths per format: the model's 2560 (80 units: the last round of 32 lane classes is
/// half full) and a short one (20 or 24 units: the first chunk is partial).
fn lengths(ty: GgmlType) -> [usize; 2] {
    if ty.block_size() == 256 {
        [2560, 768]
    } else {
        [2560, 640]
    }
}

#[test]
fn mmq_equals_tiled_and_gemv_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(41);
    let rows = 75; // two full 32-row tiles and a partial one
    for ty in FORMATS {
        for k in lengths(ty) {
            let wb = weight_blocks(ty, rows * k / ty.block_size(), rng.u64());
            let dw = DevWeight::upload(g, ty, &wb, rows, k, 1).unwrap();
            for nt in [9usize, 17, 64, 200, 512] {
                let x = tame(rng.f32_vec_special(nt * k, 1.0));
                let xq = act_bytes(ty, &x, nt, k);
                let dx = up(g, &xq);
                let mut y = g.zeros::<f32>(nt * rows).unwrap();
                let mut yt = g.zeros::<f32>(nt * rows).unwrap();
                m::matmul(g, &dw, &dx, nt, &mut y).unwrap();
                m::matmul_tiled(g, &dw, &dx, nt, &mut yt).unwrap();
                let got = down(g, &y);
                bitwise(
                    &format!("mmq {ty} k={k} nt={nt} vs tiled"),
                    &got,
                    &down(g, &yt),
                );
                if strata_engine::kernels::gemv::GEMV_FORMATS.contains(&ty) {
                    // The GEMV (baseline variant: runtime shapes) on the first 8 rows.
                    let mut yg = g.zeros::<f32>(8 * rows).unwrap();
                    let x8 = up(g, &xq[..8 * (xq.len() / nt)]);
                    ops::gemv(g, "baseline", ty, &dw.bytes, rows, k, &x8, 8, &mut yg).unwrap();
                    bitwise(
                        &format!("mmq {ty} k={k} nt={nt} vs gemv"),
                        &got[..8 * rows],
                        &down(g, &yg),
                    );
                }
            }
            eprintln!("mmq {ty} k={k}: bitwise at nt 9, 17, 64, 200, 512");
        }
    }
}

/// BF16 beyond the GEMV window (the register-tiled kernel, `model::matmul` from 9 rows) against
/// the tiled kernel, bitwise, at the model's shapes: the hyper-connection up (K = 320: 10 units,
/// the half-warp kernel; K = 512, its limit), down / inject (K = 10240), the router (K = 2560),
/// at row counts that end mid-warp and mid-block.
#[test]
fn bf16_products_equal_tiled_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(43);
    let ty = GgmlType::BF16;
    for (rows, k) in [
        (75usize, 320usize),
        (37, 512),
        (4, 10240),
        (37, 10240),
        (75, 2560),
        (320, 640),
    ] {
        let wb = weight_blocks(ty, rows * k / ty.block_size(), rng.u64());
        let dw = DevWeight::upload(g, ty, &wb, rows, k, 1).unwrap();
        for nt in [9usize, 17, 64, 200, 512] {
            let x = tame(rng.f32_vec_special(nt * k, 1.0));
            let dx = up(g, &act_bytes(ty, &x, nt, k));
            let mut y = g.zeros::<f32>(nt * rows).unwrap();
            let mut yt = g.zeros::<f32>(nt * rows).unwrap();
            m::matmul(g, &dw, &dx, nt, &mut y).unwrap();
            m::matmul_tiled(g, &dw, &dx, nt, &mut yt).unwrap();
            bitwise(
                &format!("bf16 {rows}x{k} nt={nt} vs tiled"),
                &down(g, &y),
                &down(g, &yt),
            );
        }
        eprintln!("bf16 {rows}x{k}: bitwise at nt 9, 17, 64, 200, 512");
    }
}

/// Routes of `nt` tokens × `ks` distinct experts out of `ne`: expert 0 on every token (one
/// expert with many pairs), the others drawn from 1..ne/2 (the upper half gets no pair).
fn uneven_routes(rng: &mut Rng, nt: usize, ks: usize, ne: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(nt * ks);
    for _ in 0..nt {
        let others = rng.distinct(ks - 1, ne / 2 - 1);
        ids.extend(std::iter::once(0).chain(others.into_iter().map(|e| e + 1)));
    }
    ids
}

#[test]
fn moe_mmq_equals_per_pair_gemv_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(42);
    let (rows, ne, ks) = (75usize, 16usize, 4usize);
    for (i, ty) in FORMATS.into_iter().enumerate() {
        let k = lengths(ty)[i % 2];
        let wb = weight_blocks(ty, ne * rows * k / ty.block_size(), rng.u64());
        let dw = DevWeight::upload(g, ty, &wb, rows, k, ne).unwrap();
        for nt in [3usize, 9, 64, 200] {
            let ids = uneven_routes(&mut rng, nt, ks, ne);
            let np = nt * ks;
            let di = up(g, &ids);
            let mut err = g.zeros::<u32>(1).unwrap();
            let mut groups = m::MoeGroups::new(g, np, ne).unwrap();
            groups.build(g, &di, &mut err).unwrap();
            // Gate/up (one activation row a token) and down (one a pair).
            for per_slot in [false, true] {
                let xrows = if per_slot { np } else { nt };
                let x = tame(rng.f32_vec_special(xrows * k, 1.0));
                let dx = up(g, &act_bytes(ty, &x, xrows, k));
                let mut y = g.zeros::<f32>(np * rows).unwrap();
                let mut yt = g.zeros::<f32>(np * rows).unwrap();
                let mut yp = g.zeros::<f32>(np * rows).unwrap();
                m::moe_matmul(g, &dw, &groups, &dx, per_slot, ks, &mut y).unwrap();
                m::moe_matmul_tiled(g, &dw, &groups, &dx, per_slot, ks, &mut yt).unwrap();
                m::moe_gemv(g, &dw, &di, &dx, per_slot, ks, np, &mut yp, &mut err).unwrap();
                let got = down(g, &y);
                let what = format!("moe_mmq {ty} k={k} nt={nt} per_slot={per_slot}");
                bitwise(&format!("{what} vs per-pair gemv"), &got, &down(g, &yp));
                bitwise(&format!("{what} vs tiled"), &got, &down(g, &yt));
            }
            assert_eq!(g.download(&err).unwrap(), vec![0], "error word");
        }
        eprintln!("moe_mmq {ty} k={k}: bitwise at nt 3, 9, 64, 200");
    }
}
