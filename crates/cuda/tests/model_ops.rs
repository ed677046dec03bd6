//! The model operations on the GPU (`strata_cuda::model`) against the CPU backend
//! (`strata_engine::CpuBackend`, the reference implementation of every operation), on random
//! inputs with −0.0, denormals and large magnitudes (`testdata::Rng::f32_special`).
//!
//! Bitwise where the device does the CPU's arithmetic in the CPU's order (data movement, adds,
//! the F16 rounding, conv sums, QSA scores and selections, the combine of expert outputs, and
//! every product against the GEMV: tiled matmul, MoE decode and grouped prefill, prefill rows of
//! the recurrent GDN step against single steps). Within a stated bound where the device calls
//! expf/log1pf (the host libm differs in the last bits), or sums in a different order (the
//! canonical block sums of the norms, the products' lane order against the CPU's dot).
//!
//! Needs a GPU: each test prints SKIPPED and passes without one (CI has none). Run on the GPU
//! machine with `--test-threads 1`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaSlice;
use strata_cuda::backend::CudaBuf;
use strata_cuda::model::{self as m, DevWeight};
use strata_cuda::{ops, Gpu};
use strata_engine::backend::StepInputs;
use strata_engine::backend::{AttnDims, DevicePick, ExpertWeights, KvType};
use strata_engine::cpu::{CpuIds, CpuRoutes, CpuSelection};
use strata_engine::kernels::actq::{quantize_row, ActFmt};
use strata_engine::kernels::testdata::{weight_blocks, Rng};
use strata_engine::qwen4exp::ops::{
    moe_block_composed, qsa_prepare_composed, GdnDims, GdnParams, HcWeights, QsaCaches, QsaIndexW,
    QsaPrepW, QsaRows, QsaRule, QsaSelect,
};
use strata_engine::qwen4exp::weights::MoeW;
use strata_engine::{Backend, CpuBackend, CpuBuf, CpuWeight};
use strata_engine::{DeviceBuf, Qwen4expOps};
use strata_gguf::{GgmlType, GgufFile, GgufWriter};

// ---- set-up -------------------------------------------------------------------------------

/// Host ids as the CPU backend's step inputs.
fn ids(v: &[u32]) -> CpuIds {
    CpuIds(v.to_vec())
}

/// Appends rows at the end of a CPU cache (written at its next positions, as a step does).
fn append_kv(be: &CpuBackend, cache: &mut CpuBuf, x: &CpuBuf, kv: KvType) {
    let start = cache.rows() as u32;
    let at: Vec<u32> = (start..start + x.rows() as u32).collect();
    be.write_kv(cache, x, &ids(&at), kv).unwrap();
}

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

fn cpu() -> CpuBackend {
    CpuBackend::new(2).expect("cpu backend")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

/// An in-memory GGUF file of (name, ggml dims, type, bytes).
fn gguf_of(specs: &[(&str, Vec<u64>, GgmlType, Vec<u8>)]) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    for (name, dims, ty, data) in specs {
        w.add_tensor(name, dims, *ty, data).expect("tensor");
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes().expect("gguf"), "test").expect("read"))
}

/// CPU weights from (name, ggml dims, type, bytes), through an in-memory GGUF file.
fn weights(specs: Vec<(&str, Vec<u64>, GgmlType, Vec<u8>)>) -> HashMap<String, CpuWeight> {
    let file = gguf_of(&specs);
    let be = cpu();
    file.tensors()
        .iter()
        .map(|info| {
            (
                info.name.clone(),
                be.load_weight(&file, info).expect("load"),
            )
        })
        .collect()
}

fn up<T: cudarc::driver::DeviceRepr>(g: &Gpu, v: &[T]) -> CudaSlice<T> {
    g.upload(v).expect("upload")
}

fn down(g: &Gpu, v: &CudaSlice<f32>) -> Vec<f32> {
    g.download(v).expect("download")
}

fn buf(rows: usize, cols: usize, v: &[f32]) -> CpuBuf {
    CpuBuf::new(rows, cols, v.to_vec()).expect("buf")
}

// ---- comparisons ------------------------------------------------------------------------------

/// A comparison that could not fail is no test: the reference must hold values other than
/// zeros (all-zero rows on both sides would agree whatever the kernel did).
fn nontrivial(what: &str, want: &[f32]) {
    assert!(
        want.iter().any(|v| *v != 0.0 && v.is_finite()),
        "{what}: the reference is all zeros or non-finite; the comparison would prove nothing"
    );
}

fn bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    nontrivial(what, want);
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} of {}: {:e} ({:#010x}) vs CPU {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
    eprintln!("{what}: bitwise ({} values)", got.len());
}

/// `|got − want| ≤ tol(i)` everywhere (NaN only against NaN); prints the worst ratio and how
/// many values are bitwise equal.
fn within(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    nontrivial(what, want);
    let (mut worst, mut same) = (0f64, 0usize);
    for i in 0..got.len() {
        let (g, w) = (got[i], want[i]);
        if g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()) {
            same += 1;
            continue;
        }
        let e = (g as f64 - w as f64).abs();
        let t = tol(i);
        assert!(
            e <= t,
            "{what}: element {i} of {}: {g:e} vs CPU {w:e}: error {e:e} over the bound {t:e}",
            got.len()
        );
        if t > 0.0 {
            worst = worst.max(e / t);
        }
    }
    let amax = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |a, &x| a.max(x.abs()));
    eprintln!(
        "{what}: within bound (worst {:.1}% of it), {same}/{} bitwise, max |ref| {amax:e}",
        worst * 100.0,
        got.len()
    );
}

/// Relative bound `rel · |want| + abs`.
fn rel(want: &[f32], rel: f64, abs: f64) -> impl Fn(usize) -> f64 + '_ {
    move |i| rel * (want[i] as f64).abs() + abs
}

/// Bound relative to the largest magnitude of the element's row (`cols` wide).
fn row_rel(want: &[f32], cols: usize, rel: f64) -> impl Fn(usize) -> f64 + '_ {
    let maxes: Vec<f64> = want
        .chunks(cols)
        .map(|r| {
            r.iter()
                .filter(|x| x.is_finite())
                .fold(0f64, |a, &x| a.max((x as f64).abs()))
        })
        .collect();
    move |i| rel * maxes[i / cols] + 1e-30
}

// ---- element-wise and row-wise ---------------------------------------------------------------

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(11);
    let (rows, cols) = (5usize, 2560usize);
    let n = rows * cols;
    let a = rng.f32_vec_special(n, 2.0);
    let b = rng.f32_vec_special(n, 2.0);
    let bias = rng.f32_vec_special(cols, 1.0);
    let gate = rng.f32_vec_special(rows, 3.0);
    let w = weights(vec![(
        "bias",
        vec![cols as u64],
        GgmlType::F32,
        f32_bytes(&bias),
    )]);
    let (da, db) = (up(g, &a), up(g, &b));
    let mut out = g.zeros::<f32>(n).unwrap();

    // add_assign, add, add_bias: bitwise.
    let mut x = buf(rows, cols, &a);
    be.add_assign(&mut x, &buf(rows, cols, &b)).unwrap();
    let mut dx = up(g, &a);
    m::add_assign(g, &mut dx, &db, n).unwrap();
    bitwise("add_assign", &down(g, &dx), x.as_slice());
    m::add(g, &da, &db, &mut out, n).unwrap();
    bitwise("add", &down(g, &out), x.as_slice());
    let mut x = buf(rows, cols, &a);
    be.add_bias(&mut x, &w["bias"]).unwrap();
    let mut dx = up(g, &a);
    m::add_bias(g, &mut dx, &up(g, &bias), rows, cols).unwrap();
    bitwise("add_bias", &down(g, &dx), x.as_slice());

    // swiglu, mul_sigmoid, add_sigmoid_gated: the device's expf; 4e-6 relative.
    let want = be
        .swiglu(&buf(rows, cols, &a), &buf(rows, cols, &b))
        .unwrap();
    m::swiglu(g, &da, &db, &mut out, n).unwrap();
    within(
        "swiglu",
        &down(g, &out),
        want.as_slice(),
        rel(want.as_slice(), 4e-6, 1e-37),
    );
    let want = be
        .mul_sigmoid(&buf(rows, cols, &a), &buf(rows, cols, &b))
        .unwrap();
    m::mul_sigmoid(g, &da, &db, &mut out, n).unwrap();
    within(
        "mul_sigmoid",
        &down(g, &out),
        want.as_slice(),
        rel(want.as_slice(), 4e-6, 1e-37),
    );
    let mut y = buf(rows, cols, &a);
    be.add_sigmoid_gated(&mut y, &buf(rows, cols, &b), &buf(rows, 1, &gate))
        .unwrap();
    let mut dy = up(g, &a);
    m::add_sigmoid_gated(g, &mut dy, &db, &up(g, &gate), rows, cols).unwrap();
    let scale: Vec<f64> = (0..n).map(|i| (a[i].abs() + b[i].abs()) as f64).collect();
    within("add_sigmoid_gated", &down(g, &dy), y.as_slice(), |i| {
        4e-6 * scale[i] + 1e-37
    });

    // deinterleave (the per-head [q | gate] split) and the stream combine: bitwise.
    let parts = be.deinterleave(&buf(rows, cols, &a), 256, 2).unwrap();
    let want: Vec<f32> = parts.iter().flat_map(|p| p.as_slice().to_vec()).collect();
    m::deinterleave(g, &da, &mut out, rows, cols, 256, 2).unwrap();
    bitwise("deinterleave", &down(g, &out), &want);
    let (s, h) = (4usize, 640usize);
    let inj = rng.f32_vec_special(rows * s, 1.0);
    let yv = rng.f32_vec_special(rows * h, 1.0);
    let mut x = buf(rows, s * h, &a);
    be.hc_combine(&mut x, &buf(rows, h, &yv), Some(&buf(rows, s, &inj)))
        .unwrap();
    let mut dx = up(g, &a);
    m::hc_combine(g, &mut dx, &up(g, &yv), &up(g, &inj), rows, h, s).unwrap();
    bitwise("hc_combine", &down(g, &dx), x.as_slice());

    // ple_gate: z by the canonical block sum, then sqrt and σ; 2e-5 relative.
    let (ph, ps) = (640usize, 4usize);
    let k = rng.f32_vec_special(rows * ps * ph, 1.0);
    let q = rng.f32_vec_special(rows * ps * ph, 1.0);
    let v = rng.f32_vec_special(rows * ph, 1.0);
    let want = be
        .ple_gate(
            &buf(rows, ps * ph, &k),
            &buf(rows, ps * ph, &q),
            &buf(rows, ph, &v),
            ps,
        )
        .unwrap();
    m::ple_gate(
        g,
        &up(g, &k),
        &up(g, &q),
        &up(g, &v),
        &mut out,
        rows,
        ph,
        ps,
    )
    .unwrap();
    let got = down(g, &out);
    within(
        "ple_gate",
        &got[..rows * ps * ph],
        want.as_slice(),
        rel(want.as_slice(), 2e-5, 1e-37),
    );
}

#[test]
fn rms_norm_and_rope_match_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(12);
    let rows = 7usize;
    // The hyper-connection norm (4 streams of 2560, a weight per column) and a per-head norm
    // (heads of 256, one weight broadcast).
    for (cols, group, wlen) in [
        (10240usize, 2560usize, 10240usize),
        (6144, 256, 256),
        (512, 128, 128),
    ] {
        let x = rng.f32_vec_special(rows * cols, 1.5);
        let wv: Vec<f32> = (0..wlen).map(|_| 1.0 + 0.02 * rng.normal()).collect();
        let w = weights(vec![(
            "w",
            vec![wlen as u64],
            GgmlType::F32,
            f32_bytes(&wv),
        )]);
        let want = be
            .rms_norm(&buf(rows, cols, &x), &w["w"], group, 1e-6)
            .unwrap();
        let mut out = g.zeros::<f32>(rows * cols).unwrap();
        m::rms_norm(
            g,
            &up(g, &x),
            &up(g, &wv),
            &mut out,
            rows,
            cols,
            group,
            1e-6,
        )
        .unwrap();
        within(
            &format!("rms_norm {cols}/{group}"),
            &down(g, &out),
            want.as_slice(),
            rel(want.as_slice(), 1e-5, 1e-37),
        );
    }
    // rope: positions from a device buffer; cos/sin of the same f64 angle, rounded to f32.
    for (cols, hd, rot, theta) in [(6144usize, 256usize, 64usize, 1e7f32), (896, 64, 64, 1e6)] {
        let x = rng.f32_vec_special(rows * cols, 1.0);
        let pos: Vec<u32> = (0..rows).map(|_| rng.below(40000) as u32).collect();
        let mut want = buf(rows, cols, &x);
        be.rope_neox(&mut want, hd, rot, theta, &ids(&pos)).unwrap();
        let mut dx = up(g, &x);
        let freqs = up(g, &m::rope_freqs(rot, theta));
        m::rope_neox(g, &mut dx, &up(g, &pos), &freqs, rows, cols, hd, rot).unwrap();
        let half = rot / 2;
        // One f32 ulp of cos or sin on either product: 3e-7 of |x0| + |x1|.
        let tol = |i: usize| {
            let (head, j) = (i / hd * hd, i % hd);
            if j >= rot {
                return 0.0;
            }
            let k = j % half;
            3e-7 * (x[head + k].abs() as f64 + x[head + k + half].abs() as f64) + 1e-38
        };
        within(
            &format!("rope {hd}/{rot}"),
            &down(g, &dx),
            want.as_slice(),
            tol,
        );
    }
}

// ---- hyper-connection mix ----------------------------------------------------------------------

