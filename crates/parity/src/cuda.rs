//! The CUDA backend of the suites: each kernel's baseline and optimized CUDA variants
//! (`strata_cuda::ops`), outputs poisoned before each checked run, timed with device events
//! around graphs of `LAUNCHES` launches; `--cold` rotates 16 copies of weights and tables.

use cudarc::driver::CudaSlice;
use strata_cuda::{ops, CudaError, Gpu};
use strata_engine::kernels::actq::ActFmt;
use strata_engine::kernels::slop::{self, SlopCase};
use strata_quant::GgmlType;

use crate::backend::{BoxCase, Case, KernelBackend, Out};
use crate::stats::median;
use crate::{Options, ParityError};

/// Launches per captured graph (one timing sample runs the graph once).
const LAUNCHES: usize = 20;
/// Copies of the large inputs rotated in cold mode (more than the 60 MB L2 holds for every
/// shape we time).
const COLD_COPIES: usize = 16;

pub struct CudaBackend {
    gpu: Gpu,
    cold: bool,
    bw_gbs: f64,
    launch_us: f64,
}

/// What a case closure is asked to do.
enum Act {
    /// Launch the variant once, on input copy `i` (cold rotation).
    Launch(bool, usize),
    /// Poison the outputs, launch once, download.
    Read(bool),
}

type Body<'a> = Box<dyn FnMut(Act) -> Result<Vec<Out>, CudaError> + 'a>;

struct CudaCase<'a> {
    gpu: &'a Gpu,
    body: Body<'a>,
}

fn time_graphs(
    g: &Gpu,
    reps: usize,
    a: &mut dyn FnMut(usize) -> Result<(), CudaError>,
    b: &mut dyn FnMut(usize) -> Result<(), CudaError>,
) -> Result<(f64, f64), CudaError> {
    let ga = g.capture(&mut || (0..LAUNCHES).try_for_each(&mut *a))?;
    let gb = g.capture(&mut || (0..LAUNCHES).try_for_each(&mut *b))?;
    for _ in 0..3 {
        ga.launch()?;
        gb.launch()?;
    }
    g.check("timing warm-up")?;
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for i in 0..reps {
        if i % 2 == 0 {
            ta.push(g.time_us(&mut || ga.launch())?);
            tb.push(g.time_us(&mut || gb.launch())?);
        } else {
            tb.push(g.time_us(&mut || gb.launch())?);
            ta.push(g.time_us(&mut || ga.launch())?);
        }
    }
    g.check("timing")?;
    Ok((
        median(&mut ta) / LAUNCHES as f64,
        median(&mut tb) / LAUNCHES as f64,
    ))
}

impl Case for CudaCase<'_> {
    fn outputs(&mut self, opt: bool) -> Result<Vec<Out>, ParityError> {
        Ok((self.body)(Act::Read(opt))?)
    }

    fn time_pair(&mut self, reps: usize) -> Result<(f64, f64), ParityError> {
        let body = std::cell::RefCell::new(&mut self.body);
        let mut a = |i| (body.borrow_mut())(Act::Launch(false, i)).map(|_| ());
        let mut b = |i| (body.borrow_mut())(Act::Launch(true, i)).map(|_| ());
        Ok(time_graphs(self.gpu, reps, &mut a, &mut b)?)
    }
}

fn variant(opt: bool) -> &'static str {
    if opt {
        "optimized"
    } else {
        "baseline"
    }
}

fn poison_u8(gpu: &Gpu, n: usize) -> Result<CudaSlice<u8>, CudaError> {
    gpu.upload(&vec![0xABu8; n.max(1)])
}

fn poison_f32(gpu: &Gpu, n: usize) -> Result<CudaSlice<f32>, CudaError> {
    gpu.upload(&vec![f32::from_bits(0x7fc0_dead); n.max(1)])
}

fn poison_i32(gpu: &Gpu, n: usize) -> Result<CudaSlice<i32>, CudaError> {
    gpu.upload(&vec![-0x5555_5556i32; n.max(1)])
}

/// Copies of `src` for cold mode (none when warm): launch `i` reads copy `i % 16`.
fn copies(gpu: &Gpu, src: &CudaSlice<u8>, cold: bool) -> Result<Vec<CudaSlice<u8>>, CudaError> {
    let mut v = Vec::new();
    if cold {
        for _ in 1..COLD_COPIES {
            let mut d = gpu.zeros::<u8>(src.len())?;
            gpu.copy(src, &mut d)?;
            v.push(d);
        }
    }
    Ok(v)
}

fn pick_copy<'a>(
    base: &'a CudaSlice<u8>,
    extra: &'a [CudaSlice<u8>],
    i: usize,
) -> &'a CudaSlice<u8> {
    if extra.is_empty() || i.is_multiple_of(COLD_COPIES) {
        base
    } else {
        &extra[i % COLD_COPIES - 1]
    }
}

