//! The CPU suites: `strata_engine::kernels` baseline against optimized, bit for bit, timed on
//! the host clock.

use strata_engine::kernels::actq::ActFmt;
use strata_engine::kernels::testdata::{weight_blocks, Rng};
use strata_engine::kernels::{embed, gemv, norm, pick, route, slop, KernelError};
use strata_quant::GgmlType;

use crate::check::{bitwise_bytes, bitwise_f32, bitwise_i32};
use crate::stats::paired;
use crate::{Options, ParityError, Report, Row, Suite};

pub(crate) const EPS: f32 = 1e-6;

/// One (baseline, optimized) pair on fresh inputs: parity over `opts.trials` inputs, then
/// paired timing on the last one.
#[allow(clippy::too_many_arguments)]
fn pair<I, O>(
    opts: &Options,
    rng: &mut Rng,
    kernel: &str,
    shape: String,
    bytes: f64,
    reps: usize,
    gen: &mut dyn FnMut(&mut Rng) -> Result<I, KernelError>,
    init: &dyn Fn(&I) -> O,
    run: &dyn Fn(&I, bool, &mut O) -> Result<(), KernelError>,
    cmp: &dyn Fn(&O, &O) -> Result<(), String>,
) -> Result<Row, ParityError> {
    let mut verdict = Ok(());
    let mut last = None;
    for _ in 0..opts.trials.max(1) {
        let inp = gen(rng)?;
        let mut a = init(&inp);
        let mut b = init(&inp);
        run(&inp, false, &mut a)?;
        run(&inp, true, &mut b)?;
        if verdict.is_ok() {
            verdict = cmp(&a, &b);
        }
        last = Some((inp, a, b));
    }
    let (inp, mut a, mut b) = last.ok_or_else(|| ParityError::Other("no trial ran".into()))?;
    let (ta, tb) = paired(reps, &mut || run(&inp, false, &mut a), &mut || {
        run(&inp, true, &mut b)
    })?;
    let failed = verdict.is_err();
    Ok(Row {
        kernel: kernel.into(),
        shape,
        base_us: ta,
        cand_us: tb,
        parity: match verdict {
            Ok(()) => "BITWISE PASS".into(),
            Err(e) => format!("FAIL: {e}"),
        },
        vs_cpu: "-".into(),
        bytes,
        floor_us: 0.0,
        failed,
    })
}

fn pick_list<T: Copy>(quick: bool, q: &[T], full: &[T]) -> Vec<T> {
    if quick {
        q.to_vec()
    } else {
        full.to_vec()
    }
}

pub fn run(suite: Suite, opts: &Options) -> Result<Report, ParityError> {
    let mut rng = Rng::new(opts.seed ^ suite.name().len() as u64);
    let mut rows = Vec::new();
    match suite {
        Suite::MtpAb => {
            norm_rows(opts, &mut rng, &mut rows)?;
            embed_rows(opts, &mut rng, &mut rows)?;
            slop_rows(opts, &mut rng, &mut rows)?;
            pick_rows(opts, &mut rng, &mut rows)?;
        }
        Suite::Sample => {
            slop_rows(opts, &mut rng, &mut rows)?;
            pick_rows(opts, &mut rng, &mut rows)?;
        }
        Suite::RouterAb => {
            route_rows(opts, &mut rng, &mut rows)?;
            if !opts.quick {
                for ty in [GgmlType::BF16, GgmlType::Q8_0] {
                    for e in [512usize, 256] {
                        for nt in [1usize, 8] {
                            rows.push(gemv_row(opts, &mut rng, ty, e, nt, "route_gate")?);
                        }
                    }
                }
            }
        }
        Suite::Gemv => {
            let nts = pick_list(opts.quick, &[1usize, 8], &[1, 2, 4, 8]);
            let m = if opts.quick { 128 } else { 2560 };
            for ty in gemv::GEMV_FORMATS {
                for &nt in &nts {
                    rows.push(gemv_row(opts, &mut rng, ty, m, nt, "gemv")?);
                }
            }
        }
    }
    Ok(Report {
        suite: suite.name().into(),
        backend: "cpu".into(),
        device: format!(
            "{} threads, ISA {}",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            strata_quant::simd::best().name()
        ),
        notes: vec![format!(
            "{} fresh-input trials per shape; medians of {} paired, interleaved runs",
            opts.trials, opts.reps
        )],
        rows,
        ..Default::default()
    })
}