#[test]
fn hc_mix_matches_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(13);
    let (s, h, rank) = (4usize, 2560usize, 320usize);
    let sh = s * h;
    let norm: Vec<f32> = (0..sh).map(|_| 1.0 + 0.02 * rng.normal()).collect();
    let down_w = rng.f32_vec(rank * sh, 0.02);
    let up_w = rng.f32_vec(sh * rank, 0.02);
    let inj_w = rng.f32_vec(s * sh, 0.02);
    let w = weights(vec![
        ("norm", vec![sh as u64], GgmlType::F32, f32_bytes(&norm)),
        (
            "down",
            vec![sh as u64, rank as u64],
            GgmlType::BF16,
            bf16_bytes(&down_w),
        ),
        (
            "up",
            vec![rank as u64, sh as u64],
            GgmlType::BF16,
            bf16_bytes(&up_w),
        ),
        (
            "inj",
            vec![sh as u64, s as u64],
            GgmlType::BF16,
            bf16_bytes(&inj_w),
        ),
    ]);
    let inj_dev = DevWeight::upload(g, GgmlType::BF16, &bf16_bytes(&inj_w), s, sh, 1).unwrap();
    let hc = m::HcDev {
        norm: &up(g, &norm),
        down: &DevWeight::upload(g, GgmlType::BF16, &bf16_bytes(&down_w), rank, sh, 1).unwrap(),
        up: &DevWeight::upload(g, GgmlType::BF16, &bf16_bytes(&up_w), sh, rank, 1).unwrap(),
        inject: Some(&inj_dev),
        streams: s,
        h,
        eps: 1e-6,
        fast: false,
    };
    let mut scratch = m::HcScratch::new(g, &hc, 11).unwrap();
    for rows in [1usize, 3, 11] {
        let x = rng.f32_vec_special(rows * sh, 1.0);
        let (u, inj) = be
            .hc_mix(
                &HcWeights {
                    norm: &w["norm"],
                    down: &w["down"],
                    up: &w["up"],
                    inject: Some(&w["inj"]),
                    streams: s,
                    eps: 1e-6,
                },
                &buf(rows, sh, &x),
            )
            .unwrap();
        let inj = inj.unwrap();
        let mut du = g.zeros::<f32>(rows * h).unwrap();
        let mut dinj = g.zeros::<f32>(rows * s).unwrap();
        m::hc_mix(
            g,
            &hc,
            &up(g, &x),
            rows,
            &mut scratch,
            &mut du,
            Some(&mut dinj),
        )
        .unwrap();
        // Norm sums in another order, then BF16 products in another lane order (and a BF16
        // rounding of an activation that sits on a rounding edge may go the other way):
        // within 1e-3 of the row's largest |u| and 1e-3 of inj's range (0..2).
        within(
            &format!("hc_mix u, {rows} rows"),
            &down(g, &du),
            u.as_slice(),
            row_rel(u.as_slice(), h, 1e-3),
        );
        within(
            &format!("hc_mix inj, {rows} rows"),
            &down(g, &dinj),
            inj.as_slice(),
            |_| 2e-3,
        );
        // A batch (the tiled products past 8 rows, the optimized GEMVs up to 8) equals its
        // rows mixed one at a time, bit for bit.
        let (mut su, mut si) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let mut u1 = g.zeros::<f32>(h).unwrap();
            let mut i1 = g.zeros::<f32>(s).unwrap();
            let x1 = up(g, &x[r * sh..(r + 1) * sh]);
            m::hc_mix(g, &hc, &x1, 1, &mut scratch, &mut u1, Some(&mut i1)).unwrap();
            su.extend(down(g, &u1));
            si.extend(down(g, &i1));
        }
        bitwise(
            &format!("hc_mix u, {rows} rows vs one at a time"),
            &down(g, &du),
            &su,
        );
        bitwise(
            &format!("hc_mix inj, {rows} rows vs one at a time"),
            &down(g, &dinj),
            &si,
        );
    }
}

// ---- products ----------------------------------------------------------------------------------

/// Specials for the products (±0, denormals) with the large ones brought down to ±100: a Q8_0
/// activation block stores its scale max/127 as F16, which overflows past 65504·127, and what a
/// dot of an infinite scale gives (inf, or NaN where it meets a zero) depends on the order of
/// the sum on either side. The model's products read normed rows, far from that.
fn tame(v: Vec<f32>) -> Vec<f32> {
    v.into_iter()
        .map(|x| if x.abs() > 1e4 { 100f32.copysign(x) } else { x })
        .collect()
}

/// `|y − ref| ≤ 1e-4 · Σ|w_i · x_i|` with the weight dequantized (the two dot orders and the
/// activation quantization, which both sides do bitwise alike).
fn dot_tol(ty: GgmlType, wb: &[u8], m: usize, k: usize, x: &[f32], nt: usize) -> Vec<f64> {
    let rb = ty.row_bytes(k).unwrap();
    let mut wd = vec![0f32; k];
    let mut tol = vec![0f64; nt * m];
    for r in 0..m {
        strata_quant::dequantize(ty, &wb[r * rb..(r + 1) * rb], &mut wd).unwrap();
        for t in 0..nt {
            let a: f64 = wd
                .iter()
                .zip(&x[t * k..(t + 1) * k])
                .map(|(&p, &q)| (p as f64 * q as f64).abs())
                .sum();
            tol[t * m + r] = 1e-4 * a + 1e-30;
        }
    }
    tol
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

#[test]
fn matmul_equals_gemv_and_matches_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(14);
    let (mm, k, nt) = (72usize, 2560usize, 19usize);
    for ty in strata_engine::kernels::gemv::GEMV_FORMATS.iter().copied() {
        let wb = weight_blocks(ty, mm * k / ty.block_size(), rng.u64());
        let x = tame(rng.f32_vec_special(nt * k, 1.0));
        let w = weights(vec![("w", vec![k as u64, mm as u64], ty, wb.clone())]);
        let want = be.matmul(&w["w"], &buf(nt, k, &x)).unwrap();
        let dw = DevWeight::upload(g, ty, &wb, mm, k, 1).unwrap();
        let xq = act_bytes(ty, &x, nt, k);
        let mut y = g.zeros::<f32>(nt * mm).unwrap();
        m::matmul(g, &dw, &up(g, &xq), nt, &mut y).unwrap();
        let got = down(g, &y);
        // Against the GEMV (1..8 rows a call): the same order, bitwise.
        let xr = xq.len() / nt;
        let mut gv = Vec::new();
        for t0 in (0..nt).step_by(8) {
            let tn = 8.min(nt - t0);
            let mut yy = g.zeros::<f32>(tn * mm).unwrap();
            ops::gemv(
                g,
                "optimized",
                ty,
                &dw.bytes,
                mm,
                k,
                &up(g, &xq[t0 * xr..(t0 + tn) * xr]),
                tn,
                &mut yy,
            )
            .unwrap();
            gv.extend(down(g, &yy));
        }
        bitwise(&format!("matmul {ty} vs gemv"), &got, &gv);
        let tol = dot_tol(ty, &wb, mm, k, &x, nt);
        within(&format!("matmul {ty} vs CPU"), &got, want.as_slice(), |i| {
            tol[i]
        });
    }
    // The formats with the tiled kernel only (no GEMV): every row of a batch of 19 equals the
    // same row alone, and the CPU's within the dot bound.
    for ty in [
        GgmlType::Q3_K,
        GgmlType::F32,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::IQ4_NL,
    ] {
        let wb = weight_blocks(ty, mm * k / ty.block_size(), rng.u64());
        let x = tame(rng.f32_vec_special(nt * k, 1.0));
        let w = weights(vec![("w", vec![k as u64, mm as u64], ty, wb.clone())]);
        let want = be.matmul(&w["w"], &buf(nt, k, &x)).unwrap();
        let dw = DevWeight::upload(g, ty, &wb, mm, k, 1).unwrap();
        let xq = act_bytes(ty, &x, nt, k);
        let mut y = g.zeros::<f32>(nt * mm).unwrap();
        m::product(g, &dw, &up(g, &xq), nt, &mut y).unwrap();
        let got = down(g, &y);
        let xr = xq.len() / nt;
        let mut single = Vec::new();
        for t in 0..nt {
            let mut yy = g.zeros::<f32>(mm).unwrap();
            m::product(g, &dw, &up(g, &xq[t * xr..(t + 1) * xr]), 1, &mut yy).unwrap();
            single.extend(down(g, &yy));
        }
        bitwise(&format!("matmul {ty} batch vs single rows"), &got, &single);
        let tol = dot_tol(ty, &wb, mm, k, &x, nt);
        within(&format!("matmul {ty} vs CPU"), &got, want.as_slice(), |i| {
            tol[i]
        });
    }
}

// ---- unit-parallel products and the fused mix / experts (bitwise against the composed) --------

/// The unit-parallel product (one launch for up to four weights of a format) equals the tiled
/// kernel (gemv_base's order) bit for bit, for every product format, short and long rows, few
/// and many rows, 1..=8 activation rows.
#[test]
fn unit_parallel_products_equal_the_tiled_kernel() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(31);
    let mut formats: Vec<GgmlType> = strata_engine::kernels::gemv::GEMV_FORMATS.to_vec();
    formats.extend([
        GgmlType::Q3_K,
        GgmlType::F32,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::IQ4_NL,
    ]);
    for ty in formats {
        let mut shapes = vec![(3usize, 37usize, 2560usize), (200, 1, 6144)];
        if ty.block_size() == 32 || ty == GgmlType::BF16 || ty == GgmlType::F32 {
            shapes.extend([(41, 9, 640), (300, 2, 320)]);
        }
        for (ra, rbw, k) in shapes {
            let wa = weight_blocks(ty, ra * k / ty.block_size(), rng.u64());
            let wb = weight_blocks(ty, rbw * k / ty.block_size(), rng.u64());
            let da = DevWeight::upload(g, ty, &wa, ra, k, 1).unwrap();
            let db = DevWeight::upload(g, ty, &wb, rbw, k, 1).unwrap();
            for nt in [1usize, 2, 5, 8] {
                let x = tame(rng.f32_vec_special(nt * k, 1.0));
                let xq = up(g, &act_bytes(ty, &x, nt, k));
                let (mut ta, mut tb) = (
                    g.zeros::<f32>(nt * ra).unwrap(),
                    g.zeros::<f32>(nt * rbw).unwrap(),
                );
                m::matmul(g, &da, &xq, nt, &mut ta).unwrap();
                m::matmul(g, &db, &xq, nt, &mut tb).unwrap();
                let (mut ua, mut ub) = (
                    g.zeros::<f32>(nt * ra).unwrap(),
                    g.zeros::<f32>(nt * rbw).unwrap(),
                );
                m::product_units(g, &[&da, &db], &mut [&mut ua, &mut ub], &xq, nt).unwrap();
                let what = format!("units {ty} {ra}+{rbw}×{k} nt={nt}");
                bitwise(&format!("{what} (first)"), &down(g, &ua), &down(g, &ta));
                bitwise(&format!("{what} (second)"), &down(g, &ub), &down(g, &tb));
            }
        }
    }
}

/// The model's own optimized GEMVs (model::direct_opt: Q3_K rows of 2560 with many rows,
/// Q4_K / Q5_K rows of 6144 for one activation row, BF16 rows of 10240) equal the tiled kernel
/// (gemv_base's order) bit for bit, with a last block of fewer than eight rows.
#[test]
fn direct_optimized_gemvs_equal_the_tiled_kernel() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(47);
    let cases: [(GgmlType, usize, usize, &[usize]); 4] = [
        (GgmlType::Q3_K, 4101, 2560, &[1, 2, 5, 8]),
        (GgmlType::Q4_K, 1029, 6144, &[1]),
        (GgmlType::Q5_K, 2563, 6144, &[1]),
        (GgmlType::BF16, 4099, 10240, &[1, 3]),
    ];
    for (ty, rows, k, nts) in cases {
        let wb = weight_blocks(ty, rows * k / ty.block_size(), rng.u64());
        let dw = DevWeight::upload(g, ty, &wb, rows, k, 1).unwrap();
        for &nt in nts {
            assert!(
                m::direct_opt(&dw, nt),
                "{ty} {rows}×{k} nt={nt} takes the direct GEMV"
            );
            let x = tame(rng.f32_vec_special(nt * k, 1.0));
            let xq = up(g, &act_bytes(ty, &x, nt, k));
            let mut want = g.zeros::<f32>(nt * rows).unwrap();
            m::matmul(g, &dw, &xq, nt, &mut want).unwrap();
            let mut got = g.zeros::<f32>(nt * rows).unwrap();
            m::product(g, &dw, &xq, nt, &mut got).unwrap();
            let want = down(g, &want);
            nontrivial(&format!("{ty} {rows}×{k}"), &want);
            bitwise(
                &format!("direct GEMV {ty} {rows}×{k} nt={nt}"),
                &down(g, &got),
                &want,
            );
        }
    }
}

/// The many-row products at one activation row (gemv.cu `gemv_rows4_*`: each warp's rows by one
/// bulk copy; the LM head's Q6_K, the GDN qkv and gate's Q3_K, Q4_K and IQ4_XS) equal the tiled
/// kernel and the row-parallel GEMV (`STRATA_CUDA_ROWS4=0`) bit for bit, over row counts whose
/// last block is partial (for Q6_K and Q3_K, four rows a warp, its last warp a partial group:
/// staged, not bulk-copied).
#[test]
fn many_row_products_equal_the_tiled_kernel() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(48);
    let k = 2560usize;
    for (ty, rows) in [
        (GgmlType::Q6_K, 16_391usize),
        (GgmlType::Q3_K, 4_101),
        (GgmlType::Q4_K, 4_099),
        (GgmlType::IQ4_XS, 4_103),
    ] {
        let wb = weight_blocks(ty, rows * k / ty.block_size(), rng.u64());
        let dw = DevWeight::upload(g, ty, &wb, rows, k, 1).unwrap();
        assert!(m::rows4_applies(&dw, 1), "{ty} {rows}×{k} takes gemv_rows4");
        let x = tame(rng.f32_vec_special(k, 1.0));
        let xq = up(g, &act_bytes(ty, &x, 1, k));
        let mut want = g.zeros::<f32>(rows).unwrap();
        m::matmul(g, &dw, &xq, 1, &mut want).unwrap();
        let want = down(g, &want);
        nontrivial(&format!("{ty} {rows}×{k}"), &want);
        for rows4 in [true, false] {
            strata_cuda::device::set_switch("STRATA_CUDA_ROWS4", Some(rows4)).unwrap();
            let mut got = g.zeros::<f32>(rows).unwrap();
            m::product(g, &dw, &xq, 1, &mut got).unwrap();
            bitwise(
                &format!("{ty} {rows}×{k}, gemv_rows4 {rows4}"),
                &down(g, &got),
                &want,
            );
        }
        strata_cuda::device::set_switch("STRATA_CUDA_ROWS4", None).unwrap();
    }
}

/// The fused mix (three launches, with and without the previous block's combine, with and
/// without inject weights) equals the composed mix and combine bit for bit at 1..=8 rows.
#[test]
fn fused_hc_mix_equals_the_composed_mix() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(32);
    // Flash-Next's mix (4 streams of 2560, rank 320: hc_up_q4_bf16's ten units), and a small
    // one (2 streams of 112: the last block's columns past h; rank 64: two units).
    for (s, h, rank) in [(4usize, 2560usize, 320usize), (2, 112, 64)] {
        fused_hc_mix_case(g, &mut rng, s, h, rank);
    }
}

