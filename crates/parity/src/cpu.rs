//! The CPU backend of the suites: `strata_engine::kernels` baseline against optimized, timed
//! on the host clock. It is the reference, so its rows carry no CPU comparison.

use strata_engine::kernels::actq::ActFmt;
use strata_engine::kernels::slop::SlopCase;
use strata_engine::kernels::{embed, gemv, norm, pick, route, slop, KernelError};
use strata_quant::GgmlType;

use crate::backend::{BoxCase, Case, KernelBackend, Out};
use crate::stats::paired;
use crate::ParityError;

/// Runs one variant (`true`: optimized) on the inputs into the output.
type RunFn<I, O> = Box<dyn Fn(&I, bool, &mut O) -> Result<(), KernelError>>;

/// Inputs, one output per variant, the run function and the output view.
struct CpuCase<I, O> {
    inp: I,
    out: [O; 2],
    init: fn(&I) -> O,
    run: RunFn<I, O>,
    view: fn(&O) -> Vec<Out>,
}

impl<I, O> Case for CpuCase<I, O> {
    fn outputs(&mut self, opt: bool) -> Result<Vec<Out>, ParityError> {
        let o = &mut self.out[opt as usize];
        *o = (self.init)(&self.inp);
        (self.run)(&self.inp, opt, o)?;
        Ok((self.view)(o))
    }

    fn time_pair(&mut self, reps: usize) -> Result<(f64, f64), ParityError> {
        let (inp, run) = (&self.inp, &self.run);
        let [a, b] = &mut self.out;
        Ok(paired(reps, &mut || run(inp, false, a), &mut || {
            run(inp, true, b)
        })?)
    }
}

fn case<'a, I: 'a, O: 'a>(
    inp: I,
    init: fn(&I) -> O,
    run: impl Fn(&I, bool, &mut O) -> Result<(), KernelError> + 'static,
    view: fn(&O) -> Vec<Out>,
) -> BoxCase<'a> {
    let out = [init(&inp), init(&inp)];
    Box::new(CpuCase {
        inp,
        out,
        init,
        run: Box::new(run),
        view,
    })
}

pub struct CpuBackend;