fn norm_rows(opts: &Options, rng: &mut Rng, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    let nts = pick_list(opts.quick, &[1usize, 8], &[1, 4, 8]);
    let fmts = pick_list(
        opts.quick,
        &[ActFmt::Q8_0],
        &[ActFmt::Q8_0, ActFmt::Q8K, ActFmt::Bf16, ActFmt::F32],
    );
    for n in [2560usize, 10240] {
        for &nt in &nts {
            for &fmt in &fmts {
                let rb = fmt.row_bytes(n).unwrap_or(0);
                rows.push(pair(
                    opts,
                    rng,
                    "rms_xprep",
                    format!("n={n}, nt={nt}, {}", fmt.name()),
                    (nt * n * 4 + n * 4 + nt * rb) as f64,
                    opts.reps,
                    &mut |r| Ok((r.f32_vec_special(nt * n, 1.0), r.f32_vec(n, 1.0))),
                    &|_| vec![0u8; nt * rb],
                    &|(x, w), opt, out| {
                        let f = if opt {
                            norm::rms_xprep_optimized
                        } else {
                            norm::rms_xprep_baseline
                        };
                        f(x, w, n, EPS, fmt, out)
                    },
                    &|a, b| bitwise_bytes(a, b),
                )?);
            }
        }
    }
    for &nt in &nts {
        let (n, s) = (2560usize, 4usize);
        rows.push(pair(
            opts,
            rng,
            "combine_gnorm",
            format!("hc={s}, nt={nt}"),
            (nt * s * n * 4 * 3 + nt * n * 4 + s * n * 4) as f64,
            opts.reps,
            &mut |r| {
                Ok((
                    r.f32_vec_special(nt * s * n, 1.0),
                    r.f32_vec_special(nt * n, 1.0),
                    r.f32_vec(s * n, 1.0),
                ))
            },
            &|_| (vec![0f32; nt * s * n], vec![0f32; nt * s * n]),
            &|(h, e, w), opt, (ro, oo)| {
                let f = if opt {
                    norm::combine_gnorm_optimized
                } else {
                    norm::combine_gnorm_baseline
                };
                f(h, e, w, n, s, EPS, ro, oo)
            },
            &|a, b| bitwise_f32(&a.0, &b.0).and_then(|_| bitwise_f32(&a.1, &b.1)),
        )?);
    }
    let xrows = pick_list(opts.quick, &[8usize], &[1, 4, 8]);
    let xfmts = pick_list(
        opts.quick,
        &[ActFmt::Q8_0, ActFmt::Q8K],
        &[ActFmt::Q8_0, ActFmt::Q8K, ActFmt::Bf16],
    );
    for &nr in &xrows {
        for &fmt in &xfmts {
            let n = 2560;
            let rb = fmt.row_bytes(n).unwrap_or(0);
            rows.push(pair(
                opts,
                rng,
                "xprep",
                format!("rows={nr}, n={n}, {}", fmt.name()),
                (nr * n * 4 + nr * rb) as f64,
                opts.reps,
                &mut |r| Ok(r.f32_vec_special(nr * n, 1.0)),
                &|_| vec![0u8; nr * rb],
                &|x, opt, out| {
                    let f = if opt {
                        norm::xprep_optimized
                    } else {
                        norm::xprep_baseline
                    };
                    f(x, n, fmt, out)
                },
                &|a, b| bitwise_bytes(a, b),
            )?);
        }
    }
    Ok(())
}

fn embed_rows(opts: &Options, rng: &mut Rng, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    let n = 2560usize;
    let table_rows = if opts.quick { 64 } else { 1024 };
    for (k, ty) in embed::REPORT_FORMATS.into_iter().enumerate() {
        let rb = ty.row_bytes(n).unwrap_or(0);
        let seed = opts.seed.wrapping_add(1000 + k as u64);
        rows.push(pair(
            opts,
            rng,
            "embed",
            format!("format={} ({ty})", ty.id()),
            (rb + n * 4) as f64,
            opts.reps,
            &mut |r| {
                let t = weight_blocks(ty, table_rows * n / ty.block_size(), seed ^ r.u64());
                let id = r.below(table_rows) as u32;
                Ok((t, vec![id]))
            },
            &|_| vec![0f32; n],
            &|(t, ids), opt, out| {
                let f = if opt {
                    embed::embed_optimized
                } else {
                    embed::embed_baseline
                };
                f(ty, t, n, ids, out)
            },
            &|a, b| bitwise_f32(a, b),
        )?);
    }
    Ok(())
}

fn slop_rows(opts: &Options, rng: &mut Rng, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    let vocab = 248_320usize;
    for nv in [40_525usize, 248_320] {
        for mode in 0..3u32 {
            rows.push(pair(
                opts,
                rng,
                "slop_pen",
                format!("nv={nv}, mode={mode}"),
                0.0,
                opts.reps,
                &mut |r| {
                    let c = slop::SlopCase::random(r, vocab, nv, mode);
                    // Validated once here; the timed calls only rebuild the view.
                    c.tables.checked(nv)?;
                    Ok(c)
                },
                &|c| (c.logits.clone(), vec![0i32; slop::STATE_LEN]),
                &|c, opt, (l, st)| {
                    let f = if opt {
                        slop::slop_pen_optimized
                    } else {
                        slop::slop_pen_baseline
                    };
                    let ck = slop::CheckedSlop {
                        tables: &c.tables,
                        nv,
                    };
                    f(&ck, c.mode, c.prev, &c.banned, &c.state, st, l)
                },
                &|a, b| bitwise_f32(&a.0, &b.0).and_then(|_| bitwise_i32(&a.1, &b.1)),
            )?);
        }
    }
    Ok(())
}