fn fused_hc_mix_case(g: &Gpu, rng: &mut Rng, s: usize, h: usize, rank: usize) {
    assert!(
        m::hc_up_q4_applies(s, rank, 1)
            || std::env::var("STRATA_CUDA_HC_UP4").as_deref() == Ok("0")
    );
    let sh = s * h;
    let norm: Vec<f32> = (0..sh).map(|_| 1.0 + 0.02 * rng.normal()).collect();
    let bf = |v: &[f32], rows: usize, k: usize| {
        DevWeight::upload(g, GgmlType::BF16, &bf16_bytes(v), rows, k, 1).unwrap()
    };
    let down_w = bf(&rng.f32_vec(rank * sh, 0.02), rank, sh);
    let up_w = bf(&rng.f32_vec(sh * rank, 0.02), sh, rank);
    let inj_w = bf(&rng.f32_vec(s * sh, 0.02), s, sh);
    let norm_d = up(g, &norm);
    for inject in [true, false] {
        let hc = m::HcDev {
            norm: &norm_d,
            down: &down_w,
            up: &up_w,
            inject: inject.then_some(&inj_w),
            streams: s,
            h,
            eps: 1e-6,
            fast: false,
        };
        let mut scratch = m::HcScratch::new(g, &hc, 8).unwrap();
        for rows in 1..=8usize {
            assert!(m::hc_fused_applies(&hc, rows));
            let x = rng.f32_vec_special(rows * sh, 1.0);
            let y = rng.f32_vec(rows * h, 1.0);
            let cw: Vec<f32> = (0..rows * s).map(|_| 2.0 * rng.unit()).collect();
            let (dy, dcw) = (up(g, &y), up(g, &cw));
            for combine in [false, true] {
                let what = format!("fused hc_mix, {rows} rows, inject {inject}, combine {combine}");
                // Composed: combine (when asked), then the eight-launch mix.
                let mut xc = up(g, &x);
                if combine {
                    m::hc_combine(g, &mut xc, &dy, &dcw, rows, h, s).unwrap();
                }
                let mut u0 = g.zeros::<f32>(rows * h).unwrap();
                let mut i0 = g.zeros::<f32>(rows * s).unwrap();
                m::hc_mix(
                    g,
                    &hc,
                    &xc,
                    rows,
                    &mut scratch,
                    &mut u0,
                    inject.then_some(&mut i0),
                )
                .unwrap();
                // Fused: three launches.
                {
                    let mut xf = up(g, &x);
                    let mut u1 = g.zeros::<f32>(rows * h).unwrap();
                    let mut i1 = g.zeros::<f32>(rows * s).unwrap();
                    let input = if combine {
                        m::MixInput::Combine {
                            x: &mut xf,
                            y: &dy,
                            inj: &dcw,
                        }
                    } else {
                        m::MixInput::Plain(&xf)
                    };
                    m::hc_mix_fused(
                        g,
                        &hc,
                        input,
                        rows,
                        &mut scratch,
                        &mut u1,
                        inject.then_some(&mut i1),
                    )
                    .unwrap();
                    bitwise(&format!("{what}: u"), &down(g, &u1), &down(g, &u0));
                    if inject {
                        bitwise(&format!("{what}: inj"), &down(g, &i1), &down(g, &i0));
                    }
                    bitwise(&format!("{what}: x"), &down(g, &xf), &down(g, &xc));
                }
            }
        }
    }
}

/// The fused routed experts of a decode step (gate/up/swiglu/Q8_0 image, then down and the
/// weighted sum) equal the composed per-pair launches bit for bit; a bad expert id is reported.
#[test]
fn fused_experts_equal_the_composed_experts() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(33);
    let (h, ff, ne, ks) = (2560usize, 640usize, 16usize, 10usize);
    for (gty, dty, xs) in [
        (GgmlType::Q2_0, GgmlType::Q2_0, 1.0f32),
        (GgmlType::Q4_K, GgmlType::Q8_0, 0.01),
    ] {
        let gb = weight_blocks(gty, ne * ff * h / gty.block_size(), rng.u64());
        let ub = weight_blocks(gty, ne * ff * h / gty.block_size(), rng.u64());
        let db = weight_blocks(dty, ne * h * ff / dty.block_size(), rng.u64());
        let ex = m::ExpertsDev {
            gate: &DevWeight::upload(g, gty, &gb, ff, h, ne).unwrap(),
            up: &DevWeight::upload(g, gty, &ub, ff, h, ne).unwrap(),
            down: &DevWeight::upload(g, dty, &db, h, ff, ne).unwrap(),
        };
        assert!(m::experts_fuse(&ex, ks));
        // The release's Q2_0 experts run the staged kernels (gemv.cu moe_gate_up_q2s,
        // moe_down_q2s) unless switched off; both forms are bound to the composed experts.
        // The shared expert (Q8_0 down of 640, as the release's): gate and up products in,
        // swiglu_prepare's image and the product out, as the MoE block composes them.
        let ffs = 640usize;
        let sdb = weight_blocks(GgmlType::Q8_0, h * ffs / 32, rng.u64());
        let sdown = DevWeight::upload(g, GgmlType::Q8_0, &sdb, h, ffs, 1).unwrap();
        let staged = m::experts_staged_for(&ex, ks, true).unwrap();
        let q2 = gty == GgmlType::Q2_0;
        assert_eq!(
            staged,
            m::Staged {
                gate_up: q2,
                down: q2
            },
            "{gty}/{dty}"
        );
        for stage in [false, true] {
            m::set_experts_stage(Some(stage));
            for nt in [1usize, 2, 5, 8] {
                let x: Vec<f32> = tame(rng.f32_vec_special(nt * h, 1.0))
                    .iter()
                    .map(|v| v * xs)
                    .collect();
                let mut ids = Vec::new();
                let mut wts = Vec::new();
                for _ in 0..nt {
                    ids.extend(rng.distinct(ks, ne));
                    let raw: Vec<f32> = (0..ks).map(|_| 0.1 + rng.unit()).collect();
                    let z: f32 = raw.iter().sum();
                    wts.extend(raw.iter().map(|r| r / z));
                }
                let (dx, di, dwt) = (up(g, &x), up(g, &ids), up(g, &wts));
                let mut err = g.zeros::<u32>(1).unwrap();
                let mut scratch = m::MoeScratch::new(g, &ex, nt, ks).unwrap();
                let mut o0 = g.zeros::<f32>(nt * h).unwrap();
                let mut o1 = g.zeros::<f32>(nt * h).unwrap();
                m::moe_experts(
                    g,
                    &ex,
                    &dx,
                    &di,
                    &dwt,
                    &mut scratch,
                    false,
                    &mut o0,
                    &mut err,
                )
                .unwrap();
                m::moe_experts_fused(
                    g,
                    &ex,
                    &dx,
                    &di,
                    &dwt,
                    &mut scratch,
                    None,
                    &mut o1,
                    &mut err,
                )
                .unwrap();
                assert_eq!(g.download(&err).unwrap(), vec![0], "error word");
                let what = format!("fused experts {gty}/{dty} nt={nt} staged={stage}");
                bitwise(&what, &down(g, &o1), &down(g, &o0));
                // With the shared expert's add (its output and gate), before and after the
                // dependency wait: the composed experts, then add_sigmoid_gated.
                let sy = up(g, &tame(rng.f32_vec_special(nt * h, 1.0)));
                let sg = up(g, &tame(rng.f32_vec_special(nt, 1.0)));
                let mut o2 = up(g, &down(g, &o0));
                m::add_sigmoid_gated(g, &mut o2, &sy, &sg, nt, h).unwrap();
                for settled in [false, true] {
                    let mut o3 = g.zeros::<f32>(nt * h).unwrap();
                    let add = m::SharedAdd {
                        y: m::SharedY::Out(&sy),
                        gate: &sg,
                        settled,
                    };
                    m::moe_experts_fused(
                        g,
                        &ex,
                        &dx,
                        &di,
                        &dwt,
                        &mut scratch,
                        Some(add),
                        &mut o3,
                        &mut err,
                    )
                    .unwrap();
                    assert_eq!(g.download(&err).unwrap(), vec![0], "error word");
                    bitwise(
                        &format!("{what} with the shared expert, settled={settled}"),
                        &down(g, &o3),
                        &down(g, &o2),
                    );
                }
                // The shared expert from its parts inside the staged down.
                let sgv = up(g, &tame(rng.f32_vec_special(nt * ffs, 1.0)));
                let suv = up(g, &tame(rng.f32_vec_special(nt * ffs, 1.0)));
                let mut hq = g.zeros::<u8>(nt * 34 * ffs / 32).unwrap();
                m::swiglu_prepare(g, &sgv, &suv, nt, ffs, ActFmt::Q8_0, &mut hq).unwrap();
                let mut ysh = g.zeros::<f32>(nt * h).unwrap();
                m::product(g, &sdown, &hq, nt, &mut ysh).unwrap();
                let mut o4 = up(g, &down(g, &o0));
                m::add_sigmoid_gated(g, &mut o4, &ysh, &sg, nt, h).unwrap();
                for settled in [false, true] {
                    let mut o5 = g.zeros::<f32>(nt * h).unwrap();
                    let add = m::SharedAdd {
                        y: m::SharedY::Parts {
                            g: &sgv,
                            u: &suv,
                            down: &sdown,
                        },
                        gate: &sg,
                        settled,
                    };
                    let r = m::moe_experts_fused(
                        g,
                        &ex,
                        &dx,
                        &di,
                        &dwt,
                        &mut scratch,
                        Some(add),
                        &mut o5,
                        &mut err,
                    );
                    if !(stage && staged.down) {
                        assert!(r.is_err(), "{what}: the parts need the staged down");
                        continue;
                    }
                    r.unwrap();
                    assert_eq!(g.download(&err).unwrap(), vec![0], "error word");
                    bitwise(
                        &format!("{what} with the shared expert's parts, settled={settled}"),
                        &down(g, &o5),
                        &down(g, &o4),
                    );
                }
            }
            // An expert id past the stack: the error word says so.
            let mut bad_ids = vec![0i32; ks];
            bad_ids[3] = ne as i32;
            let mut err = g.zeros::<u32>(1).unwrap();
            let mut scratch = m::MoeScratch::new(g, &ex, 1, ks).unwrap();
            let mut o = g.zeros::<f32>(h).unwrap();
            let wts = vec![1.0 / ks as f32; ks];
            m::moe_experts_fused(
                g,
                &ex,
                &up(g, &vec![0.5f32; h]),
                &up(g, &bad_ids),
                &up(g, &wts),
                &mut scratch,
                None,
                &mut o,
                &mut err,
            )
            .unwrap();
            assert_eq!(
                g.download(&err).unwrap()[0] & 2,
                2,
                "a bad expert id sets the error word (staged={stage})"
            );
            assert!(
                down(g, &o).iter().all(|v| v.is_nan()),
                "a bad expert id makes its row NaN (staged={stage})"
            );
        }
        m::set_experts_stage(None);
    }
}

#[test]
fn moe_experts_match_gemv_and_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(15);
    let (h, ff, ne, ks) = (2560usize, 640usize, 16usize, 4usize);
    // The synthetic Q4_K blocks have large scales: at unit inputs silu(g)·u reaches 1e8 and the
    // down product's Q8_0 activation scale (F16) overflows on both sides, so that case runs at
    // inputs of 0.01.
    for (gty, dty, xs) in [
        (GgmlType::Q2_0, GgmlType::Q2_0, 1.0f32),
        (GgmlType::Q4_K, GgmlType::Q8_0, 0.01),
    ] {
        let gb = weight_blocks(gty, ne * ff * h / gty.block_size(), rng.u64());
        let ub = weight_blocks(gty, ne * ff * h / gty.block_size(), rng.u64());
        let db = weight_blocks(dty, ne * h * ff / dty.block_size(), rng.u64());
        let w = weights(vec![
            (
                "gate",
                vec![h as u64, ff as u64, ne as u64],
                gty,
                gb.clone(),
            ),
            ("up", vec![h as u64, ff as u64, ne as u64], gty, ub.clone()),
            (
                "down",
                vec![ff as u64, h as u64, ne as u64],
                dty,
                db.clone(),
            ),
        ]);
        let ex = m::ExpertsDev {
            gate: &DevWeight::upload(g, gty, &gb, ff, h, ne).unwrap(),
            up: &DevWeight::upload(g, gty, &ub, ff, h, ne).unwrap(),
            down: &DevWeight::upload(g, dty, &db, h, ff, ne).unwrap(),
        };
        for nt in [1usize, 3, 11] {
            let x: Vec<f32> = tame(rng.f32_vec_special(nt * h, 1.0))
                .iter()
                .map(|v| v * xs)
                .collect();
            // Routes: distinct experts per row (some shared between rows), weights summing to 1.
            let mut ids = Vec::new();
            let mut wts = Vec::new();
            for _ in 0..nt {
                let e = rng.distinct(ks, ne);
                let raw: Vec<f32> = (0..ks).map(|_| 0.1 + rng.unit()).collect();
                let z: f32 = raw.iter().sum();
                ids.extend(e.iter().copied());
                wts.extend(raw.iter().map(|r| r / z));
            }
            let routes = CpuRoutes(
                (0..nt)
                    .map(|t| {
                        (0..ks)
                            .map(|s| (ids[t * ks + s] as u32, wts[t * ks + s]))
                            .collect()
                    })
                    .collect(),
            );
            let want = be
                .moe_experts(
                    &ExpertWeights {
                        gate: &w["gate"],
                        up: &w["up"],
                        down: &w["down"],
                    },
                    &buf(nt, h, &x),
                    &routes,
                )
                .unwrap();
            let (dx, di, dwt) = (up(g, &x), up(g, &ids), up(g, &wts));
            let mut err = g.zeros::<u32>(1).unwrap();
            let mut scratch = m::MoeScratch::new(g, &ex, nt, ks).unwrap();
            let mut o1 = g.zeros::<f32>(nt * h).unwrap();
            let mut o2 = g.zeros::<f32>(nt * h).unwrap();
            m::moe_experts(
                g,
                &ex,
                &dx,
                &di,
                &dwt,
                &mut scratch,
                false,
                &mut o1,
                &mut err,
            )
            .unwrap();
            m::moe_experts(
                g,
                &ex,
                &dx,
                &di,
                &dwt,
                &mut scratch,
                true,
                &mut o2,
                &mut err,
            )
            .unwrap();
            let (r1, r2) = (down(g, &o1), down(g, &o2));
            assert_eq!(g.download(&err).unwrap(), vec![0], "error word");
            bitwise(
                &format!("moe {gty}/{dty} nt={nt}: grouped vs decode"),
                &r2,
                &r1,
            );
            // The routed gate product against the GEMV on each expert's slab: bitwise.
            let xq = act_bytes(gty, &x, nt, h);
            let mut yg = g.zeros::<f32>(nt * ks * ff).unwrap();
            m::moe_gemv(
                g,
                ex.gate,
                &di,
                &up(g, &xq),
                false,
                ks,
                nt * ks,
                &mut yg,
                &mut err,
            )
            .unwrap();
            let yg = down(g, &yg);
            let slab = ex.gate.slab_bytes().unwrap();
            let xr = xq.len() / nt;
            for t in 0..nt {
                for s in 0..ks {
                    let e = ids[t * ks + s] as usize;
                    let mut yy = g.zeros::<f32>(ff).unwrap();
                    let dws = up(g, &gb[e * slab..(e + 1) * slab]);
                    ops::gemv(
                        g,
                        "optimized",
                        gty,
                        &dws,
                        ff,
                        h,
                        &up(g, &xq[t * xr..(t + 1) * xr]),
                        1,
                        &mut yy,
                    )
                    .unwrap();
                    let q = t * ks + s;
                    bitwise(
                        &format!("moe_gemv {gty} pair {q} vs gemv"),
                        &yg[q * ff..(q + 1) * ff],
                        &down(g, &yy),
                    );
                }
            }
            // Against the CPU: other dot orders, and a Q8_0/Q8_K rounding of an activation on a
            // rounding edge may go the other way: 2e-3 of the row's largest |y|.
            within(
                &format!("moe {gty}/{dty} nt={nt} vs CPU"),
                &r1,
                want.as_slice(),
                row_rel(want.as_slice(), h, 2e-3),
            );
        }
    }
    // A bad expert id: the error word, NaN outputs, no fault.
    let ex_ty = GgmlType::Q8_0;
    let wb = weight_blocks(ex_ty, 2 * 64 * 256 / 32, 5);
    let dw = DevWeight::upload(g, ex_ty, &wb, 64, 256, 2).unwrap();
    let xq = act_bytes(ex_ty, &rng.f32_vec(256, 1.0), 1, 256);
    let mut err = g.zeros::<u32>(1).unwrap();
    let mut y = g.zeros::<f32>(2 * 64).unwrap();
    m::moe_gemv(
        g,
        &dw,
        &up(g, &[1i32, 7]),
        &up(g, &xq),
        false,
        2,
        2,
        &mut y,
        &mut err,
    )
    .unwrap();
    assert_eq!(g.download(&err).unwrap(), vec![m::ERR_EXPERT]);
    let y = down(g, &y);
    assert!(y[..64].iter().all(|v| v.is_finite()) && y[64..].iter().all(|v| v.is_nan()));
}