impl KernelBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> String {
        format!(
            "{} threads, ISA {}",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            strata_quant::simd::best().name()
        )
    }

    fn notes(&self) -> Vec<String> {
        vec!["host clock, one call a sample".into()]
    }

    fn is_reference(&self) -> bool {
        true
    }

    fn small(&self) -> bool {
        true
    }

    fn rms_xprep(
        &self,
        x: &[f32],
        w: &[f32],
        n: usize,
        eps: f32,
        fmt: ActFmt,
    ) -> Result<BoxCase<'_>, ParityError> {
        let nt = x.len() / n.max(1);
        let rb = fmt.row_bytes(n).unwrap_or(0);
        Ok(case(
            (x.to_vec(), w.to_vec(), nt * rb),
            |i| vec![0u8; i.2],
            move |(x, w, _), opt, out| {
                let f = if opt {
                    norm::rms_xprep_optimized
                } else {
                    norm::rms_xprep_baseline
                };
                f(x, w, n, eps, fmt, out)
            },
            |o| vec![Out::Bytes(o.clone())],
        ))
    }

    fn combine_gnorm(
        &self,
        h: &[f32],
        e: &[f32],
        w: &[f32],
        n: usize,
        s: usize,
        eps: f32,
    ) -> Result<BoxCase<'_>, ParityError> {
        Ok(case(
            (h.to_vec(), e.to_vec(), w.to_vec()),
            |i| (vec![0f32; i.0.len()], vec![0f32; i.0.len()]),
            move |(h, e, w), opt, (r, o)| {
                let f = if opt {
                    norm::combine_gnorm_optimized
                } else {
                    norm::combine_gnorm_baseline
                };
                f(h, e, w, n, s, eps, r, o)
            },
            |o| vec![Out::F32(o.0.clone()), Out::F32(o.1.clone())],
        ))
    }

    fn xprep(&self, x: &[f32], n: usize, fmt: ActFmt) -> Result<BoxCase<'_>, ParityError> {
        let rows = x.len() / n.max(1);
        let rb = fmt.row_bytes(n).unwrap_or(0);
        Ok(case(
            (x.to_vec(), rows * rb),
            |i| vec![0u8; i.1],
            move |(x, _), opt, out| {
                let f = if opt {
                    norm::xprep_optimized
                } else {
                    norm::xprep_baseline
                };
                f(x, n, fmt, out)
            },
            |o| vec![Out::Bytes(o.clone())],
        ))
    }

    fn embed(
        &self,
        ty: GgmlType,
        table: &[u8],
        row_len: usize,
        ids: &[u32],
    ) -> Result<BoxCase<'_>, ParityError> {
        Ok(case(
            (table.to_vec(), ids.to_vec(), ids.len() * row_len),
            |i| vec![0f32; i.2],
            move |(t, ids, _), opt, out| {
                let f = if opt {
                    embed::embed_optimized
                } else {
                    embed::embed_baseline
                };
                f(ty, t, row_len, ids, out)
            },
            |o| vec![Out::F32(o.clone())],
        ))
    }

    fn slop_pen(&self, c: &SlopCase, nv: usize) -> Result<BoxCase<'_>, ParityError> {
        // Validated once here; the timed calls only rebuild the view.
        c.tables.checked(nv)?;
        let c = SlopCase {
            tables: c.tables.clone(),
            mode: c.mode,
            prev: c.prev,
            banned: c.banned.clone(),
            state: c.state.clone(),
            logits: c.logits.clone(),
        };
        Ok(case(
            (c, nv),
            |i| (i.0.logits.clone(), vec![0i32; slop::STATE_LEN]),
            |(c, nv), opt, (l, st)| {
                let f = if opt {
                    slop::slop_pen_optimized
                } else {
                    slop::slop_pen_baseline
                };
                let ck = slop::CheckedSlop {
                    tables: &c.tables,
                    nv: *nv,
                };
                f(&ck, c.mode, c.prev, &c.banned, &c.state, st, l)
            },
            |o| vec![Out::F32(o.0.clone()), Out::I32(o.1.clone())],
        ))
    }

    fn pick(&self, logits: &[f32], draft_ids: &[i32]) -> Result<BoxCase<'_>, ParityError> {
        Ok(case(
            (logits.to_vec(), draft_ids.to_vec()),
            |_| pick::Picked {
                index: usize::MAX,
                token: -1,
                value: 0.0,
            },
            |(l, ids), opt, out| {
                let f = if opt {
                    pick::pick_optimized
                } else {
                    pick::pick_baseline
                };
                *out = f(l, ids)?;
                Ok(())
            },
            |p| {
                vec![Out::I32(vec![
                    p.index as i32,
                    p.token,
                    p.value.to_bits() as i32,
                ])]
            },
        ))
    }

    fn route(&self, logits: &[f32], n_exp: usize, k: usize) -> Result<BoxCase<'_>, ParityError> {
        let nt = logits.len() / n_exp.max(1);
        Ok(case(
            (logits.to_vec(), nt * k),
            |i| (vec![0i32; i.1], vec![0f32; i.1]),
            move |(l, _), opt, (ids, w)| {
                let f = if opt {
                    route::route_optimized
                } else {
                    route::route_baseline
                };
                f(l, n_exp, k, ids, w)
            },
            |o| vec![Out::I32(o.0.clone()), Out::F32(o.1.clone())],
        ))
    }

    fn gemv(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        k: usize,
        xq: &[u8],
        nt: usize,
    ) -> Result<BoxCase<'_>, ParityError> {
        Ok(case(
            (w.to_vec(), xq.to_vec(), nt * rows),
            |i| vec![0f32; i.2],
            move |(w, xq, _), opt, y| {
                let f = if opt {
                    gemv::gemv_optimized
                } else {
                    gemv::gemv_baseline
                };
                f(ty, w, rows, k, xq, y)
            },
            |o| vec![Out::F32(o.clone())],
        ))
    }
}