impl CudaBackend {
    pub fn new(opts: &Options) -> Result<CudaBackend, ParityError> {
        let gpu = Gpu::new(0)?;
        // Bandwidth: a 512 MiB device-to-device copy, bytes read plus written, best of 5.
        let n = 128 << 20;
        let src = gpu.zeros::<f32>(n)?;
        let mut dst = gpu.zeros::<f32>(n)?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            best = best.min(gpu.time_us(&mut || gpu.copy(&src, &mut dst))?);
        }
        drop((src, dst));
        let bw = 2.0 * (n * 4) as f64 / (best * 1e3);
        // Launch floor: an empty kernel in the same graph timing as the kernels.
        let (launch, _) = time_graphs(&gpu, opts.reps, &mut |_| ops::noop(&gpu), &mut |_| {
            ops::noop(&gpu)
        })?;
        Ok(CudaBackend {
            gpu,
            cold: opts.cold,
            bw_gbs: bw,
            launch_us: launch,
        })
    }

    fn case<'a>(&'a self, body: Body<'a>) -> BoxCase<'a> {
        Box::new(CudaCase {
            gpu: &self.gpu,
            body,
        })
    }
}

impl KernelBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> String {
        let g = &self.gpu;
        format!(
            "{} (sm_{}{}, {} SMs, L2 {} MiB)",
            g.name,
            g.arch.0,
            g.arch.1,
            g.sms,
            g.l2_bytes >> 20
        )
    }

    fn notes(&self) -> Vec<String> {
        let mut notes = vec![
            format!("each sample a CUDA graph of {LAUNCHES} launches under device events"),
            format!(
                "device-to-device copy bandwidth {:.0} GB/s; empty-kernel launch in a graph {:.3} us",
                self.bw_gbs, self.launch_us
            ),
            format!(
                "cold mode: {}",
                if self.cold {
                    "16 rotating copies of weights and tables"
                } else {
                    "off"
                }
            ),
        ];
        for l in &self.gpu.loads {
            notes.push(format!(
                "module {}: {} bytes, {} in {:.2} s",
                l.module,
                l.cubin_bytes,
                if l.from_cache {
                    "from the cache"
                } else {
                    "compiled by NVRTC"
                },
                l.seconds
            ));
        }
        notes
    }

    fn floors(&self) -> (f64, f64) {
        (self.bw_gbs, self.launch_us)
    }

    fn small(&self) -> bool {
        false
    }

    fn rms_xprep(
        &self,
        x: &[f32],
        w: &[f32],
        n: usize,
        eps: f32,
        fmt: ActFmt,
    ) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let nt = x.len() / n.max(1);
        let rb = fmt.row_bytes(n).unwrap_or(0);
        let (dx, dw) = (g.upload(x)?, g.upload(w)?);
        let mut o = poison_u8(g, nt * rb)?;
        Ok(self.case(Box::new(move |act| match act {
            Act::Launch(opt, _) => {
                ops::rms_xprep(g, variant(opt), &dx, &dw, &mut o, nt, n, eps, fmt)?;
                Ok(vec![])
            }
            Act::Read(opt) => {
                o = poison_u8(g, nt * rb)?;
                ops::rms_xprep(g, variant(opt), &dx, &dw, &mut o, nt, n, eps, fmt)?;
                Ok(vec![Out::Bytes(g.download(&o)?)])
            }
        })))
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
        let g = &self.gpu;
        let nt = e.len() / n.max(1);
        let (dh, de, dw) = (g.upload(h)?, g.upload(e)?, g.upload(w)?);
        let (mut r, mut o) = (poison_f32(g, nt * s * n)?, poison_f32(g, nt * s * n)?);
        Ok(self.case(Box::new(move |act| {
            let opt = match act {
                Act::Launch(opt, _) => opt,
                Act::Read(opt) => {
                    r = poison_f32(g, nt * s * n)?;
                    o = poison_f32(g, nt * s * n)?;
                    opt
                }
            };
            ops::combine_gnorm(
                g,
                variant(opt),
                &dh,
                &de,
                &dw,
                &mut r,
                &mut o,
                nt,
                n,
                s,
                eps,
            )?;
            if let Act::Read(_) = act {
                return Ok(vec![Out::F32(g.download(&r)?), Out::F32(g.download(&o)?)]);
            }
            Ok(vec![])
        })))
    }

    fn xprep(&self, x: &[f32], n: usize, fmt: ActFmt) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let rows = x.len() / n.max(1);
        let rb = fmt.row_bytes(n).unwrap_or(0);
        let dx = g.upload(x)?;
        let mut o = poison_u8(g, rows * rb)?;
        Ok(self.case(Box::new(move |act| match act {
            Act::Launch(opt, _) => {
                ops::xprep(g, variant(opt), &dx, &mut o, rows, n, fmt)?;
                Ok(vec![])
            }
            Act::Read(opt) => {
                o = poison_u8(g, rows * rb)?;
                ops::xprep(g, variant(opt), &dx, &mut o, rows, n, fmt)?;
                Ok(vec![Out::Bytes(g.download(&o)?)])
            }
        })))
    }

    fn embed(
        &self,
        ty: GgmlType,
        table: &[u8],
        row_len: usize,
        ids: &[u32],
    ) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let rb = ty.row_bytes(row_len).unwrap_or(1).max(1);
        let table_rows = table.len() / rb;
        let n_ids = ids.len();
        let dt = g.upload(table)?;
        let di = g.upload(ids)?;
        let extra = copies(g, &dt, self.cold)?;
        let mut o = poison_f32(g, n_ids * row_len)?;
        Ok(self.case(Box::new(move |act| match act {
            Act::Launch(opt, i) => {
                let t = pick_copy(&dt, &extra, i);
                ops::embed(
                    g,
                    variant(opt),
                    ty,
                    t,
                    table_rows,
                    &di,
                    n_ids,
                    &mut o,
                    row_len,
                )?;
                Ok(vec![])
            }
            Act::Read(opt) => {
                o = poison_f32(g, n_ids * row_len)?;
                ops::embed(
                    g,
                    variant(opt),
                    ty,
                    &dt,
                    table_rows,
                    &di,
                    n_ids,
                    &mut o,
                    row_len,
                )?;
                Ok(vec![Out::F32(g.download(&o)?)])
            }
        })))
    }

    fn slop_pen(&self, c: &SlopCase, nv: usize) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let t = ops::SlopDev::upload(g, &c.tables, nv)?;
        let banned = g.upload(if c.banned.is_empty() {
            &[0i32][..]
        } else {
            &c.banned
        })?;
        let nb = c.banned.len();
        let sin = g.upload(&c.state)?;
        let logits = c.logits.clone();
        let mut l = g.upload(&logits)?;
        let mut so = poison_i32(g, slop::STATE_LEN)?;
        let (mode, prev) = (c.mode, c.prev);
        Ok(self.case(Box::new(move |act| {
            let opt = match act {
                Act::Launch(opt, _) => opt,
                Act::Read(opt) => {
                    // In place: each checked run starts from the case's logits.
                    l = g.upload(&logits)?;
                    so = poison_i32(g, slop::STATE_LEN)?;
                    opt
                }
            };
            ops::slop_pen(
                g,
                variant(opt),
                &t,
                &mut l,
                nv,
                mode,
                prev,
                &banned,
                nb,
                &sin,
                &mut so,
            )?;
            if let Act::Read(_) = act {
                return Ok(vec![Out::F32(g.download(&l)?), Out::I32(g.download(&so)?)]);
            }
            Ok(vec![])
        })))
    }

    fn pick(&self, logits: &[f32], draft_ids: &[i32]) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let nv = logits.len();
        let (dl, di) = (g.upload(logits)?, g.upload(draft_ids)?);
        let mut o = poison_i32(g, 3)?;
        let mut scratch = ops::PickScratch::new(g, nv)?;
        Ok(self.case(Box::new(move |act| match act {
            Act::Launch(opt, _) => {
                ops::pick(g, variant(opt), &dl, &di, nv, &mut o, &mut scratch)?;
                Ok(vec![])
            }
            Act::Read(opt) => {
                o = poison_i32(g, 3)?;
                ops::pick(g, variant(opt), &dl, &di, nv, &mut o, &mut scratch)?;
                Ok(vec![Out::I32(g.download(&o)?)])
            }
        })))
    }

    fn route(&self, logits: &[f32], e: usize, k: usize) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let nt = logits.len() / e.max(1);
        let dl = g.upload(logits)?;
        let (mut ids, mut w) = (poison_i32(g, nt * k)?, poison_f32(g, nt * k)?);
        Ok(self.case(Box::new(move |act| {
            let opt = match act {
                Act::Launch(opt, _) => opt,
                Act::Read(opt) => {
                    ids = poison_i32(g, nt * k)?;
                    w = poison_f32(g, nt * k)?;
                    opt
                }
            };
            ops::route(g, variant(opt), &dl, &mut ids, &mut w, nt, e, k)?;
            if let Act::Read(_) = act {
                return Ok(vec![Out::I32(g.download(&ids)?), Out::F32(g.download(&w)?)]);
            }
            Ok(vec![])
        })))
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
        let g = &self.gpu;
        let (dw, dx) = (g.upload(w)?, g.upload(xq)?);
        let extra = copies(g, &dw, self.cold)?;
        let mut y = poison_f32(g, nt * rows)?;
        Ok(self.case(Box::new(move |act| match act {
            Act::Launch(opt, i) => {
                let wc = pick_copy(&dw, &extra, i);
                ops::gemv(g, variant(opt), ty, wc, rows, k, &dx, nt, &mut y)?;
                Ok(vec![])
            }
            Act::Read(opt) => {
                y = poison_f32(g, nt * rows)?;
                ops::gemv(g, variant(opt), ty, &dw, rows, k, &dx, nt, &mut y)?;
                Ok(vec![Out::F32(g.download(&y)?)])
            }
        })))
    }
}