// ---- embedding rows, PLE gather ---------------------------------------------------------------

#[test]
fn embed_and_ple_gather_match_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(16);
    // PLE: IQ4_NL rows of 160, ids from a device buffer; the token embedding with 4 copies.
    for (ty, row_len, n_rows, copies) in [
        (GgmlType::IQ4_NL, 160usize, 1000usize, 1usize),
        (GgmlType::Q4_K, 2560, 100, 4),
    ] {
        let tb = weight_blocks(ty, n_rows * row_len / ty.block_size(), rng.u64());
        let w = weights(vec![(
            "t",
            vec![row_len as u64, n_rows as u64],
            ty,
            tb.clone(),
        )]);
        let ids: Vec<u32> = (0..24).map(|_| rng.below(n_rows) as u32).collect();
        let want = be
            .embed_rows(&w["t"], &CpuIds(ids.clone()), copies)
            .unwrap();
        let mut e = g.zeros::<f32>(ids.len() * row_len).unwrap();
        ops::embed(
            g,
            "optimized",
            ty,
            &up(g, &tb),
            n_rows,
            &up(g, &ids),
            ids.len(),
            &mut e,
            row_len,
        )
        .unwrap();
        let got = if copies > 1 {
            let mut r = g.zeros::<f32>(ids.len() * row_len * copies).unwrap();
            m::repeat_rows(g, &e, &mut r, ids.len(), row_len, copies).unwrap();
            down(g, &r)
        } else {
            down(g, &e)
        };
        bitwise(&format!("embed {ty} ×{copies}"), &got, want.as_slice());
    }
}

// ---- Gated DeltaNet ------------------------------------------------------------------------------

#[test]
fn conv_and_gdn_match_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(17);
    // conv: the GDN conv (K 4, dilation 1) and the PLE conv (K 4, dilation 3).
    for (c, kk, dil) in [(1280usize, 4usize, 1usize), (640, 4, 3)] {
        let wv = rng.f32_vec(c * kk, 0.5);
        let w = weights(vec![(
            "w",
            vec![kk as u64, c as u64],
            GgmlType::F32,
            f32_bytes(&wv),
        )]);
        let hr = (kk - 1) * dil;
        let mut hist = buf(hr, c, &vec![0f32; hr * c]);
        let mut dh = g.zeros::<f32>(hr * c).unwrap();
        let dw = up(g, &wv);
        for n in [1usize, 2, 8, 11, 40] {
            let x = rng.f32_vec_special(n * c, 1.0);
            let want = be
                .conv1d_silu(&buf(n, c, &x), &w["w"], &mut hist, dil)
                .unwrap();
            let mut out = g.zeros::<f32>(n * c).unwrap();
            m::conv1d_silu(g, &up(g, &x), &dw, &mut dh, &mut out, n, c, kk, dil).unwrap();
            within(
                &format!("conv c={c} dil={dil} n={n}"),
                &down(g, &out),
                want.as_slice(),
                rel(want.as_slice(), 4e-6, 1e-37),
            );
            bitwise(
                &format!("conv history c={c} dil={dil} after n={n}"),
                &down(g, &dh),
                hist.as_slice(),
            );
        }
    }
    // GDN: 2 key heads, 4 value heads of 128; rows 1, 3, 8, 11 in sequence, state carried.
    let dims = GdnDims {
        n_k_heads: 2,
        n_v_heads: 4,
        head_k: 128,
        head_v: 128,
        conv_kernel: 4,
    };
    let nv = dims.n_v_heads;
    let ssm_a: Vec<f32> = (0..nv).map(|_| -(0.5 + rng.unit())).collect();
    let dt: Vec<f32> = rng.f32_vec(nv, 1.0);
    let norm: Vec<f32> = (0..dims.head_v)
        .map(|_| 1.0 + 0.02 * rng.normal())
        .collect();
    let w = weights(vec![
        ("a", vec![nv as u64], GgmlType::F32, f32_bytes(&ssm_a)),
        ("dt", vec![nv as u64], GgmlType::F32, f32_bytes(&dt)),
        (
            "norm",
            vec![dims.head_v as u64],
            GgmlType::F32,
            f32_bytes(&norm),
        ),
    ]);
    let params = GdnParams {
        a: &w["a"],
        dt_bias: &w["dt"],
        norm: &w["norm"],
        dims,
        eps: 1e-6,
    };
    let dev = m::GdnDev {
        ssm_a: &up(g, &ssm_a),
        dt_bias: &up(g, &dt),
        norm: &up(g, &norm),
        dims,
        eps: 1e-6,
    };
    let ss = nv * dims.head_k * dims.head_v;
    let mut state = buf(nv, dims.head_k * dims.head_v, &vec![0f32; ss]);
    let mut ds = g.zeros::<f32>(ss).unwrap();
    let mut dscan = g.zeros::<f32>(ss).unwrap();
    let mut gsc = m::GdnScratch::new(g, dims, 11).unwrap();
    for n in [1usize, 3, 8, 11] {
        let qkv = rng.f32_vec_special(n * dims.conv_dim(), 1.0);
        let z = rng.f32_vec_special(n * dims.value_dim(), 1.0);
        let al = rng.f32_vec(n * nv, 1.0);
        let bt = rng.f32_vec(n * nv, 1.0);
        let (dq, dz, da, db) = (up(g, &qkv), up(g, &z), up(g, &al), up(g, &bt));
        // The exact mode: n rows in one launch equal n single-row launches, bitwise.
        let mut ds1 = g.zeros::<f32>(ss).unwrap();
        g.copy(&ds, &mut ds1).unwrap();
        let mut singles = Vec::new();
        let vd = dims.value_dim();
        for t in 0..n {
            let mut o = g.zeros::<f32>(vd).unwrap();
            let sl = |v: &[f32], c: usize| up(g, &v[t * c..(t + 1) * c]);
            m::gdn_step(
                g,
                &dev,
                &sl(&qkv, dims.conv_dim()),
                &sl(&z, vd),
                &sl(&al, nv),
                &sl(&bt, nv),
                &mut ds1,
                &mut o,
                1,
            )
            .unwrap();
            singles.extend(down(g, &o));
        }
        let want = be
            .gdn_step(
                &params,
                &buf(n, dims.conv_dim(), &qkv),
                &buf(n, vd, &z),
                &buf(n, nv, &al),
                &buf(n, nv, &bt),
                &mut state,
            )
            .unwrap();
        let mut out = g.zeros::<f32>(n * vd).unwrap();
        m::gdn_step(g, &dev, &dq, &dz, &da, &db, &mut ds, &mut out, n).unwrap();
        let got = down(g, &out);
        bitwise(&format!("gdn {n} rows vs {n} single steps"), &got, &singles);
        bitwise(
            &format!("gdn state after {n} rows vs single steps"),
            &down(g, &ds),
            &down(g, &ds1),
        );
        // The column-spread form (prep, scan, norm) on the same rows: bitwise too.
        let mut o3 = g.zeros::<f32>(n * vd).unwrap();
        m::gdn_step_scan(
            g, &dev, &dq, &dz, &da, &db, &mut dscan, &mut o3, n, &mut gsc,
        )
        .unwrap();
        bitwise(&format!("gdn scan {n} rows vs fused"), &down(g, &o3), &got);
        bitwise(
            &format!("gdn scan state after {n} rows vs fused"),
            &down(g, &dscan),
            &down(g, &ds),
        );
        // Against the CPU: the device's expf in β, the decay and σ(z), compounding through the
        // state: 2e-4 of the row's (the state's) largest magnitude.
        within(
            &format!("gdn out, {n} rows"),
            &got,
            want.as_slice(),
            row_rel(want.as_slice(), dims.head_v, 2e-4),
        );
        within(
            &format!("gdn state after {n} rows"),
            &down(g, &ds),
            state.as_slice(),
            row_rel(state.as_slice(), ss, 2e-4),
        );
    }
}

// ---- attention --------------------------------------------------------------------------------------

#[test]
fn kv_append_and_qsa_pool_match_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(18);
    let (cap, cols) = (64usize, 512usize);
    for kv in [KvType::F32, KvType::F16] {
        let mut cache = buf(0, cols, &[]);
        let mut store = g.zeros::<f32>(cap * cols).unwrap();
        let mut err = g.zeros::<u32>(1).unwrap();
        let mut at = 0usize;
        for n in [5usize, 1, 8] {
            let x = rng.f32_vec_special(n * cols, 100.0);
            append_kv(&be, &mut cache, &buf(n, cols, &x), kv);
            let pos: Vec<u32> = (at..at + n).map(|p| p as u32).collect();
            m::kv_append(
                g,
                &mut store,
                cap,
                &up(g, &x),
                &up(g, &pos),
                n,
                cols,
                kv == KvType::F16,
                &mut err,
            )
            .unwrap();
            at += n;
        }
        bitwise(
            &format!("kv_append {kv:?}"),
            &down(g, &store)[..at * cols],
            cache.as_slice(),
        );
        assert_eq!(g.download(&err).unwrap(), vec![0]);
        // A position past the capacity: flagged, nothing written.
        let before = down(g, &store);
        m::kv_append(
            g,
            &mut store,
            cap,
            &up(g, &vec![1f32; cols]),
            &up(g, &[cap as u32]),
            1,
            cols,
            false,
            &mut err,
        )
        .unwrap();
        assert_eq!(g.download(&err).unwrap(), vec![m::ERR_CAPACITY]);
        bitwise(
            "store untouched by the refused row",
            &down(g, &store),
            &before,
        );
    }
    // Pooling: raw keys of 128, blocks of 4; rows 0..13 (blocks 0..2), then 13..17 (block 3).
    let (d, ratio, rot, theta) = (128usize, 4usize, 64usize, 1e7f32);
    let cap_b = cap / ratio;
    let kn: Vec<f32> = (0..d).map(|_| 1.0 + 0.02 * rng.normal()).collect();
    let w = weights(vec![("kn", vec![d as u64], GgmlType::F32, f32_bytes(&kn))]);
    let mut kraw = buf(0, d, &[]);
    let mut kstore = g.zeros::<f32>(cap * d).unwrap();
    let mut bstore = g.zeros::<f32>(cap_b * d).unwrap();
    let mut err = g.zeros::<u32>(1).unwrap();
    let freqs = up(g, &m::rope_freqs(rot, theta));
    let dkn = up(g, &kn);
    let mut want_blocks: Vec<f32> = Vec::new();
    let mut at = 0usize;
    for n in [13usize, 4] {
        let x = rng.f32_vec_special(n * d, 1.0);
        append_kv(&be, &mut kraw, &buf(n, d, &x), KvType::F32);
        let pos: Vec<u32> = (at..at + n).map(|p| p as u32).collect();
        // The CPU pools per row; the rows whose position completes a block carry one.
        let pooled = be.qsa_pool_blocks(&kraw, &ids(&pos), ratio).unwrap();
        let done: Vec<usize> = (0..n)
            .filter(|&r| (at + r + 1).is_multiple_of(ratio))
            .collect();
        let rows: Vec<f32> = done
            .iter()
            .flat_map(|&r| pooled.as_slice()[r * d..(r + 1) * d].to_vec())
            .collect();
        let mut kb = be
            .rms_norm(&buf(done.len(), d, &rows), &w["kn"], d, 1e-6)
            .unwrap();
        let first: Vec<u32> = done.iter().map(|&r| (at + r + 1 - ratio) as u32).collect();
        be.rope_neox(&mut kb, d, rot, theta, &ids(&first)).unwrap();
        want_blocks.extend_from_slice(kb.as_slice());
        let dpos = up(g, &pos);
        m::kv_append(
            g,
            &mut kstore,
            cap,
            &up(g, &x),
            &dpos,
            n,
            d,
            false,
            &mut err,
        )
        .unwrap();
        m::qsa_pool(
            g,
            &kstore,
            &mut bstore,
            cap_b,
            &dpos,
            n,
            d,
            ratio,
            &dkn,
            1e-6,
            &freqs,
            rot,
            &mut err,
        )
        .unwrap();
        at += n;
    }
    let got = down(g, &bstore);
    let nb = want_blocks.len();
    // The norm's block sum and rope's cos/sin: 1e-5 of the block row's largest value.
    within(
        "qsa_pool",
        &got[..nb],
        &want_blocks,
        row_rel(&want_blocks, d, 1e-5),
    );
    assert_eq!(g.download(&err).unwrap(), vec![0]);
}

