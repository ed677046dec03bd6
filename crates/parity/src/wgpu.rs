//! The wgpu backend of the suites (`strata_wgpu::ops`): outputs poisoned (and in-place inputs
//! restored) before each checked run; timing is the host clock around one submission of
//! `LAUNCHES` dispatches in one compute pass, waited for, divided by `LAUNCHES` (so it
//! includes the per-dispatch cost but only 1/20 of the submit-and-wait cost). On a CPU adapter
//! (lavapipe) a sample is one dispatch: there the times only show that the kernels run, and
//! the suites must stay quick enough for CI.

use strata_engine::kernels::actq::ActFmt;
use strata_engine::kernels::slop::{SlopCase, STATE_LEN};
use strata_quant::GgmlType;
use strata_wgpu::{ops, Buf, Launch, Wgpu};

use crate::backend::{BoxCase, Case, KernelBackend, Out};
use crate::stats::median;
use crate::ParityError;

const LAUNCHES: usize = 20;

fn launches(g: &Wgpu) -> usize {
    if g.is_cpu() {
        1
    } else {
        LAUNCHES
    }
}

pub struct WgpuBackend {
    pub gpu: Wgpu,
    tab: Buf,
    dummy: Buf,
}

#[derive(Clone, Copy)]
enum Kind {
    Bytes,
    F32,
    I32,
}

/// Builds a variant's dispatches over the case's buffers.
type LaunchFn<'f> = dyn Fn(&str, &[Buf]) -> Result<Vec<Launch>, strata_wgpu::WgpuError> + 'f;

struct WgpuCase<'a> {
    g: &'a Wgpu,
    launches: [Vec<Launch>; 2],
    bufs: Vec<Buf>,
    /// Written before each checked run: poison for outputs, the original for in-place data.
    resets: Vec<(usize, Vec<u8>)>,
    outs: Vec<(usize, Kind)>,
}

impl Case for WgpuCase<'_> {
    fn outputs(&mut self, opt: bool) -> Result<Vec<Out>, ParityError> {
        for (i, bytes) in &self.resets {
            self.g.write::<u8>(&self.bufs[*i], bytes)?;
        }
        let l: Vec<&Launch> = self.launches[opt as usize].iter().collect();
        self.g.run(&l, 1)?;
        let mut v = Vec::new();
        for &(i, kind) in &self.outs {
            let b = &self.bufs[i];
            v.push(match kind {
                Kind::Bytes => Out::Bytes(self.g.download_bytes(b)?),
                Kind::F32 => Out::F32(self.g.download(b)?),
                Kind::I32 => Out::I32(self.g.download(b)?),
            });
        }
        Ok(v)
    }

    fn time_pair(&mut self, reps: usize) -> Result<(f64, f64), ParityError> {
        let a: Vec<&Launch> = self.launches[0].iter().collect();
        let b: Vec<&Launch> = self.launches[1].iter().collect();
        let n = launches(self.g);
        for _ in 0..2 {
            self.g.run(&a, n)?;
            self.g.run(&b, n)?;
        }
        let (mut ta, mut tb) = (Vec::new(), Vec::new());
        for i in 0..reps {
            if i % 2 == 0 {
                ta.push(self.g.run(&a, n)?);
                tb.push(self.g.run(&b, n)?);
            } else {
                tb.push(self.g.run(&b, n)?);
                ta.push(self.g.run(&a, n)?);
            }
        }
        let per = 1e6 / n as f64;
        Ok((median(&mut ta) * per, median(&mut tb) * per))
    }
}

fn poison_bytes(n: usize) -> Vec<u8> {
    vec![0xABu8; n.max(1).div_ceil(4) * 4]
}

fn poison_f32(n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![f32::from_bits(0x7fc0_dead); n.max(1)]).to_vec()
}

fn poison_i32(n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![-0x5555_5556i32; n.max(1)]).to_vec()
}

impl WgpuBackend {
    pub fn new() -> Result<WgpuBackend, ParityError> {
        let gpu = Wgpu::new()?;
        let tab = gpu.upload("grid tables", &strata_wgpu::shaders::grid_table())?;
        let dummy = gpu.upload("dummy", &[0u32])?;
        Ok(WgpuBackend { gpu, tab, dummy })
    }

    fn out(&self, what: &str, poison: Vec<u8>) -> Result<Buf, ParityError> {
        Ok(self.gpu.upload_bytes(what, &poison)?)
    }

    fn case(
        &self,
        launch: &LaunchFn<'_>,
        bufs: Vec<Buf>,
        resets: Vec<(usize, Vec<u8>)>,
        outs: Vec<(usize, Kind)>,
    ) -> Result<BoxCase<'_>, ParityError> {
        let base = launch("baseline", &bufs)?;
        let opt = launch("optimized", &bufs)?;
        Ok(Box::new(WgpuCase {
            g: &self.gpu,
            launches: [base, opt],
            bufs,
            resets,
            outs,
        }))
    }
}

impl KernelBackend for WgpuBackend {
    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn device(&self) -> String {
        self.gpu.describe()
    }

