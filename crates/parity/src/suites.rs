//! The suites, written once for every backend: per kernel and shape, fresh random inputs per
//! trial, baseline against optimized bit for bit, the optimized outputs against the CPU
//! reference (`strata_engine::kernels`) within the kernel's stated agreement, then the pair
//! timed interleaved on the last trial's inputs.

use strata_engine::kernels::actq::{quantize_row, ActFmt};
use strata_engine::kernels::testdata::{weight_blocks, Rng};
use strata_engine::kernels::{embed, gemv, norm, pick, route, slop};
use strata_quant::GgmlType;

use crate::backend::{BoxCase, KernelBackend, Out};
use crate::check::{bitwise_bytes, bitwise_f32, bitwise_i32, within};
use crate::{Options, ParityError, Report, Row, Suite};

pub(crate) const EPS: f32 = 1e-6;

fn bitwise_out(a: &[Out], b: &[Out]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} outputs vs {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let r = match (x, y) {
            (Out::Bytes(p), Out::Bytes(q)) => bitwise_bytes(p, q),
            (Out::F32(p), Out::F32(q)) => bitwise_f32(p, q),
            (Out::I32(p), Out::I32(q)) => bitwise_i32(p, q),
            _ => Err("output kinds differ".into()),
        };
        r.map_err(|e| {
            if a.len() > 1 {
                format!("output {i}: {e}")
            } else {
                e
            }
        })?;
    }
    Ok(())
}

/// Below this a CPU value may come from a subnormal intermediate (a product under 2^-126,
/// then times a norm weight under 2^8) that an adapter flushing subnormals makes zero.
const FLUSH_BOUND: f32 = f32::from_bits((127 - 118) << 23); // 2^-118

/// Exact, or equal except where the reference is below [`FLUSH_BOUND`] and the backend gave
/// a zero of either sign (NVIDIA's Vulkan compute flushes subnormal intermediates).
fn exact_or_flushed(got: &[f32], want: &[f32]) -> Result<String, String> {
    if got.len() != want.len() {
        return Err(format!("lengths differ: {} vs {}", got.len(), want.len()));
    }
    let mut flushed = 0usize;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        if (w.abs() < FLUSH_BOUND && *g == 0.0) || (*w == 0.0 && g.is_subnormal()) {
            flushed += 1;
            continue;
        }
        return Err(format!(
            "element {i}: {g:e} ({:#010x}) vs reference {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        ));
    }
    Ok(if flushed == 0 {
        "exact".into()
    } else {
        format!("exact but {flushed} value(s) under 2^-118 flushed to 0")
    })
}

/// Activation images: exact bytes, or the same values but for flushed subnormals.
fn image_cross(fmt: ActFmt, n: usize, got: &[u8], want: &[u8]) -> Result<String, String> {
    if bitwise_bytes(got, want).is_ok() {
        return Ok("exact".into());
    }
    let rows = want.len() / fmt.row_bytes(n).unwrap_or(1).max(1);
    let (mut g, mut w) = (vec![0f32; rows * n], vec![0f32; rows * n]);
    strata_engine::kernels::actq::dequantize_row(fmt, got, &mut g).map_err(|e| e.to_string())?;
    strata_engine::kernels::actq::dequantize_row(fmt, want, &mut w).map_err(|e| e.to_string())?;
    let r = exact_or_flushed(&g, &w);
    match r {
        Ok(s) if s == "exact" => Err(format!(
            "bytes differ ({}) but the values agree",
            bitwise_bytes(got, want).err().unwrap_or_default()
        )),
        r => r,
    }
}

fn fnv(o: &[Out]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3);
        }
    };
    for x in o {
        match x {
            Out::Bytes(v) => eat(v),
            Out::F32(v) => v.iter().for_each(|f| eat(&f.to_le_bytes())),
            Out::I32(v) => v.iter().for_each(|i| eat(&i.to_le_bytes())),
        }
    }
    h
}