/// A QSA layer's row preparation in one launch (`qsa_prep`, the backend's `qsa_prepare`)
/// against the composition of the same backend's operations (`qsa_prepare_composed`): queries,
/// gates, indexer queries and every cache bitwise, over a prompt and decode steps and windows
/// that complete blocks inside the step and across steps (both geometries: the release's with
/// partial RoPE and an indexer, and a full-RoPE layer without one); then the gated attention
/// (`attend_gated`) against `attend` followed by `mul_sigmoid`, bitwise, over the selection.
#[test]
fn qsa_prepare_equals_the_composition() {
    let Some(_) = gpu() else { return };
    let cb = strata_cuda::CudaBackend::new(0).expect("CUDA backend");
    let mut rng = Rng::new(31);
    // (query heads, kv heads, head dim, indexer heads, indexer dim, rot, ratio)
    for (hq, hkv, hd, hi, di, rot, ratio) in [
        (6usize, 2usize, 256usize, 4usize, 128usize, 64usize, 4usize),
        (4, 2, 64, 0, 0, 64, 0),
    ] {
        let (h6, i6) = (hd as u64, di as u64);
        let mut specs = vec![
            (
                "qn",
                vec![h6],
                GgmlType::F32,
                f32_bytes(&rng.f32_vec(hd, 1.0)),
            ),
            (
                "kn",
                vec![h6],
                GgmlType::F32,
                f32_bytes(&rng.f32_vec(hd, 1.0)),
            ),
        ];
        if hi > 0 {
            specs.push((
                "iqn",
                vec![i6],
                GgmlType::F32,
                f32_bytes(&rng.f32_vec(di, 1.0)),
            ));
            specs.push((
                "ikn",
                vec![i6],
                GgmlType::F32,
                f32_bytes(&rng.f32_vec(di, 1.0)),
            ));
        }
        let file = gguf_of(&specs);
        let l = |n: &str| cb.load_weight(&file, file.tensor(n).unwrap()).unwrap();
        let (qn, kn) = (l("qn"), l("kn"));
        let ix = (hi > 0).then(|| (l("iqn"), l("ikn")));
        let w = QsaPrepW {
            q_norm: &qn,
            k_norm: &kn,
            index: ix.as_ref().map(|(q, k)| QsaIndexW {
                q_norm: q,
                k_norm: k,
                head_dim: di,
                ratio,
            }),
            head_dim: hd,
            rot,
            theta: 10_000.0,
            eps: 1e-6,
        };
        let cap = 40usize;
        let kvc = hkv * hd;
        let stores = |cb: &strata_cuda::CudaBackend| {
            let s = |c: usize| cb.store(cap, c).unwrap();
            (s(kvc), s(kvc), s(di.max(1)), s(di.max(1)))
        };
        let (mut a, mut b) = (stores(&cb), stores(&cb));
        type Stores = (CudaBuf, CudaBuf, CudaBuf, CudaBuf);
        fn caches(t: &mut Stores, index: bool) -> QsaCaches<'_, CudaBuf> {
            QsaCaches {
                k: &mut t.0,
                v: &mut t.1,
                index: index.then_some((&mut t.2, &mut t.3)),
            }
        }
        let mut at = 0usize;
        // A prompt of 6 (a block completed inside it), steps, windows across block edges.
        for n in [6usize, 1, 1, 3, 8, 1, 5] {
            let rows = |cb: &strata_cuda::CudaBackend, rng: &mut Rng| {
                let mut r = |c: usize| cb.upload(n, c, &rng.f32_vec_special(n * c, 4.0)).unwrap();
                let (qg, k, v) = (r(2 * hq * hd), r(kvc), r(kvc));
                let index = (hi > 0).then(|| (r(hi * di), r(di)));
                QsaRows { qg, k, v, index }
            };
            let xa = rows(&cb, &mut rng);
            // The same rows again for the composition (same seed: the same values).
            let xb = QsaRows {
                qg: cb.copy(&xa.qg).unwrap(),
                k: cb.copy(&xa.k).unwrap(),
                v: cb.copy(&xa.v).unwrap(),
                index: xa
                    .index
                    .as_ref()
                    .map(|(q, k)| (cb.copy(q).unwrap(), cb.copy(k).unwrap())),
            };
            let tokens: Vec<u32> = (0..n as u32).collect();
            let ratios: Vec<usize> = if hi > 0 { vec![ratio] } else { vec![] };
            let inputs = StepInputs::new(&cb, &tokens, at, &ratios).unwrap();
            let pa = cb
                .qsa_prepare(&w, xa, &inputs, caches(&mut a, hi > 0))
                .unwrap();
            let pb = qsa_prepare_composed(&cb, &w, xb, &inputs, caches(&mut b, hi > 0)).unwrap();
            let what = |p: &str| format!("qsa_prepare {hd}/{di} step of {n} at {at}: {p}");
            let d = |x: &CudaBuf| cb.download(x).unwrap();
            nontrivial(&what("q"), &d(&pb.q));
            bitwise(&what("q"), &d(&pa.q), &d(&pb.q));
            bitwise(&what("gate"), &d(&pa.gate), &d(&pb.gate));
            bitwise(&what("k cache"), &d(&a.0), &d(&b.0));
            bitwise(&what("v cache"), &d(&a.1), &d(&b.1));
            if hi > 0 {
                bitwise(
                    &what("indexer q"),
                    &d(pa.qi.as_ref().unwrap()),
                    &d(pb.qi.as_ref().unwrap()),
                );
                bitwise(&what("raw key cache"), &d(&a.2), &d(&b.2));
                nontrivial(&what("block cache"), &d(&b.3));
                bitwise(&what("block cache"), &d(&a.3), &d(&b.3));
            }
            // The output gate inside attention against attend → mul_sigmoid.
            let dims = AttnDims {
                n_head: hq,
                n_head_kv: hkv,
                head_dim: hd,
            };
            let sel = match &pa.qi {
                Some(qi) => cb
                    .qsa_select(
                        qi,
                        &a.3,
                        &inputs.positions,
                        QsaSelect {
                            ratio,
                            budget: 8,
                            rule: QsaRule::Reference,
                        },
                    )
                    .unwrap(),
                None => cb.select_causal(&inputs.positions).unwrap(),
            };
            let gated = cb
                .attend_gated(&pa.q, &pa.gate, &a.0, &a.1, &sel, dims, KvType::F32)
                .unwrap();
            let plain = cb
                .attend(&pa.q, &a.0, &a.1, &sel, dims, KvType::F32)
                .unwrap();
            let composed = cb.mul_sigmoid(&plain, &pa.gate).unwrap();
            nontrivial(&what("gated attention"), &d(&composed));
            bitwise(&what("gated attention"), &d(&gated), &d(&composed));
            at += n;
        }
    }
}

#[test]
fn qsa_selection_equals_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(19);
    // A short cache, and a long one (10,240 blocks: the radix select's buckets crowded by keys
    // sharing their top bytes, the budget of 2,048 tokens a small part of it).
    let cases: [(usize, usize, Vec<u32>); 2] = [
        (32, 512, vec![0, 2, 3, 14, 30, 31, 45, 200, 437, 511]),
        (2048, 40960, vec![4095, 9001, 20000, 40959]),
    ];
    for (budget, cap, pos) in cases {
        let (heads, d, ratio) = (4usize, 128usize, 4usize);
        qsa_selection_case(g, &be, &mut rng, heads, d, ratio, budget, cap, &pos);
    }
}

#[allow(clippy::too_many_arguments)]
fn qsa_selection_case(
    g: &Gpu,
    be: &CpuBackend,
    rng: &mut Rng,
    heads: usize,
    d: usize,
    ratio: usize,
    budget: usize,
    cap: usize,
    pos: &[u32],
) {
    let cap_b = cap / ratio;
    // Block keys with many exact ties (rows copied), a zero block (score 0 for every query).
    let mut blocks = rng.f32_vec_special(cap_b * d, 1.0);
    for b in 0..cap_b {
        if b % 3 == 1 {
            let src = rng.below(b);
            let (a, c) = blocks.split_at_mut(b * d);
            c[..d].copy_from_slice(&a[src * d..(src + 1) * d]);
        }
    }
    blocks[5 * d..6 * d].iter_mut().for_each(|v| *v = 0.0);
    let n = pos.len();
    let qi = rng.f32_vec_special(n * heads * d, 1.0);
    let (dq, db, dp) = (up(g, &qi), up(g, &blocks), up(g, pos));
    for rule in [QsaRule::Reference, QsaRule::LlamaCpp] {
        let s = QsaSelect {
            ratio,
            budget,
            rule,
        };
        // The CPU reads the complete blocks only: hand it the store cut to the largest count.
        let nb_max = (*pos.iter().max().unwrap() as usize + 1) / ratio;
        let want = be
            .qsa_select(
                &buf(n, heads * d, &qi),
                &buf(nb_max, d, &blocks[..nb_max * d]),
                &ids(pos),
                s,
            )
            .unwrap();
        // Both ways of the short-context path (`STRATA_CUDA_QSA_ALL`: no scores where every
        // block is taken) and of the scores' loads (`STRATA_CUDA_ATTN_DIRECT`).
        for (all, direct) in [(true, true), (false, true), (false, false)] {
            strata_cuda::device::set_switch("STRATA_CUDA_QSA_ALL", Some(all)).unwrap();
            strata_cuda::device::set_switch("STRATA_CUDA_ATTN_DIRECT", Some(direct)).unwrap();
            let mut sel = m::Selection::new(g, n, cap, s).unwrap();
            let mut err = g.zeros::<u32>(1).unwrap();
            m::qsa_select(g, &dq, &db, &dp, n, heads, d, s, &mut sel, &mut err).unwrap();
            assert_eq!(g.download(&err).unwrap(), vec![0], "{rule:?}: error word");
            let (cnt, toks) = (g.download(&sel.cnt).unwrap(), g.download(&sel.sel).unwrap());
            for r in 0..n {
                let got = &toks[r * sel.stride..r * sel.stride + cnt[r] as usize];
                assert_eq!(
                    got,
                    want.0[r].as_slice(),
                    "{rule:?} (all {all}, direct {direct}): row {r} at position {} (budget {budget})",
                    pos[r]
                );
            }
        }
        strata_cuda::device::set_switch("STRATA_CUDA_QSA_ALL", None).unwrap();
        strata_cuda::device::set_switch("STRATA_CUDA_ATTN_DIRECT", None).unwrap();
        eprintln!("qsa_select {rule:?}, budget {budget}: {n} rows equal to the CPU's token lists");
    }
}

#[test]
fn attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(20);
    let cap = 300usize;
    // Sparse (QSA geometry) over given token lists, and dense causal (qwen2 geometry).
    for (dims, causal) in [
        (
            AttnDims {
                n_head: 8,
                n_head_kv: 2,
                head_dim: 256,
            },
            false,
        ),
        (
            AttnDims {
                n_head: 14,
                n_head_kv: 2,
                head_dim: 64,
            },
            true,
        ),
    ] {
        let kvc = dims.n_head_kv * dims.head_dim;
        let qc = dims.n_head * dims.head_dim;
        for kv in [KvType::F32, KvType::F16] {
            // F32: specials too. F16: plain values (a large special is ±inf in F16, and the
            // head's output NaN on both sides: nothing to compare).
            let mut gen = |n: usize| {
                if kv == KvType::F16 {
                    rng.f32_vec(n, 1.0)
                } else {
                    rng.f32_vec_special(n, 1.0)
                }
            };
            let mut kc = gen(cap * kvc);
            let mut vc = gen(cap * kvc);
            let q = gen(4 * qc);
            if kv == KvType::F16 && causal {
                // A causal F16 store holds rounded values (kv_append rounds them).
                for v in kc.iter_mut().chain(vc.iter_mut()) {
                    *v = half::f16::from_f32(*v).to_f32();
                }
            }
            let pos: Vec<u32> = vec![0, 37, 150, 299];
            let n = pos.len();
            let lists: Vec<Vec<u32>> = pos
                .iter()
                .map(|&p| (0..=p).filter(|_| rng.below(3) != 0 || p < 4).collect())
                .collect();
            let (kb, vb) = (buf(cap, kvc, &kc), buf(cap, kvc, &vc));
            let want = if causal {
                be.attend_causal(&buf(n, qc, &q), &kb, &vb, &ids(&pos), dims, kv)
                    .unwrap()
            } else {
                be.attend(
                    &buf(n, qc, &q),
                    &kb,
                    &vb,
                    &CpuSelection(lists.clone()),
                    dims,
                    kv,
                )
                .unwrap()
            };
            let mut sel = m::Selection::new(
                g,
                n,
                cap,
                QsaSelect {
                    ratio: 4,
                    budget: cap,
                    rule: QsaRule::Reference,
                },
            )
            .unwrap();
            let mut flat = vec![0u32; n * sel.stride];
            let mut cnt = vec![0u32; n];
            for (r, l) in lists.iter().enumerate() {
                flat[r * sel.stride..r * sel.stride + l.len()].copy_from_slice(l);
                cnt[r] = l.len() as u32;
            }
            g.write(&mut sel.sel, &flat).unwrap();
            g.write(&mut sel.cnt, &cnt).unwrap();
            let mut out = g.zeros::<f32>(n * qc).unwrap();
            let mut scratch = g.zeros::<f32>(n * dims.n_head * cap).unwrap();
            let mut err = g.zeros::<u32>(1).unwrap();
            m::attend(
                g,
                &up(g, &q),
                &up(g, &kc),
                &up(g, &vc),
                cap,
                if causal { None } else { Some(&sel) },
                &up(g, &pos),
                n,
                dims,
                kv == KvType::F16,
                &mut out,
                &mut scratch,
                &mut err,
            )
            .unwrap();
            assert_eq!(g.download(&err).unwrap(), vec![0]);
            // Softmax with the device's expf and another order for Σp: 1e-5 of the largest |v|
            // the element averages (f32); with F16 probabilities one may round the other way:
            // 2e-3.
            let relb = if kv == KvType::F16 { 2e-3 } else { 1e-5 };
            let d = dims.head_dim;
            let group = dims.n_head / dims.n_head_kv;
            let bound = |i: usize| {
                let (r, h, j) = (i / qc, (i % qc) / d, i % d);
                let off = (h / group) * d;
                let toks: Vec<u32> = if causal {
                    (0..=pos[r]).collect()
                } else {
                    lists[r].clone()
                };
                let vm = toks
                    .iter()
                    .map(|&t| (vc[t as usize * kvc + off + j] as f64).abs())
                    .fold(0f64, f64::max);
                relb * vm + 1e-30
            };
            within(
                &format!(
                    "attend {} {kv:?} {dims:?}",
                    if causal { "causal" } else { "sparse" }
                ),
                &down(g, &out),
                want.as_slice(),
                bound,
            );
            // The split form (chunks of 256 tokens): the same bound.
            let mut ss = m::AttnSplitScratch::new(g, n, dims, cap).unwrap();
            let mut out2 = g.zeros::<f32>(n * qc).unwrap();
            m::attend_split(
                g,
                &up(g, &q),
                &up(g, &kc),
                &up(g, &vc),
                cap,
                if causal { None } else { Some(&sel) },
                &up(g, &pos),
                n,
                dims,
                kv == KvType::F16,
                &mut out2,
                &mut ss,
                &mut err,
                None,
            )
            .unwrap();
            assert_eq!(g.download(&err).unwrap(), vec![0]);
            within(
                &format!(
                    "attend_split {} {kv:?} {dims:?}",
                    if causal { "causal" } else { "sparse" }
                ),
                &down(g, &out2),
                want.as_slice(),
                bound,
            );
        }
    }
}