fn pick_rows(opts: &Options, rng: &mut Rng, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    for nv in [40_525usize, 248_320] {
        rows.push(pair(
            opts,
            rng,
            "pick",
            format!("nv={nv}"),
            (nv * 4) as f64,
            opts.reps,
            &mut |r| {
                let mut l = r.f32_vec_special(nv, 3.0);
                // A planted tie at the maximum: the lower index must win.
                let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let (a, b) = (r.below(nv), r.below(nv));
                l[a] = m;
                l[b] = m;
                let ids: Vec<i32> = (0..nv as i32).map(|i| i.wrapping_mul(7) + 3).collect();
                Ok((l, ids))
            },
            &|_| pick::Picked {
                index: usize::MAX,
                token: -1,
                value: 0.0,
            },
            &|(l, ids), opt, out| {
                let f = if opt {
                    pick::pick_optimized
                } else {
                    pick::pick_baseline
                };
                *out = f(l, ids)?;
                Ok(())
            },
            &|a, b| {
                if a.index == b.index
                    && a.token == b.token
                    && a.value.to_bits() == b.value.to_bits()
                {
                    Ok(())
                } else {
                    Err(format!("picked {a:?} vs {b:?}"))
                }
            },
        )?);
    }
    Ok(())
}

fn route_rows(opts: &Options, rng: &mut Rng, rows: &mut Vec<Row>) -> Result<(), ParityError> {
    let nts: Vec<usize> = if opts.quick {
        vec![1, 8]
    } else {
        (1..=8).collect()
    };
    for (e, k) in [(512usize, 10usize), (256, 8)] {
        for &nt in &nts {
            rows.push(pair(
                opts,
                rng,
                "route",
                format!("E={e}, top-{k}, nt={nt}"),
                (nt * e * 4 + nt * k * 8) as f64,
                opts.reps,
                &mut |r| Ok(route_logits(r, nt, e)),
                &|_| (vec![0i32; nt * k], vec![0f32; nt * k]),
                &|l, opt, (ids, w)| {
                    let f = if opt {
                        route::route_optimized
                    } else {
                        route::route_baseline
                    };
                    f(l, e, k, ids, w)
                },
                &|a, b| bitwise_i32(&a.0, &b.0).and_then(|_| bitwise_f32(&a.1, &b.1)),
            )?);
        }
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

/// GEMV activations: specials included, but |x| <= 2^20, because a Q8_0 activation block
/// stores its scale `amax/127` as f16 (largest 65504): a larger block overflows it to
/// infinity (in ggml as well) and the row's products become inf/NaN.
pub(crate) fn gemv_input(r: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| r.f32_special(1.0).clamp(-1_048_576.0, 1_048_576.0))
        .collect()
}

fn gemv_row(
    opts: &Options,
    rng: &mut Rng,
    ty: GgmlType,
    m: usize,
    nt: usize,
    kernel: &str,
) -> Result<Row, ParityError> {
    let k = 2560usize;
    let fmt = ActFmt::for_weight(ty)
        .ok_or_else(|| ParityError::Other(format!("{ty} has no paired activation")))?;
    let (wb, xb) = (ty.row_bytes(k).unwrap_or(0), fmt.row_bytes(k).unwrap_or(0));
    let reps = if opts.quick {
        opts.reps.min(5)
    } else {
        opts.reps.min(9)
    };
    let seed = opts.seed ^ ((ty.id() as u64) << 20) ^ m as u64;
    pair(
        opts,
        rng,
        kernel,
        format!("{ty} x {}, M={m}, K={k}, nt={nt}", fmt.name()),
        (m * wb + nt * xb + nt * m * 4) as f64,
        reps,
        &mut |r| {
            let w = weight_blocks(ty, m * k / ty.block_size(), seed ^ r.u64());
            let x = gemv_input(r, nt * k);
            let mut xq = vec![0u8; nt * xb];
            strata_engine::kernels::actq::quantize_row(fmt, &x, &mut xq);
            Ok((w, xq))
        },
        &|_| vec![0f32; nt * m],
        &|(w, xq), opt, y| {
            let f = if opt {
                gemv::gemv_optimized
            } else {
                gemv::gemv_baseline
            };
            f(ty, w, m, k, xq, y)
        },
        &|a, b| bitwise_f32(a, b),
    )
}