/// The shape set: the backend's own (CPU-speed backends take the smaller one), or the one
/// `STRATA_PARITY_SHAPES=small|large` forces (to compare digests across adapters).
fn small_shapes(be: &dyn KernelBackend) -> bool {
    match std::env::var("STRATA_PARITY_SHAPES").as_deref() {
        Ok("small") => true,
        Ok("large") => false,
        _ => be.small(),
    }
}

fn out_f32(o: &[Out], i: usize) -> &[f32] {
    match o.get(i) {
        Some(Out::F32(v)) => v,
        _ => &[],
    }
}

fn out_bytes(o: &[Out], i: usize) -> &[u8] {
    match o.get(i) {
        Some(Out::Bytes(v)) => v,
        _ => &[],
    }
}

fn out_i32(o: &[Out], i: usize) -> &[i32] {
    match o.get(i) {
        Some(Out::I32(v)) => v,
        _ => &[],
    }
}

/// The verdicts of one shape: first parity failure, and the weakest CPU agreement.
struct Verdict {
    par: Result<(), String>,
    cross: Result<String, String>,
}

impl Verdict {
    fn new(reference: bool) -> Verdict {
        Verdict {
            par: Ok(()),
            cross: Ok(if reference { "-" } else { "exact" }.into()),
        }
    }

    fn par(&mut self, r: Result<(), String>) {
        if self.par.is_ok() {
            self.par = r;
        }
    }

    fn cross(&mut self, r: Result<String, String>) {
        match (&self.cross, r) {
            (Err(_), _) => {}
            (_, Err(e)) => self.cross = Err(e),
            (Ok(a), Ok(b)) => {
                if (a == "exact" || a == "-") && b != "exact" {
                    self.cross = Ok(b);
                }
            }
        }
    }
}

/// Builds one trial's case and the CPU's expected outputs (None on the reference backend).
type MakeFn<'m, 'b> = dyn FnMut(usize) -> Result<(BoxCase<'b>, Option<Vec<Out>>), ParityError> + 'm;
/// States the agreement of the optimized outputs with the CPU's.
type CrossFn<'c> = dyn Fn(&[Out], &[Out]) -> Result<String, String> + 'c;

struct Ctx<'a> {
    be: &'a dyn KernelBackend,
    opts: &'a Options,
    rows: Vec<Row>,
}

impl Ctx<'_> {
    fn floor(&self, bytes: f64) -> f64 {
        let (bw, launch) = self.be.floors();
        if bw <= 0.0 {
            return 0.0;
        }
        (bytes / (bw * 1e3)).max(launch)
    }

    /// Runs `trials` fresh cases: `make` builds a case and the CPU's expected outputs (None
    /// on the reference backend), `cross` states the agreement. Times the last case.
    #[allow(clippy::too_many_arguments)]
    fn shape<'b>(
        &mut self,
        kernel: &str,
        shape: String,
        bytes: f64,
        trials: usize,
        reps: usize,
        make: &mut MakeFn<'_, 'b>,
        cross: &CrossFn<'_>,
    ) -> Result<(), ParityError> {
        let mut v = Verdict::new(self.be.is_reference());
        let mut last = None;
        let mut digest = String::new();
        for trial in 0..trials.max(1) {
            let (mut c, want) = make(trial)?;
            let a = c.outputs(false)?;
            let b = c.outputs(true)?;
            if trial == 0 {
                digest = format!("{:016x}", fnv(&b));
            }
            v.par(bitwise_out(&a, &b));
            if let Some(w) = want {
                v.cross(cross(&b, &w));
            }
            last = Some(c);
        }
        let mut c = last.ok_or_else(|| ParityError::Other("no trial ran".into()))?;
        let (ta, tb) = c.time_pair(reps)?;
        let failed = v.par.is_err() || v.cross.is_err();
        self.rows.push(Row {
            kernel: kernel.into(),
            shape,
            base_us: ta,
            cand_us: tb,
            parity: match &v.par {
                Ok(()) => "BITWISE PASS".into(),
                Err(e) => format!("FAIL: {e}"),
            },
            vs_cpu: match &v.cross {
                Ok(s) => s.clone(),
                Err(e) => format!("FAIL: {e}"),
            },
            bytes,
            floor_us: self.floor(bytes),
            failed,
            digest,
        });
        Ok(())
    }

    fn reference(&self) -> bool {
        self.be.is_reference()
    }
}