/// The grouped prefill attention (attn.cu `attend_group_*`: a block per row, group of up to 12
/// heads of one kv head and chunk), the per-head kernels with their key rows staged
/// (`STRATA_CUDA_ATTN_DIRECT=0`) and with every row through the out and sum passes
/// (`STRATA_CUDA_ATTN_FUSE=0`) against the per-head defaults, with the output gate on the F32
/// stores: bitwise, over selections
/// and causally, F32 (with specials) and F16 stores, group sizes 2, 7, 12 and 26 (three blocks
/// of heads for one kv head), rows spanning several chunks of 256 tokens.
#[test]
fn grouped_attention_equals_the_per_head_kernels() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(21);
    let cap = 700usize;
    for (dims, causal) in [
        (
            AttnDims {
                n_head: 24,
                n_head_kv: 2,
                head_dim: 256,
            },
            false,
        ),
        (
            AttnDims {
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
            },
            false,
        ),
        (
            AttnDims {
                n_head: 26,
                n_head_kv: 1,
                head_dim: 32,
            },
            false,
        ),
        (
            AttnDims {
                n_head: 14,
                n_head_kv: 2,
                head_dim: 64,
            },
            true,
        ),
        (
            AttnDims {
                n_head: 24,
                n_head_kv: 2,
                head_dim: 256,
            },
            true,
        ),
    ] {
        let kvc = dims.n_head_kv * dims.head_dim;
        let qc = dims.n_head * dims.head_dim;
        for f16 in [false, true] {
            let mut gen = |n: usize| {
                if f16 {
                    rng.f32_vec(n, 1.0)
                } else {
                    rng.f32_vec_special(n, 1.0)
                }
            };
            let mut kc = gen(cap * kvc);
            let mut vc = gen(cap * kvc);
            let pos: Vec<u32> = vec![0, 3, 37, 150, 255, 256, 299, 511, 512, 600, 690, 699];
            let n = pos.len();
            let q = gen(n * qc);
            if f16 && causal {
                for v in kc.iter_mut().chain(vc.iter_mut()) {
                    *v = half::f16::from_f32(*v).to_f32();
                }
            }
            let lists: Vec<Vec<u32>> = pos
                .iter()
                .map(|&p| (0..=p).filter(|_| rng.below(3) != 0 || p < 4).collect())
                .collect();
            let mut sel = m::Selection::new(
                g,
                n,
                cap,
                QsaSelect {
                    ratio: 4,
                    budget: cap,
                    rule: QsaRule::Reference,
                },
            )
            .unwrap();
            let mut flat = vec![0u32; n * sel.stride];
            let mut cnt = vec![0u32; n];
            for (r, l) in lists.iter().enumerate() {
                flat[r * sel.stride..r * sel.stride + l.len()].copy_from_slice(l);
                cnt[r] = l.len() as u32;
            }
            g.write(&mut sel.sel, &flat).unwrap();
            g.write(&mut sel.cnt, &cnt).unwrap();
            let (qd, kd, vd, pd) = (up(g, &q), up(g, &kc), up(g, &vc), up(g, &pos));
            // The output gate (qwen4exp's) on the F32 stores' cases.
            let gate = (!f16).then(|| up(g, &rng.f32_vec(n * qc, 2.0)));
            let mut outs = Vec::new();
            // The per-head kernels with their scores' key rows read directly and a one-chunk
            // row finished by the scores kernel (the defaults), with the rows staged through
            // shared memory (`STRATA_CUDA_ATTN_DIRECT=0`), with every row through the out and
            // sum passes (`STRATA_CUDA_ATTN_FUSE=0`), then the grouped ones.
            for (grouped, direct, fuse) in [
                (false, true, true),
                (false, false, true),
                (false, true, false),
                (true, true, true),
            ] {
                strata_cuda::device::set_switch("STRATA_CUDA_ATTN_DIRECT", Some(direct)).unwrap();
                strata_cuda::device::set_switch("STRATA_CUDA_ATTN_FUSE", Some(fuse)).unwrap();
                // Scratch for fewer rows than the call: the row chunks run too.
                let mut ss = m::AttnSplitScratch::new(g, 5, dims, cap).unwrap();
                let mut out = g.zeros::<f32>(n * qc).unwrap();
                let mut err = g.zeros::<u32>(1).unwrap();
                m::attend_split_as(
                    g,
                    &qd,
                    &kd,
                    &vd,
                    cap,
                    if causal { None } else { Some(&sel) },
                    &pd,
                    n,
                    dims,
                    f16,
                    &mut out,
                    &mut ss,
                    &mut err,
                    grouped,
                    gate.as_ref(),
                )
                .unwrap();
                assert_eq!(g.download(&err).unwrap(), vec![0]);
                outs.push(down(g, &out));
            }
            strata_cuda::device::set_switch("STRATA_CUDA_ATTN_DIRECT", None).unwrap();
            strata_cuda::device::set_switch("STRATA_CUDA_ATTN_FUSE", None).unwrap();
            nontrivial("attend_split", &outs[0]);
            bitwise(
                &format!("staged scores, causal {causal}, f16 {f16}, {dims:?}"),
                &outs[1],
                &outs[0],
            );
            bitwise(
                &format!("unfused one-chunk rows, causal {causal}, f16 {f16}, {dims:?}"),
                &outs[2],
                &outs[0],
            );
            bitwise(
                &format!("grouped attention, causal {causal}, f16 {f16}, {dims:?}"),
                &outs[3],
                &outs[0],
            );
        }
    }
}

// ---- bad input ---------------------------------------------------------------------------------------

#[test]
fn launchers_refuse_bad_shapes() {
    let Some(g) = gpu() else { return };
    let x = g.zeros::<f32>(100).unwrap();
    let w = g.zeros::<f32>(7).unwrap();
    let mut o = g.zeros::<f32>(100).unwrap();
    let e = m::rms_norm(g, &x, &w, &mut o, 1, 100, 10, 1e-6).unwrap_err();
    assert!(e.to_string().contains("7 weights"), "{e}");
    let e = m::rms_norm(g, &x, &up(g, &[1f32; 10]), &mut o, 2, 100, 10, 1e-6).unwrap_err();
    assert!(e.to_string().contains("holds 100"), "{e}");
    let e = m::deinterleave(g, &x, &mut o, 1, 100, 30, 2).unwrap_err();
    assert!(e.to_string().contains("2 parts of 30"), "{e}");
    // A format without product kernels is refused by name.
    let dw = DevWeight::upload(g, GgmlType::IQ2_XS, &[0u8; 74], 1, 256, 1).unwrap();
    let e = m::matmul(g, &dw, &g.zeros::<u8>(292).unwrap(), 1, &mut o).unwrap_err();
    assert!(e.to_string().contains("IQ2_XS"), "{e}");
    // A position buffer shorter than the rows.
    let freqs = up(g, &m::rope_freqs(64, 1e4));
    let e = m::rope_neox(g, &mut o, &up(g, &[0u32]), &freqs, 2, 50, 50, 0).unwrap_err();
    assert!(e.to_string().contains("positions holds 1"), "{e}");
}

// ---- graph replay -------------------------------------------------------------------------------

/// A decode step's attention (two KV appends and causal attention, qwen2 geometry) captured
/// once as a graph and replayed for six steps with only its inputs rewritten in place (the
/// new key/value/query rows and the position): each replay matches the CPU at that step.
#[test]
fn a_captured_step_replays_with_new_inputs() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(21);
    let dims = AttnDims {
        n_head: 14,
        n_head_kv: 2,
        head_dim: 64,
    };
    let (kvc, qc, cap) = (2 * 64, 14 * 64, 32usize);
    let mut xk = g.zeros::<f32>(kvc).unwrap();
    let mut xv = g.zeros::<f32>(kvc).unwrap();
    let mut q = g.zeros::<f32>(qc).unwrap();
    let mut pos = g.zeros::<u32>(1).unwrap();
    let mut ks = g.zeros::<f32>(cap * kvc).unwrap();
    let mut vs = g.zeros::<f32>(cap * kvc).unwrap();
    let mut out = g.zeros::<f32>(qc).unwrap();
    let mut scratch = g.zeros::<f32>(14 * cap).unwrap();
    let mut err = g.zeros::<u32>(1).unwrap();
    let graph = g
        .capture(&mut || {
            m::kv_append(g, &mut ks, cap, &xk, &pos, 1, kvc, false, &mut err)?;
            m::kv_append(g, &mut vs, cap, &xv, &pos, 1, kvc, false, &mut err)?;
            m::attend(
                g,
                &q,
                &ks,
                &vs,
                cap,
                None,
                &pos,
                1,
                dims,
                false,
                &mut out,
                &mut scratch,
                &mut err,
            )
        })
        .unwrap();
    let (mut kc, mut vc) = (buf(0, kvc, &[]), buf(0, kvc, &[]));
    for p in 0..6u32 {
        let (k1, v1, q1) = (
            rng.f32_vec_special(kvc, 1.0),
            rng.f32_vec_special(kvc, 1.0),
            rng.f32_vec_special(qc, 1.0),
        );
        g.write(&mut xk, &k1).unwrap();
        g.write(&mut xv, &v1).unwrap();
        g.write(&mut q, &q1).unwrap();
        g.write(&mut pos, &[p]).unwrap();
        graph.launch().unwrap();
        append_kv(&be, &mut kc, &buf(1, kvc, &k1), KvType::F32);
        append_kv(&be, &mut vc, &buf(1, kvc, &v1), KvType::F32);
        let want = be
            .attend_causal(&buf(1, qc, &q1), &kc, &vc, &ids(&[p]), dims, KvType::F32)
            .unwrap();
        let vals = vc.as_slice().to_vec();
        let bound = |i: usize| {
            let (h, j) = (i / 64, i % 64);
            let off = (h / 7) * 64;
            let vm = (0..=p as usize)
                .map(|t| (vals[t * kvc + off + j] as f64).abs())
                .fold(0f64, f64::max);
            1e-5 * vm + 1e-30
        };
        within(
            &format!("replayed step at position {p}"),
            &down(g, &out),
            want.as_slice(),
            bound,
        );
    }
    assert_eq!(g.download(&err).unwrap(), vec![0]);
}

// ---- timings (printed, never asserted; docs/PERF.md records them) --------------------------------

/// Device time of full-size decode shapes, each op captured 20 times in a graph and timed with
/// events (median of 9). `--ignored`: a measurement, not a test.
#[test]
#[ignore]
fn model_op_timings() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(22);
    let time = |name: &str, f: &mut dyn FnMut() -> Result<(), strata_cuda::CudaError>| {
        let graph = g.capture(&mut || (0..20).try_for_each(|_| f())).unwrap();
        graph.launch().unwrap();
        g.check(name).unwrap();
        let mut t: Vec<f64> = (0..9)
            .map(|_| g.time_us(&mut || graph.launch()).unwrap() / 20.0)
            .collect();
        t.sort_by(f64::total_cmp);
        eprintln!("TIMING {name}: {:.1} us", t[4]);
    };
    let mut err = g.zeros::<u32>(1).unwrap();
    // GDN step, 16 key / 48 value heads of 128.
    let dims = GdnDims {
        n_k_heads: 16,
        n_v_heads: 48,
        head_k: 128,
        head_v: 128,
        conv_kernel: 4,
    };
    let dev = m::GdnDev {
        ssm_a: &up(g, &[-1f32; 48]),
        dt_bias: &up(g, &[0f32; 48]),
        norm: &up(g, &vec![1f32; 128]),
        dims,
        eps: 1e-6,
    };
    let (qkv, z) = (
        up(g, &rng.f32_vec(dims.conv_dim(), 1.0)),
        up(g, &rng.f32_vec(dims.value_dim(), 1.0)),
    );
    let (al, bt) = (up(g, &rng.f32_vec(48, 1.0)), up(g, &rng.f32_vec(48, 1.0)));
    let mut st = g.zeros::<f32>(48 * 128 * 128).unwrap();
    let mut o = g.zeros::<f32>(8 * dims.value_dim()).unwrap();
    time("gdn_step 1 row (48 heads of 128)", &mut || {
        m::gdn_step(g, &dev, &qkv, &z, &al, &bt, &mut st, &mut o, 1)
    });
    let (qkv5, z5) = (
        up(g, &rng.f32_vec(512 * dims.conv_dim(), 1.0)),
        up(g, &rng.f32_vec(512 * dims.value_dim(), 1.0)),
    );
    let (al5, bt5) = (
        up(g, &rng.f32_vec(512 * 48, 1.0)),
        up(g, &rng.f32_vec(512 * 48, 1.0)),
    );
    let mut o5 = g.zeros::<f32>(512 * dims.value_dim()).unwrap();
    time("gdn_step 512 rows (sequential exact mode)", &mut || {
        m::gdn_step(g, &dev, &qkv5, &z5, &al5, &bt5, &mut st, &mut o5, 512)
    });
    let mut gs = m::GdnScratch::new(g, dims, 512).unwrap();
    time("gdn_step_scan 512 rows (3 launches)", &mut || {
        m::gdn_step_scan(
            g, &dev, &qkv5, &z5, &al5, &bt5, &mut st, &mut o5, 512, &mut gs,
        )
    });
    time("gdn_step_scan 1 row (3 launches)", &mut || {
        m::gdn_step_scan(g, &dev, &qkv, &z, &al, &bt, &mut st, &mut o, 1, &mut gs)
    });
    time("gdn_step_chunked 512 rows (chunks of 16)", &mut || {
        m::gdn_step_chunked(g, &dev, &qkv5, &z5, &al5, &bt5, &mut st, &mut o5, 512)
    });
    let mut hist = g.zeros::<f32>(3 * 10240).unwrap();
    let cw = up(g, &rng.f32_vec(4 * 10240, 0.5));
    let cx = up(g, &rng.f32_vec(10240, 1.0));
    let mut co = g.zeros::<f32>(10240).unwrap();
    time("conv1d_silu 1 row of 10240", &mut || {
        m::conv1d_silu(g, &cx, &cw, &mut hist, &mut co, 1, 10240, 4, 1)
    });
    // QSA at 32K: selection over 8192 blocks, attention over 2051 tokens (24 heads, 2 KV heads).
    let cap = 32768usize;
    let s = QsaSelect {
        ratio: 4,
        budget: 2048,
        rule: QsaRule::Reference,
    };
    let mut sel = m::Selection::new(g, 1, cap, s).unwrap();
    let blocks = up(g, &rng.f32_vec(cap / 4 * 128, 1.0));
    let qi = up(g, &rng.f32_vec(4 * 128, 1.0));
    let pos = up(g, &[cap as u32 - 1]);
    time("qsa_select reference, 8192 blocks", &mut || {
        m::qsa_select(g, &qi, &blocks, &pos, 1, 4, 128, s, &mut sel, &mut err)
    });
    let adims = AttnDims {
        n_head: 24,
        n_head_kv: 2,
        head_dim: 256,
    };
    let kc = up(g, &rng.f32_vec(cap * 512, 1.0));
    let vc = up(g, &rng.f32_vec(cap * 512, 1.0));
    let q = up(g, &rng.f32_vec(24 * 256, 1.0));
    let mut ao = g.zeros::<f32>(24 * 256).unwrap();
    let mut scratch = g.zeros::<f32>(24 * cap).unwrap();
    time("attend sparse, 2051 selected tokens", &mut || {
        m::attend(
            g,
            &q,
            &kc,
            &vc,
            cap,
            Some(&sel),
            &pos,
            1,
            adims,
            false,
            &mut ao,
            &mut scratch,
            &mut err,
        )
    });
    let mut ss = m::AttnSplitScratch::new(g, 1, adims, cap).unwrap();
    time("attend_split sparse, 2051 selected tokens", &mut || {
        m::attend_split(
            g,
            &q,
            &kc,
            &vc,
            cap,
            Some(&sel),
            &pos,
            1,
            adims,
            false,
            &mut ao,
            &mut ss,
            &mut err,
            None,
        )
    });
    time("attend_split causal, 32768 tokens", &mut || {
        m::attend_split(
            g, &q, &kc, &vc, cap, None, &pos, 1, adims, false, &mut ao, &mut ss, &mut err, None,
        )
    });
    time("attend causal, 32768 tokens", &mut || {
        m::attend(
            g,
            &q,
            &kc,
            &vc,
            cap,
            None,
            &pos,
            1,
            adims,
            false,
            &mut ao,
            &mut scratch,
            &mut err,
        )
    });
    // Routed experts, Q2_0, top-10 of 64 (each expert 1.4 MB: beyond L2 over the graph's 20).
    let (h, ff, ne, ks) = (2560usize, 640usize, 64usize, 10usize);
    let ex = m::ExpertsDev {
        gate: &DevWeight::upload(
            g,
            GgmlType::Q2_0,
            &weight_blocks(GgmlType::Q2_0, ne * ff * h / 64, 1),
            ff,
            h,
            ne,
        )
        .unwrap(),
        up: &DevWeight::upload(
            g,
            GgmlType::Q2_0,
            &weight_blocks(GgmlType::Q2_0, ne * ff * h / 64, 2),
            ff,
            h,
            ne,
        )
        .unwrap(),
        down: &DevWeight::upload(
            g,
            GgmlType::Q2_0,
            &weight_blocks(GgmlType::Q2_0, ne * ff * h / 64, 3),
            h,
            ff,
            ne,
        )
        .unwrap(),
    };
    let x = up(g, &rng.f32_vec(h, 1.0));
    let ids = up(g, &rng.distinct(ks, ne));
    let wts = up(g, &vec![0.1f32; ks]);
    let mut ms = m::MoeScratch::new(g, &ex, 1, ks).unwrap();
    let mut mo = g.zeros::<f32>(h).unwrap();
    time("moe_experts decode, 1 row, top-10 Q2_0", &mut || {
        m::moe_experts(g, &ex, &x, &ids, &wts, &mut ms, false, &mut mo, &mut err)
    });
    // A prefill chunk's routed experts: 512 rows × top-10, grouped by expert.
    let x5 = up(g, &rng.f32_vec(512 * h, 1.0));
    let ids5: Vec<i32> = (0..512).flat_map(|_| rng.distinct(ks, ne)).collect();
    let ids5 = up(g, &ids5);
    let wts5 = up(g, &vec![0.1f32; 512 * ks]);
    let mut ms5 = m::MoeScratch::new(g, &ex, 512, ks).unwrap();
    let mut mo5 = g.zeros::<f32>(512 * h).unwrap();
    time(
        "moe_experts prefill, 512 rows, top-10 of 64, grouped",
        &mut || {
            m::moe_experts(
                g, &ex, &x5, &ids5, &wts5, &mut ms5, true, &mut mo5, &mut err,
            )
        },
    );
    // Hyper-connection mix, full size.
    let inj_full = DevWeight::upload(
        g,
        GgmlType::BF16,
        &bf16_bytes(&rng.f32_vec(4 * 10240, 0.02)),
        4,
        10240,
        1,
    )
    .unwrap();
    let hc = m::HcDev {
        norm: &up(g, &vec![1f32; 10240]),
        down: &DevWeight::upload(
            g,
            GgmlType::BF16,
            &bf16_bytes(&rng.f32_vec(320 * 10240, 0.02)),
            320,
            10240,
            1,
        )
        .unwrap(),
        up: &DevWeight::upload(
            g,
            GgmlType::BF16,
            &bf16_bytes(&rng.f32_vec(320 * 10240, 0.02)),
            10240,
            320,
            1,
        )
        .unwrap(),
        inject: Some(&inj_full),
        streams: 4,
        h: 2560,
        eps: 1e-6,
        fast: false,
    };
    let mut hs = m::HcScratch::new(g, &hc, 1).unwrap();
    let hx = up(g, &rng.f32_vec(10240, 1.0));
    let mut hu = g.zeros::<f32>(2560).unwrap();
    let mut hi = g.zeros::<f32>(4).unwrap();
    time("hc_mix 1 row (4 x 2560, rank 320)", &mut || {
        m::hc_mix(g, &hc, &hx, 1, &mut hs, &mut hu, Some(&mut hi))
    });
    // A prefill chunk's product: Q4_K 10240 x 2560 against 512 rows (tiled kernel).
    let w = DevWeight::upload(
        g,
        GgmlType::Q4_K,
        &weight_blocks(GgmlType::Q4_K, 10240 * 2560 / 256, 4),
        10240,
        2560,
        1,
    )
    .unwrap();
    let xq = up(
        g,
        &act_bytes(GgmlType::Q4_K, &rng.f32_vec(512 * 2560, 1.0), 512, 2560),
    );
    let mut y = g.zeros::<f32>(512 * 10240).unwrap();
    time("matmul Q4_K 10240x2560, 512 rows", &mut || {
        m::matmul(g, &w, &xq, 512, &mut y)
    });
    assert_eq!(g.download(&err).unwrap(), vec![0]);
}