    fn notes(&self) -> Vec<String> {
        let n = launches(&self.gpu);
        let mut v = vec![format!(
            "each sample one submission of {n} dispatch(es) in a compute pass, host clock to completion, divided by {n}"
        )];
        if let Ok(c) = self.gpu.compiles.lock() {
            let total: f64 = c.iter().map(|(_, s)| s).sum();
            v.push(format!(
                "{} pipelines compiled in {:.2} s so far",
                c.len(),
                total
            ));
        }
        v
    }

    fn small(&self) -> bool {
        self.gpu.is_cpu()
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
        let bufs = vec![
            g.upload("x", x)?,
            g.upload("w", w)?,
            self.out("out", poison_bytes(nt * rb))?,
        ];
        self.case(
            &|v, b| ops::rms_xprep(g, v, &b[0], &b[1], &b[2], nt, n, eps, fmt),
            bufs,
            vec![(2, poison_bytes(nt * rb))],
            vec![(2, Kind::Bytes)],
        )
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
        let m = nt * s * n;
        let bufs = vec![
            g.upload("h", h)?,
            g.upload("e", e)?,
            g.upload("w", w)?,
            self.out("r", poison_f32(m))?,
            self.out("o", poison_f32(m))?,
        ];
        self.case(
            &|v, b| ops::combine_gnorm(g, v, &b[0], &b[1], &b[2], &b[3], &b[4], nt, n, s, eps),
            bufs,
            vec![(3, poison_f32(m)), (4, poison_f32(m))],
            vec![(3, Kind::F32), (4, Kind::F32)],
        )
    }

    fn xprep(&self, x: &[f32], n: usize, fmt: ActFmt) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let rows = x.len() / n.max(1);
        let rb = fmt.row_bytes(n).unwrap_or(0);
        let bufs = vec![g.upload("x", x)?, self.out("out", poison_bytes(rows * rb))?];
        self.case(
            &|v, b| ops::xprep(g, v, &b[0], &self.dummy, &b[1], rows, n, fmt),
            bufs,
            vec![(1, poison_bytes(rows * rb))],
            vec![(1, Kind::Bytes)],
        )
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
        let rows = table.len() / rb;
        let n = ids.len() * row_len;
        let bufs = vec![
            g.upload_bytes("table", table)?,
            g.upload("ids", ids)?,
            self.out("out", poison_f32(n))?,
        ];
        self.case(
            &|v, b| {
                ops::embed(
                    g,
                    v,
                    ty,
                    &b[0],
                    rows,
                    &b[1],
                    ids.len(),
                    &b[2],
                    row_len,
                    &self.tab,
                )
            },
            bufs,
            vec![(2, poison_f32(n))],
            vec![(2, Kind::F32)],
        )
    }

    fn slop_pen(&self, c: &SlopCase, nv: usize) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        c.tables.validate_state(&c.state)?;
        let t = ops::SlopDev::upload(g, &c.tables, nv, &c.banned)?;
        let bufs = vec![
            g.upload("logits", &c.logits)?,
            g.upload("state in", &c.state)?,
            self.out("state out", poison_i32(STATE_LEN))?,
        ];
        let (mode, prev) = (c.mode, c.prev);
        self.case(
            &|v, b| ops::slop_pen(g, v, &t, &b[0], nv, mode, prev, &b[1], &b[2]),
            bufs,
            vec![
                (0, bytemuck::cast_slice(&c.logits).to_vec()),
                (2, poison_i32(STATE_LEN)),
            ],
            vec![(0, Kind::F32), (2, Kind::I32)],
        )
    }

    fn pick(&self, logits: &[f32], draft_ids: &[i32]) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let nv = logits.len();
        let bufs = vec![
            g.upload("logits", logits)?,
            g.upload("draft ids", draft_ids)?,
            self.out("out", poison_i32(3))?,
            self.out("partials", vec![0u8; 8 * ops::pick_partials(nv)])?,
        ];
        self.case(
            &|v, b| ops::pick(g, v, &b[0], &b[1], nv, &b[2], &b[3]),
            bufs,
            vec![(2, poison_i32(3))],
            vec![(2, Kind::I32)],
        )
    }

    fn route(&self, logits: &[f32], e: usize, k: usize) -> Result<BoxCase<'_>, ParityError> {
        let g = &self.gpu;
        let nt = logits.len() / e.max(1);
        let bufs = vec![
            g.upload("logits", logits)?,
            self.out("ids", poison_i32(nt * k))?,
            self.out("weights", poison_f32(nt * k))?,
        ];
        self.case(
            &|v, b| ops::route(g, v, &b[0], &b[1], &b[2], nt, e, k),
            bufs,
            vec![(1, poison_i32(nt * k)), (2, poison_f32(nt * k))],
            vec![(1, Kind::I32), (2, Kind::F32)],
        )
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
        let bufs = vec![
            g.upload_bytes("w", w)?,
            g.upload_bytes("x", xq)?,
            self.out("y", poison_f32(nt * rows))?,
        ];
        self.case(
            &|v, b| ops::gemv(g, v, ty, &b[0], rows, k, &b[1], nt, &b[2], &self.tab),
            bufs,
            vec![(2, poison_f32(nt * rows))],
            vec![(2, Kind::F32)],
        )
    }
}