pub fn run(be: &dyn KernelBackend, suite: Suite, opts: &Options) -> Result<Report, ParityError> {
    let mut rng = Rng::new(opts.seed ^ suite.name().len() as u64);
    let mut cx = Ctx {
        be,
        opts,
        rows: Vec::new(),
    };
    let small = small_shapes(be);
    match suite {
        Suite::MtpAb => {
            norm_rows(&mut cx, &mut rng)?;
            embed_rows(&mut cx, &mut rng)?;
            slop_rows(&mut cx, &mut rng)?;
            pick_rows(&mut cx, &mut rng)?;
        }
        Suite::Sample => {
            slop_rows(&mut cx, &mut rng)?;
            pick_rows(&mut cx, &mut rng)?;
        }
        Suite::RouterAb => {
            route_rows(&mut cx, &mut rng)?;
            if !(small && opts.quick) {
                let nts: &[usize] = if small { &[1, 8] } else { &[1, 2, 4, 8] };
                for ty in [GgmlType::BF16, GgmlType::Q8_0] {
                    for e in [512usize, 256] {
                        for &nt in nts {
                            gemv_row(&mut cx, &mut rng, ty, e, nt, "route_gate")?;
                        }
                    }
                }
            }
        }
        Suite::Gemv => {
            let nts: Vec<usize> = match (opts.quick, small) {
                (true, _) => vec![1, 8],
                (false, true) => vec![1, 2, 4, 8],
                (false, false) => (1..=8).collect(),
            };
            let m = if opts.quick && small { 128 } else { 2560 };
            for ty in gemv::GEMV_FORMATS {
                for &nt in &nts {
                    gemv_row(&mut cx, &mut rng, ty, m, nt, "gemv")?;
                }
            }
        }
    }
    let (bw, launch) = be.floors();
    let mut notes = vec![format!(
        "{} fresh-input trials per shape; medians of {} paired, interleaved samples",
        opts.trials, opts.reps
    )];
    notes.extend(be.notes());
    Ok(Report {
        suite: suite.name().into(),
        backend: be.name().into(),
        device: be.device(),
        bandwidth_gbs: bw,
        launch_us: launch,
        notes,
        rows: cx.rows,
    })
}