// ---- the MoE block ------------------------------------------------------------------------------

/// The whole MoE block (router, route, routed experts, shared expert, gated add) against the
/// CPU's composition of the same Backend operations (qwen4exp::moe): the routes exactly, the
/// output within the products' bound.
#[test]
fn moe_block_matches_cpu() {
    let Some(_) = gpu() else { return };
    let be = cpu();
    let cb = strata_cuda::CudaBackend::new(0).expect("CUDA backend");
    let mut rng = Rng::new(23);
    let (h, ff, ne, ku, ffs) = (2560usize, 640usize, 64usize, 8usize, 640usize);
    let q2 = GgmlType::Q2_0;
    let blocks =
        |ty: GgmlType, n: usize, rng: &mut Rng| weight_blocks(ty, n / ty.block_size(), rng.u64());
    let router = rng.f32_vec(ne * h, 0.02);
    let gi = rng.f32_vec(h, 0.02);
    let (h6, f6, e6, fs6) = (h as u64, ff as u64, ne as u64, ffs as u64);
    // The shared expert in the experts' format (one image for both) and in Q4_K (two).
    for sty in [q2, GgmlType::Q4_K] {
        let specs = vec![
            ("router", vec![h6, e6], GgmlType::BF16, bf16_bytes(&router)),
            ("gi", vec![h6, 1], GgmlType::BF16, bf16_bytes(&gi)),
            (
                "eg",
                vec![h6, f6, e6],
                q2,
                blocks(q2, ne * ff * h, &mut rng),
            ),
            (
                "eu",
                vec![h6, f6, e6],
                q2,
                blocks(q2, ne * ff * h, &mut rng),
            ),
            (
                "ed",
                vec![f6, h6, e6],
                q2,
                blocks(q2, ne * h * ff, &mut rng),
            ),
            ("sg", vec![h6, fs6], sty, blocks(sty, ffs * h, &mut rng)),
            ("su", vec![h6, fs6], sty, blocks(sty, ffs * h, &mut rng)),
            (
                "sd",
                vec![fs6, h6],
                GgmlType::Q8_0,
                blocks(GgmlType::Q8_0, h * ffs, &mut rng),
            ),
        ];
        let file = gguf_of(&specs);
        let load_cpu = |n: &str| be.load_weight(&file, file.tensor(n).unwrap()).unwrap();
        let load_cuda = |n: &str| cb.load_weight(&file, file.tensor(n).unwrap()).unwrap();
        fn moe_w<W>(l: impl Fn(&str) -> W) -> MoeW<W> {
            MoeW {
                router: l("router"),
                gate_exps: l("eg"),
                up_exps: l("eu"),
                down_exps: l("ed"),
                gate_shexp: l("sg"),
                up_shexp: l("su"),
                down_shexp: l("sd"),
                shexp_gate: l("gi"),
            }
        }
        let wc = moe_w(load_cpu);
        let wg = moe_w(load_cuda);
        let scale = if sty == q2 { 1.0 } else { 0.01 };
        for nt in [1usize, 3, 8, 11] {
            let x: Vec<f32> = tame(rng.f32_vec_special(nt * h, 1.0))
                .iter()
                .map(|v| v * scale)
                .collect();
            let want = be.moe_block(&wc, &buf(nt, h, &x), ku).unwrap();
            let xg = cb.upload(nt, h, &x).unwrap();
            // The backend's MoE block (fused for 1..=8 rows) against the composition of the
            // same backend's core operations: bitwise.
            let fused = cb.download(&cb.moe_block(&wg, &xg, ku).unwrap()).unwrap();
            let composed = cb
                .download(&moe_block_composed(&cb, &wg, &xg, ku).unwrap())
                .unwrap();
            bitwise(
                &format!("moe block {sty} {nt} rows: backend vs composed"),
                &fused,
                &composed,
            );
            within(
                &format!("moe block {sty} {nt} rows vs CPU"),
                &fused,
                want.as_slice(),
                row_rel(want.as_slice(), h, 2e-3),
            );
        }
    }
}

/// The chunked GDN form (chunks of 16) against the sequential exact mode on the device and the
/// CPU: prefill lengths with partial chunks, the state carried between calls.
#[test]
fn gdn_chunked_matches_sequential() {
    let Some(g) = gpu() else { return };
    let be = cpu();
    let mut rng = Rng::new(24);
    let dims = GdnDims {
        n_k_heads: 2,
        n_v_heads: 4,
        head_k: 128,
        head_v: 128,
        conv_kernel: 4,
    };
    let nv = dims.n_v_heads;
    let ssm_a: Vec<f32> = (0..nv).map(|_| -(0.5 + rng.unit())).collect();
    let dt: Vec<f32> = rng.f32_vec(nv, 1.0);
    let norm: Vec<f32> = (0..128).map(|_| 1.0 + 0.02 * rng.normal()).collect();
    let w = weights(vec![
        ("a", vec![nv as u64], GgmlType::F32, f32_bytes(&ssm_a)),
        ("dt", vec![nv as u64], GgmlType::F32, f32_bytes(&dt)),
        ("norm", vec![128], GgmlType::F32, f32_bytes(&norm)),
    ]);
    let params = GdnParams {
        a: &w["a"],
        dt_bias: &w["dt"],
        norm: &w["norm"],
        dims,
        eps: 1e-6,
    };
    let dev = m::GdnDev {
        ssm_a: &up(g, &ssm_a),
        dt_bias: &up(g, &dt),
        norm: &up(g, &norm),
        dims,
        eps: 1e-6,
    };
    let ss = nv * 128 * 128;
    let mut state = buf(nv, 128 * 128, &vec![0f32; ss]);
    let mut sseq = g.zeros::<f32>(ss).unwrap();
    let mut schk = g.zeros::<f32>(ss).unwrap();
    let mut sscan = g.zeros::<f32>(ss).unwrap();
    let vd = dims.value_dim();
    for n in [1usize, 17, 40, 64] {
        let qkv = rng.f32_vec(n * dims.conv_dim(), 1.0);
        let z = rng.f32_vec(n * vd, 1.0);
        let al = rng.f32_vec(n * nv, 1.0);
        let bt = rng.f32_vec(n * nv, 1.0);
        let (dq, dz, da, db) = (up(g, &qkv), up(g, &z), up(g, &al), up(g, &bt));
        let mut o1 = g.zeros::<f32>(n * vd).unwrap();
        let mut o2 = g.zeros::<f32>(n * vd).unwrap();
        m::gdn_step(g, &dev, &dq, &dz, &da, &db, &mut sseq, &mut o1, n).unwrap();
        m::gdn_step_chunked(g, &dev, &dq, &dz, &da, &db, &mut schk, &mut o2, n).unwrap();
        let want = be
            .gdn_step(
                &params,
                &buf(n, dims.conv_dim(), &qkv),
                &buf(n, vd, &z),
                &buf(n, nv, &al),
                &buf(n, nv, &bt),
                &mut state,
            )
            .unwrap();
        let (r1, r2) = (down(g, &o1), down(g, &o2));
        // The column-spread form: bitwise the fused kernel, outputs and state.
        let mut o3 = g.zeros::<f32>(n * vd).unwrap();
        let mut gs = m::GdnScratch::new(g, dims, n).unwrap();
        m::gdn_step_scan(g, &dev, &dq, &dz, &da, &db, &mut sscan, &mut o3, n, &mut gs).unwrap();
        bitwise(
            &format!("gdn scan out, {n} rows vs fused"),
            &down(g, &o3),
            &r1,
        );
        bitwise(
            &format!("gdn scan state after {n} rows vs fused"),
            &down(g, &sscan),
            &down(g, &sseq),
        );
        // Reassociated sums and exp-of-sums for products of exps: 1e-4 of the row's (state's)
        // largest magnitude against the sequential form, 2e-4 against the CPU.
        within(
            &format!("gdn chunked out, {n} rows vs sequential"),
            &r2,
            &r1,
            row_rel(&r1, 128, 1e-4),
        );
        let (st1, st2) = (down(g, &sseq), down(g, &schk));
        within(
            &format!("gdn chunked state after {n} rows vs sequential"),
            &st2,
            &st1,
            row_rel(&st1, ss, 1e-4),
        );
        within(
            &format!("gdn chunked out, {n} rows vs CPU"),
            &r2,
            want.as_slice(),
            row_rel(want.as_slice(), 128, 2e-4),
        );
    }
}

// ---- picks on the device -----------------------------------------------------------------------

/// The backend's device picks: greedy rows equal the host sampler's argmax (ties to the lower
/// id, -inf rows), a NaN logit is an error there as on the host; draft picks equal the
/// catalogue's pick (NaN never chosen).
#[test]
fn device_picks_equal_the_host_picks() {
    let Some(_) = gpu() else { return };
    let cb = strata_cuda::CudaBackend::new(0).expect("CUDA backend");
    let mut rng = Rng::new(41);
    let nv = 248_320usize;
    for rows in [1usize, 3, 8] {
        let mut v = rng.f32_vec(rows * nv, 4.0);
        // Row 0: a tie between two maxima; the last row: all -inf but one late finite value.
        v[17] = 50.0;
        v[nv - 5] = 50.0;
        let last = (rows - 1) * nv;
        if rows > 1 {
            v[last..last + nv].fill(f32::NEG_INFINITY);
            v[last + nv - 1] = -1.0;
        }
        let want: Vec<u32> = v
            .chunks(nv)
            .map(|r| strata_engine::sampler::argmax(r).unwrap())
            .collect();
        let x = cb.upload(rows, nv, &v).unwrap();
        let got = cb.pick_rows(&x, DevicePick::Greedy, 0).unwrap();
        assert_eq!(
            cb.download_ids(&got).unwrap(),
            want,
            "greedy picks of {rows} rows"
        );
        // Draft picks over a draft vocabulary's rows (40,525), NaN never chosen.
        let nd = 40_525usize;
        let mut d = rng.f32_vec(rows * nd, 4.0);
        d[3] = f32::NAN;
        d[nd - 1] = 100.0;
        let want: Vec<u32> = d
            .chunks(nd)
            .map(|r| strata_engine::kernels::pick::argmax(r) as u32)
            .collect();
        let dx = cb.upload(rows, nd, &d).unwrap();
        let got = cb.pick_draft(&dx).unwrap();
        assert_eq!(
            cb.download_ids(&got).unwrap(),
            want,
            "draft picks of {rows} rows"
        );
    }
    // A NaN logit: the greedy pick is an error, as the host sampler's is.
    let mut v = rng.f32_vec(nv, 1.0);
    v[1000] = f32::NAN;
    assert!(strata_engine::sampler::argmax(&v).is_err());
    let x = cb.upload(1, nv, &v).unwrap();
    let r = cb
        .pick_rows(&x, DevicePick::Greedy, 0)
        .and_then(|ids| cb.download_ids(&ids));
    let e = r.expect_err("a NaN logit must be refused");
    assert!(e.to_string().contains("NaN"), "{e}");
}

// ---- activation images in one launch ------------------------------------------------------------