fn norm_rows(cx: &mut Ctx, rng: &mut Rng) -> Result<(), ParityError> {
    let q = cx.opts.quick;
    let trials = cx.opts.trials;
    let reps = cx.opts.reps;
    let nts: &[usize] = if q { &[1, 8] } else { &[1, 4, 8] };
    let fmts: &[ActFmt] = if q {
        &[ActFmt::Q8_0, ActFmt::Q8K]
    } else {
        &[ActFmt::Q8_0, ActFmt::Q8K, ActFmt::Bf16, ActFmt::F32]
    };
    let reference = cx.reference();
    let be = cx.be;
    for n in [2560usize, 10240] {
        for &nt in nts {
            for &fmt in fmts {
                let rb = fmt.row_bytes(n).unwrap_or(0);
                cx.shape(
                    "rms_xprep",
                    format!("n={n}, nt={nt}, {}", fmt.name()),
                    (nt * n * 4 + n * 4 + nt * rb) as f64,
                    trials,
                    reps,
                    &mut |_| {
                        let x = rng.f32_vec_special(nt * n, 1.0);
                        let w = rng.f32_vec(n, 1.0);
                        let want = if reference {
                            None
                        } else {
                            let mut o = vec![0u8; nt * rb];
                            norm::rms_xprep_optimized(&x, &w, n, EPS, fmt, &mut o)?;
                            Some(vec![Out::Bytes(o)])
                        };
                        Ok((be.rms_xprep(&x, &w, n, EPS, fmt)?, want))
                    },
                    &|b, w| image_cross(fmt, n, out_bytes(b, 0), out_bytes(w, 0)),
                )?;
            }
        }
    }
    for &nt in nts {
        let (n, s) = (2560usize, 4usize);
        cx.shape(
            "combine_gnorm",
            format!("hc={s}, nt={nt}"),
            (nt * s * n * 4 * 3 + nt * n * 4 + s * n * 4) as f64,
            trials,
            reps,
            &mut |_| {
                let h = rng.f32_vec_special(nt * s * n, 1.0);
                let e = rng.f32_vec_special(nt * n, 1.0);
                let w = rng.f32_vec(s * n, 1.0);
                let want = if reference {
                    None
                } else {
                    let (mut r, mut o) = (vec![0f32; nt * s * n], vec![0f32; nt * s * n]);
                    norm::combine_gnorm_optimized(&h, &e, &w, n, s, EPS, &mut r, &mut o)?;
                    Some(vec![Out::F32(r), Out::F32(o)])
                };
                Ok((be.combine_gnorm(&h, &e, &w, n, s, EPS)?, want))
            },
            &|b, w| {
                let r = exact_or_flushed(out_f32(b, 0), out_f32(w, 0))?;
                let o = exact_or_flushed(out_f32(b, 1), out_f32(w, 1))?;
                Ok(if r == "exact" { o } else { r })
            },
        )?;
    }
    let xrows: &[usize] = if q { &[8] } else { &[1, 4, 8] };
    let xfmts: &[ActFmt] = if q {
        &[ActFmt::Q8_0, ActFmt::Q8K]
    } else {
        &[ActFmt::Q8_0, ActFmt::Q8K, ActFmt::Bf16]
    };
    for &nr in xrows {
        for &fmt in xfmts {
            let n = 2560;
            let rb = fmt.row_bytes(n).unwrap_or(0);
            cx.shape(
                "xprep",
                format!("rows={nr}, n={n}, {}", fmt.name()),
                (nr * n * 4 + nr * rb) as f64,
                trials,
                reps,
                &mut |_| {
                    let x = rng.f32_vec_special(nr * n, 1.0);
                    let want = if reference {
                        None
                    } else {
                        let mut o = vec![0u8; nr * rb];
                        norm::xprep_baseline(&x, n, fmt, &mut o)?;
                        Some(vec![Out::Bytes(o)])
                    };
                    Ok((be.xprep(&x, n, fmt)?, want))
                },
                &|b, w| image_cross(fmt, n, out_bytes(b, 0), out_bytes(w, 0)),
            )?;
        }
    }
    Ok(())
}

fn embed_rows(cx: &mut Ctx, rng: &mut Rng) -> Result<(), ParityError> {
    let n = 2560usize;
    let table_rows = match (cx.opts.quick, small_shapes(cx.be)) {
        (true, true) => 64,
        (false, true) => 1024,
        (true, false) => 256,
        (false, false) => 4096,
    };
    let reference = cx.reference();
    let be = cx.be;
    let (trials, reps) = (cx.opts.trials, cx.opts.reps);
    for (k, ty) in embed::REPORT_FORMATS.into_iter().enumerate() {
        let rb = ty.row_bytes(n).unwrap_or(0);
        let seed = cx.opts.seed.wrapping_add(1000 + k as u64);
        let mut table_keep = None;
        cx.shape(
            "embed",
            format!("format={} ({ty})", ty.id()),
            (rb + n * 4) as f64,
            trials,
            reps,
            &mut |_| {
                let t = weight_blocks(ty, table_rows * n / ty.block_size(), seed ^ rng.u64());
                let ids = vec![rng.below(table_rows) as u32];
                let want = if reference {
                    None
                } else {
                    let mut o = vec![0f32; n];
                    embed::embed_baseline(ty, &t, n, &ids, &mut o)?;
                    Some(vec![Out::F32(o)])
                };
                let c = be.embed(ty, &t, n, &ids)?;
                table_keep = Some(t);
                Ok((c, want))
            },
            &|b, w| exact_or_flushed(out_f32(b, 0), out_f32(w, 0)),
        )?;
        // On a device, an id past the table must give a NaN row, not a read out of bounds.
        if let (false, Some(t)) = (reference, table_keep) {
            let mut c = be.embed(ty, &t, n, &[table_rows as u32])?;
            for opt in [false, true] {
                let o = c.outputs(opt)?;
                if !out_f32(&o, 0).iter().all(|x| x.is_nan()) {
                    if let Some(r) = cx.rows.last_mut() {
                        r.failed = true;
                        r.parity = format!(
                            "FAIL: {}: an out-of-range id did not give a NaN row",
                            if opt { "optimized" } else { "baseline" }
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

fn slop_rows(cx: &mut Ctx, rng: &mut Rng) -> Result<(), ParityError> {
    let vocab = 248_320usize;
    let reference = cx.reference();
    let be = cx.be;
    let (trials, reps) = (cx.opts.trials, cx.opts.reps);
    for nv in [40_525usize, 248_320] {
        for mode in 0..3u32 {
            cx.shape(
                "slop_pen",
                format!("nv={nv}, mode={mode}"),
                0.0,
                trials,
                reps,
                &mut |_| {
                    let c = slop::SlopCase::random(rng, vocab, nv, mode);
                    let want = if reference {
                        None
                    } else {
                        let mut l = c.logits.clone();
                        let mut st = vec![0i32; slop::STATE_LEN];
                        slop::slop_pen_baseline(
                            &c.tables.checked(nv)?,
                            mode,
                            c.prev,
                            &c.banned,
                            &c.state,
                            &mut st,
                            &mut l,
                        )?;
                        Some(vec![Out::F32(l), Out::I32(st)])
                    };
                    Ok((be.slop_pen(&c, nv)?, want))
                },
                &|b, w| bitwise_out(b, w).map(|_| "exact".to_string()),
            )?;
        }
    }
    Ok(())
}

fn pick_rows(cx: &mut Ctx, rng: &mut Rng) -> Result<(), ParityError> {
    let reference = cx.reference();
    let be = cx.be;
    let (trials, reps) = (cx.opts.trials, cx.opts.reps);
    for nv in [40_525usize, 248_320] {
        cx.shape(
            "pick",
            format!("nv={nv}"),
            (nv * 4) as f64,
            trials,
            reps,
            &mut |trial| {
                let mut l = rng.f32_vec_special(nv, 3.0);
                // A planted tie at the maximum: the lower index must win.
                let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let (a, b) = (rng.below(nv), rng.below(nv));
                l[a] = m;
                l[b] = m;
                if trial == 1 {
                    // Every value −0.0 but one +0.0 at the end: a tie across the vocabulary.
                    l.iter_mut().for_each(|v| *v = -0.0);
                    l[nv - 1] = 0.0;
                }
                let ids: Vec<i32> = (0..nv as i32).map(|i| i.wrapping_mul(7) + 3).collect();
                let want = if reference {
                    None
                } else {
                    let p = pick::pick_baseline(&l, &ids)?;
                    Some(vec![Out::I32(vec![
                        p.index as i32,
                        p.token,
                        p.value.to_bits() as i32,
                    ])])
                };
                Ok((be.pick(&l, &ids)?, want))
            },
            &|b, w| bitwise_out(b, w).map(|_| "exact".to_string()),
        )?;
    }
    Ok(())
}

/// Router logits: mostly normal, some specials, and an exact tie per row.
pub(crate) fn route_logits(r: &mut Rng, nt: usize, e: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..nt * e)
        .map(|_| {
            let v = r.f32_special(1.5);
            // Large specials would make one expert take all the mass; keep them moderate.
            if v.abs() > 60.0 {
                v.signum() * 30.0
            } else {
                v
            }
        })
        .collect();
    for t in 0..nt {
        let (a, b) = (r.below(e), r.below(e));
        l[t * e + a] = 4.0;
        l[t * e + b] = 4.0;
    }
    l
}

/// Route against the CPU: weights within 2e-6 absolute (they lie in [0, 1]); ids equal, or
/// a real tie: the two experts' CPU probabilities within 1e-6 relative.
fn route_cross(l: &[f32], e: usize, k: usize, ids: &[i32], w: &[f32]) -> Result<String, String> {
    let nt = l.len() / e;
    let (mut wi, mut ww) = (vec![0i32; nt * k], vec![0f32; nt * k]);
    route::route_baseline(l, e, k, &mut wi, &mut ww).map_err(|x| x.to_string())?;
    if bitwise_i32(ids, &wi).is_ok() && bitwise_f32(w, &ww).is_ok() {
        return Ok("exact".into());
    }
    let mut ties = 0;
    let mut p = vec![0f32; e];
    for t in 0..nt {
        route::softmax_row(&l[t * e..(t + 1) * e], &mut p);
        for r in 0..k {
            let (a, b) = (ids[t * k + r], wi[t * k + r]);
            if a == b {
                continue;
            }
            let pa = p.get(a as usize).copied().unwrap_or(f32::NAN) as f64;
            let pb = p[b as usize] as f64;
            if (pa - pb).abs() <= 1e-6 * pa.max(pb) {
                ties += 1;
            } else {
                return Err(format!(
                    "row {t} rank {r}: expert {a} (p={pa:e}) vs CPU {b} (p={pb:e})"
                ));
            }
        }
    }
    let tol = vec![2e-6f64; w.len()];
    let worst = within(w, &ww, &tol)?;
    Ok(if ties > 0 {
        format!(
            "ids exact but {ties} tie(s); weights within 2e-6 ({:.0}% of tol)",
            worst * 100.0
        )
    } else {
        format!(
            "ids exact; weights within 2e-6 ({:.0}% of tol)",
            worst * 100.0
        )
    })
}

fn route_rows(cx: &mut Ctx, rng: &mut Rng) -> Result<(), ParityError> {
    let nts: Vec<usize> = if cx.opts.quick {
        vec![1, 8]
    } else {
        (1..=8).collect()
    };
    let be = cx.be;
    let reference = cx.reference();
    let (trials, reps) = (cx.opts.trials, cx.opts.reps);
    for (e, k) in [(512usize, 10usize), (256, 8)] {
        for &nt in &nts {
            cx.shape(
                "route",
                format!("E={e}, top-{k}, nt={nt}"),
                (nt * e * 4 + nt * k * 8) as f64,
                trials,
                reps,
                &mut |_| {
                    let l = route_logits(rng, nt, e);
                    let c = be.route(&l, e, k)?;
                    // The agreement is judged from the logits themselves (route_cross).
                    let want = (!reference).then(|| vec![Out::F32(l)]);
                    Ok((c, want))
                },
                &|b, w| route_cross(out_f32(w, 0), e, k, out_i32(b, 0), out_f32(b, 1)),
            )?;
        }
    }
    Ok(())
}

/// GEMV activations: specials included, but |x| <= 2^20, because a Q8_0 activation block
/// stores its scale `amax/127` as f16 (largest 65504): a larger block overflows it to
/// infinity (in ggml as well) and the row's products become inf/NaN.
pub(crate) fn gemv_input(r: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| r.f32_special(1.0).clamp(-1_048_576.0, 1_048_576.0))
        .collect()
}

/// GEMV against the CPU reference: the f64 dot of the operands as the CPU dequantizes them
/// (`strata_quant::dequantize`), `|y − ref| ≤ 2e-5 · Σ|w_i·x_i|`. (The f32 scalar dot of
/// `strata_quant` is not the yardstick: for Q6_K it adds each code and its −32 offset in
/// different lanes, so a row dominated by one large activation cancels in f32 and can be off
/// by ~4e-5 of Σ|w·x|, while the exact value is the same for both.) Returns (reference, tol).
fn gemv_ref64(
    ty: GgmlType,
    w: &[u8],
    m: usize,
    k: usize,
    xq: &[u8],
    nt: usize,
) -> Result<(Vec<f32>, Vec<f64>), ParityError> {
    let fmt =
        ActFmt::for_weight(ty).ok_or_else(|| ParityError::Other(format!("{ty}: no activation")))?;
    let (wb, xb) = (ty.row_bytes(k).unwrap_or(0), fmt.row_bytes(k).unwrap_or(0));
    let qe = |e: strata_quant::QuantError| ParityError::Other(e.to_string());
    let mut xd = vec![0f32; nt * k];
    for t in 0..nt {
        strata_quant::dequantize(
            fmt.ggml_type(),
            &xq[t * xb..(t + 1) * xb],
            &mut xd[t * k..(t + 1) * k],
        )
        .map_err(qe)?;
    }
    let mut tol = vec![0f64; nt * m];
    let mut refv = vec![0f32; nt * m];
    let mut wd = vec![0f32; k];
    for r in 0..m {
        strata_quant::dequantize(ty, &w[r * wb..(r + 1) * wb], &mut wd).map_err(qe)?;
        for t in 0..nt {
            let (mut s, mut a) = (0f64, 0f64);
            for (&p, &q) in wd.iter().zip(&xd[t * k..(t + 1) * k]) {
                let v = p as f64 * q as f64;
                s += v;
                a += v.abs();
            }
            refv[t * m + r] = s as f32;
            tol[t * m + r] = 2e-5 * a + 1e-30;
        }
    }
    Ok((refv, tol))
}

fn gemv_row(
    cx: &mut Ctx,
    rng: &mut Rng,
    ty: GgmlType,
    m: usize,
    nt: usize,
    kernel: &str,
) -> Result<(), ParityError> {
    let k = 2560usize;
    let fmt =
        ActFmt::for_weight(ty).ok_or_else(|| ParityError::Other(format!("{ty}: no activation")))?;
    let (wb, xb) = (ty.row_bytes(k).unwrap_or(0), fmt.row_bytes(k).unwrap_or(0));
    let trials = if cx.opts.quick {
        1
    } else {
        cx.opts.trials.min(2)
    };
    let reps = if small_shapes(cx.be) {
        cx.opts.reps.min(if cx.opts.quick { 5 } else { 9 })
    } else {
        cx.opts.reps
    };
    let be = cx.be;
    let reference = cx.reference();
    let seed = cx.opts.seed ^ ((ty.id() as u64) << 20) ^ m as u64;
    cx.shape(
        kernel,
        format!("{ty} x {}, M={m}, K={k}, nt={nt}", fmt.name()),
        (m * wb + nt * xb + nt * m * 4) as f64,
        trials,
        reps,
        &mut |_| {
            let w = weight_blocks(ty, m * k / ty.block_size(), seed ^ rng.u64());
            let x = gemv_input(rng, nt * k);
            let mut xq = vec![0u8; nt * xb];
            quantize_row(fmt, &x, &mut xq);
            let want = if reference {
                None
            } else {
                let (r, tol) = gemv_ref64(ty, &w, m, k, &xq, nt)?;
                Some(vec![
                    Out::F32(r),
                    Out::F32(tol.iter().map(|&t| t as f32).collect()),
                ])
            };
            Ok((be.gemv(ty, &w, m, k, &xq, nt)?, want))
        },
        &|b, w| {
            let tol: Vec<f64> = out_f32(w, 1).iter().map(|&t| t as f64).collect();
            within(out_f32(b, 0), out_f32(w, 0), &tol)
                .map(|worst| format!("f64 ref within 2e-5 sum|wx| ({:.0}% of tol)", worst * 100.0))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_bound_is_two_to_minus_118() {
        assert_eq!(FLUSH_BOUND as f64, 2f64.powi(-118));
        // NVIDIA's flushed values seen on the H200: zero where the CPU had −1.73e-38.
        assert!(exact_or_flushed(&[-0.0, 1.0], &[-1.727_574_8e-38, 1.0]).is_ok());
        assert!(exact_or_flushed(&[0.0], &[1e-30]).is_err());
        assert_eq!(exact_or_flushed(&[1.0], &[1.0]).unwrap(), "exact");
        assert!(exact_or_flushed(&[1.0], &[1.000_001]).is_err());
    }
}