/// `xprep_multi` (BF16, Q8_0 and Q8_K images of one input in one launch) writes each image
/// byte for byte as the single-format `xprep` does, and `swiglu_xprep` the image of
/// `swiglu` then `xprep`, at decode and prefill row counts, with special values.
#[test]
fn multi_format_images_equal_single_format_xprep() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(51);
    let fmts = [ActFmt::Bf16, ActFmt::Q8_0, ActFmt::Q8K];
    for (n, nt) in [
        (2560usize, 1usize),
        (2560, 3),
        (2560, 8),
        (2560, 19),
        (640, 5),
    ] {
        let x = tame(rng.f32_vec_special(nt * n, 1.0));
        let dx = up(g, &x);
        let usable: Vec<ActFmt> = fmts
            .iter()
            .copied()
            .filter(|f| f.row_bytes(n).is_some())
            .collect();
        let mut single = Vec::new();
        for &f in &usable {
            let mut o = g.zeros::<u8>(nt * f.row_bytes(n).unwrap()).unwrap();
            ops::xprep(g, "optimized", &dx, &mut o, nt, n, f).unwrap();
            single.push(g.download(&o).unwrap());
        }
        let mut outs: Vec<CudaSlice<u8>> = usable
            .iter()
            .map(|f| g.zeros::<u8>(nt * f.row_bytes(n).unwrap()).unwrap())
            .collect();
        {
            let mut it = outs.iter_mut();
            let mut slot = |f: ActFmt| usable.contains(&f).then(|| it.next().unwrap());
            let (b, q, k) = (slot(ActFmt::Bf16), slot(ActFmt::Q8_0), slot(ActFmt::Q8K));
            m::prepare_multi(g, &dx, nt, n, b, q, k).unwrap();
        }
        for ((f, o), want) in usable.iter().zip(&outs).zip(&single) {
            let got = g.download(o).unwrap();
            assert!(
                want.iter().any(|&b| b != 0),
                "{f:?}: an all-zero image proves nothing"
            );
            assert_eq!(&got, want, "xprep_multi {f:?} image, {nt} rows of {n}");
        }
        // swiglu straight into an image = swiglu, then xprep.
        let u = tame(rng.f32_vec_special(nt * n, 1.0));
        let du = up(g, &u);
        let mut act = g.zeros::<f32>(nt * n).unwrap();
        m::swiglu(g, &dx, &du, &mut act, nt * n).unwrap();
        for &f in &usable {
            let rb = f.row_bytes(n).unwrap();
            let mut want = g.zeros::<u8>(nt * rb).unwrap();
            ops::xprep(g, "optimized", &act, &mut want, nt, n, f).unwrap();
            let mut got = g.zeros::<u8>(nt * rb).unwrap();
            m::swiglu_prepare(g, &dx, &du, nt, n, f, &mut got).unwrap();
            let want = g.download(&want).unwrap();
            assert!(want.iter().any(|&b| b != 0));
            assert_eq!(
                g.download(&got).unwrap(),
                want,
                "swiglu_xprep {f:?}, {nt} rows of {n}"
            );
        }
    }
}

/// Weights past one staging buffer go through the two page-locked buffers in turn (whole 32 MiB
/// chunks, then the pageable tail): every byte arrives where it belongs.
#[test]
fn staged_weight_uploads_arrive_whole() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(61);
    for len in [(32usize << 20) - 1, 32 << 20, (97 << 20) + 123] {
        let bytes: Vec<u8> = (0..len).map(|_| rng.u64() as u8).collect();
        let d = g.upload_weights(&bytes).unwrap();
        let back: Vec<u8> = g.download(&d).unwrap();
        assert!(back == bytes, "{len} bytes: the device copy differs");
    }
}

// ---- the fast prefill's products (cuBLAS): within a stated bound, not bitwise ---------------

/// `embed.cu dequant_bf16_*` gives every weight element as the CPU's dequantized value rounded
/// once to BF16 (bitwise), and the fast prefill's product (`m::matmul_blas`: cuBLAS, BF16 in,
/// f32 sums) is within `2⁻²² · K · Σ|w_i·x_i|` of the f64 sum of those same BF16 inputs — the
/// worst case of an f32 sum of K terms, truncating or rounding — for every format it takes,
/// at 64, 300 and 512 rows. Its difference from the exact kernels is printed.
#[test]
fn fast_prefill_products_are_within_their_bound() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(77);
    let (mm, k) = (96usize, 2560usize);
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    // The report's 13 formats (BF16 straight to cuBLAS, the others dequantized first).
    let formats = strata_engine::kernels::embed::REPORT_FORMATS;
    for ty in formats {
        let wb = weight_blocks(ty, mm * k / ty.block_size(), rng.u64());
        let rb = ty.row_bytes(k).unwrap();
        let mut wd = vec![0f32; mm * k];
        for r in 0..mm {
            strata_quant::dequantize(ty, &wb[r * rb..(r + 1) * rb], &mut wd[r * k..(r + 1) * k])
                .unwrap();
        }
        let wq: Vec<f32> = wd.iter().map(|&v| bf(v)).collect();
        let dw = DevWeight::upload(g, ty, &wb, mm, k, 1).unwrap();
        assert!(m::blas_applies(&dw, 512), "{ty}");
        for nt in [64usize, 300, 512] {
            if !m::blas_applies(&dw, nt) {
                assert!(
                    ty != GgmlType::BF16 && nt < m::BLAS_MIN_ROWS_QUANT,
                    "{ty} at {nt}"
                );
                continue;
            }
            let x = tame(rng.f32_vec(nt * k, 1.0));
            let xb = bf16_bytes(&x);
            let xq: Vec<f32> = x.iter().map(|&v| bf(v)).collect();
            let mut y = g.zeros::<f32>(nt * mm).unwrap();
            m::matmul_blas(g, &dw, &up(g, &xb), nt, &mut y).unwrap();
            let got = down(g, &y);
            let (mut worst, mut sum_rel) = (0f64, 0f64);
            for t in 0..nt {
                for r in 0..mm {
                    let (mut s, mut a) = (0f64, 0f64);
                    for i in 0..k {
                        let p = wq[r * k + i] as f64 * xq[t * k + i] as f64;
                        s += p;
                        a += p.abs();
                    }
                    let d = (got[t * mm + r] as f64 - s).abs();
                    let tol = 2f64.powi(-22) * k as f64 * a + 1e-30;
                    assert!(
                        d <= tol,
                        "{ty} at {nt} rows, [{t}][{r}]: {} against {s} (|Δ| {d:.3e} > {tol:.3e})",
                        got[t * mm + r]
                    );
                    worst = worst.max(d / (a + 1e-30));
                    sum_rel += d / (a + 1e-30);
                }
            }
            // Against the exact kernels (the weight's paired activation format).
            let mut ye = g.zeros::<f32>(nt * mm).unwrap();
            m::product(g, &dw, &up(g, &act_bytes(ty, &x, nt, k)), nt, &mut ye).unwrap();
            let exact = down(g, &ye);
            let (mx, mean) = exact.iter().zip(&got).fold((0f32, 0f64), |(m, s), (a, b)| {
                (m.max((a - b).abs()), s + (a - b).abs() as f64)
            });
            eprintln!(
                "fast product {ty} at {nt} rows: |Δ|/Σ|w·x| max {worst:.2e}, mean {:.2e}; \
                 against the exact kernels max |Δ| {mx:.3e}, mean {:.3e}",
                sum_rel / (nt * mm) as f64,
                mean / exact.len() as f64
            );
        }
        // The dequantized weight itself, bitwise: a product with unit activations picks each
        // column (x = e_i for rows i < 64 of the 64-row batch).
        if ty != GgmlType::BF16 {
            let nt = m::BLAS_MIN_ROWS_QUANT;
            let mut x = vec![0f32; nt * k];
            for t in 0..nt {
                x[t * k + (t * 37) % k] = 1.0;
            }
            let mut y = g.zeros::<f32>(nt * mm).unwrap();
            m::matmul_blas(g, &dw, &up(g, &bf16_bytes(&x)), nt, &mut y).unwrap();
            let got = down(g, &y);
            let want: Vec<f32> = (0..nt)
                .flat_map(|t| (0..mm).map(move |r| (t, r)))
                .map(|(t, r)| wq[r * k + (t * 37) % k])
                .collect();
            // Equal as numbers (a −0.0 weight picked by a sum of zeros comes back +0.0).
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(a == b, "dequant_bf16 {ty}, element {i}: {a} against {b}");
            }
        }
    }
    // Shapes it does not take: experts, short batches, a weight over the scratch's size.
    let wb = weight_blocks(GgmlType::Q8_0, 2 * 32 * 64 / 32, 1);
    let dw = DevWeight::upload(g, GgmlType::Q8_0, &wb, 32, 64, 2).unwrap();
    assert!(!m::blas_applies(&dw, 512), "an expert tensor");
}

// ---- the GEMV's bits against its documented order, emulated on the CPU ---------------------

/// f16 bits to f32.
fn f16f(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One weight unit's f32 contribution against its Q8_K activation unit, as the CUDA kernels
/// form it (quants.cuh dot_decoded): the unit's integer dot(s) from the formats' definitions
/// (any order: integers), then the float expression in the kernels' order. Q3_K, Q6_K, IQ4_XS.
fn unit_contribution(ty: GgmlType, w: &[u8], xblk: &[u8], s: usize) -> f32 {
    let dx = f32::from_le_bytes(xblk[0..4].try_into().unwrap());
    let xq = |e: usize| xblk[4 + 32 * s + e] as i8 as i32;
    match ty {
        GgmlType::Q3_K => {
            let sc = &w[96..108];
            let scale = |j: usize| -> i32 {
                let lo = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 } as i32;
                let hi = ((sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3) as i32;
                (lo | (hi << 4)) - 32
            };
            let mut dots = [0i32; 2];
            for e in 0..32 {
                let q = ((w[32 + 32 * (s >> 2) + e] >> (2 * (s & 3))) & 3) as i32;
                let h = ((w[e] >> s) & 1) as i32;
                dots[e / 16] += (q + 4 * h - 4) * xq(e);
            }
            (f16f(w, 108) * dx) * ((scale(2 * s) * dots[0] + scale(2 * s + 1) * dots[1]) as f32)
        }
        GgmlType::Q6_K => {
            // Element 32s + e: 4 low bits from ql, 2 high from qh (ggml's layout), minus 32.
            let (half, g) = (s >> 2, s & 3);
            let mut dots = [0i32; 2];
            for e in 0..32 {
                let ql = w[64 * half + 32 * (g & 1) + e];
                let lo = if g < 2 { ql & 0xF } else { ql >> 4 } as i32;
                let hi = ((w[128 + 32 * half + e] >> (2 * g)) & 3) as i32;
                dots[e / 16] += ((lo | (hi << 4)) - 32) * xq(e);
            }
            let (s0, s1) = (w[192 + 2 * s] as i8 as i32, w[193 + 2 * s] as i8 as i32);
            (f16f(w, 208) * dx) * ((s0 * dots[0] + s1 * dots[1]) as f32)
        }
        GgmlType::IQ4_XS => {
            let kv = &strata_quant::grids::KVALUES_IQ4NL;
            let sh = u16::from_le_bytes([w[2], w[3]]) as i32;
            let lo = ((w[4 + s / 2] >> (4 * (s & 1))) & 0xF) as i32;
            let ls = (lo | (((sh >> (2 * s)) & 3) << 4)) - 32;
            let mut dot = 0i32;
            for j in 0..16 {
                let b = w[8 + 16 * s + j];
                dot += kv[(b & 0xF) as usize] as i32 * xq(j)
                    + kv[(b >> 4) as usize] as i32 * xq(j + 16);
            }
            (f16f(w, 0) * dx) * ((ls * dot) as f32)
        }
        _ => unreachable!("{ty}"),
    }
}

/// The order every GEMV keeps (gemv.cu): lane l adds units l, l + 32, … from +0, then the
/// warp's xor butterfly (16, 8, 4, 2, 1).
fn lane_order(c: &[f32]) -> f32 {
    let mut v = [0f32; 32];
    for (u, &x) in c.iter().enumerate() {
        v[u % 32] += x;
    }
    for off in [16, 8, 4, 2, 1] {
        let w = v;
        for l in 0..32 {
            v[l] = w[l] + w[l ^ off];
        }
    }
    v[0]
}

/// `nt` activation rows (Q8_K images `xq`) against `rows` weight rows of `k` (`wb`), each
/// output by unit_contribution and lane_order: the GEMV's bits, emulated.
fn emulated_product(
    ty: GgmlType,
    wb: &[u8],
    xq: &[u8],
    rows: usize,
    k: usize,
    nt: usize,
) -> Vec<f32> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let (xr, rb) = (xq.len() / nt, (k / bs) * ts);
    let mut out = Vec::with_capacity(nt * rows);
    for t in 0..nt {
        for r in 0..rows {
            let row = &wb[r * rb..(r + 1) * rb];
            let c: Vec<f32> = (0..k / 32)
                .map(|u| {
                    let (b, s) = (u / 8, u % 8);
                    let xblk = &xq[t * xr + 292 * b..t * xr + 292 * (b + 1)];
                    unit_contribution(ty, &row[b * ts..(b + 1) * ts], xblk, s)
                })
                .collect();
            out.push(lane_order(&c));
        }
    }
    out
}

/// The products of Q3_K, Q6_K and IQ4_XS (the GDN qkv formats, the head) equal, bit for bit, their order
/// emulated on the CPU from the formats' definitions: the row-parallel optimized GEMV (many
/// rows) and the unit-parallel product (few), one and three activation rows. Binds the
/// decoders' rewrites (Q3_K's −4 through the group sums, the aligned word loads, IQ4_XS's nibble order) to
/// the formats themselves, not only to the other CUDA kernels.
#[test]
fn q3_k_q6_k_and_iq4_xs_products_equal_their_order_emulated_on_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(53);
    let k = 2560;
    for ty in [GgmlType::Q3_K, GgmlType::Q6_K, GgmlType::IQ4_XS] {
        let bs = ty.block_size();
        for rows in [4101usize, 300] {
            let wb = weight_blocks(ty, rows * k / bs, rng.u64());
            let dw = DevWeight::upload(g, ty, &wb, rows, k, 1).unwrap();
            for nt in [1usize, 3] {
                let x = tame(rng.f32_vec_special(nt * k, 1.0));
                let xq = act_bytes(ty, &x, nt, k);
                let mut y = g.zeros::<f32>(nt * rows).unwrap();
                m::product(g, &dw, &up(g, &xq), nt, &mut y).unwrap();
                let got = down(g, &y);
                let want = emulated_product(ty, &wb, &xq, rows, k, nt);
                bitwise(
                    &format!("{ty} {rows}×{k} nt={nt} vs its order on the CPU"),
                    &got,
                    &want,
                );
            }
        }
    }
}

/// The CPU emulation of the GEMV's order above agrees with the CPU backend's product (another
/// order) within the dot bound: the emulation itself reads the formats right. No GPU needed.
#[test]
fn the_emulated_gemv_order_agrees_with_the_cpu_product() {
    let be = cpu();
    let mut rng = Rng::new(54);
    let (rows, k, nt) = (37usize, 2560usize, 2usize);
    for ty in [GgmlType::Q3_K, GgmlType::Q6_K, GgmlType::IQ4_XS] {
        let bs = ty.block_size();
        let wb = weight_blocks(ty, rows * k / bs, rng.u64());
        let x = tame(rng.f32_vec_special(nt * k, 1.0));
        let xq = act_bytes(ty, &x, nt, k);
        let w = weights(vec![("w", vec![k as u64, rows as u64], ty, wb.clone())]);
        let cpu_y = be.matmul(&w["w"], &buf(nt, k, &x)).unwrap();
        let emu = emulated_product(ty, &wb, &xq, rows, k, nt);
        let tol = dot_tol(ty, &wb, rows, k, &x, nt);
        within(
            &format!("{ty} emulated order vs the CPU product"),
            &emu,
            cpu_y.as_slice(),
            |i| tol[i],
        );
    }
}
