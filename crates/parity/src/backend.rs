//! The kernel-backend interface the suites are written against: a backend turns host inputs
//! into a [`Case`] (inputs resident where the backend runs them, outputs allocated), and a
//! case runs either variant, returns its outputs (poisoned first on GPUs, so an unwritten
//! element shows) and times the pair interleaved the backend's way (host clock on the CPU,
//! graphs of launches under device events on CUDA, batched dispatches on wgpu).

use strata_engine::kernels::slop::SlopCase;
use strata_engine::kernels::ActFmt;
use strata_quant::GgmlType;

use crate::ParityError;

/// One output array of a kernel.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Bytes(Vec<u8>),
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A kernel on fixed inputs, ready to run either variant.
pub trait Case {
    /// Runs the baseline (`opt` false) or the optimized variant once and returns its outputs.
    fn outputs(&mut self, opt: bool) -> Result<Vec<Out>, ParityError>;
    /// Median per-launch times (µs) of baseline and optimized, `reps` interleaved samples.
    fn time_pair(&mut self, reps: usize) -> Result<(f64, f64), ParityError>;
}

pub type BoxCase<'a> = Box<dyn Case + 'a>;

/// A backend of the kernel catalogue.
pub trait KernelBackend {
    /// `cpu`, `cuda` or `wgpu`.
    fn name(&self) -> &'static str;
    fn device(&self) -> String;
    /// Lines for the report (timing method, bandwidth, compile times...).
    fn notes(&self) -> Vec<String>;
    /// Measured bandwidth (GB/s) and launch floor (µs); zeros where not measured.
    fn floors(&self) -> (f64, f64) {
        (0.0, 0.0)
    }
    /// The CPU reference itself: its rows are not compared against the CPU.
    fn is_reference(&self) -> bool {
        false
    }
    /// Runs at CPU speed (the CPU, lavapipe): the suites use the smaller shapes.
    fn small(&self) -> bool;

    fn rms_xprep(
        &self,
        x: &[f32],
        w: &[f32],
        n: usize,
        eps: f32,
        fmt: ActFmt,
    ) -> Result<BoxCase<'_>, ParityError>;
    #[allow(clippy::too_many_arguments)]
    fn combine_gnorm(
        &self,
        h: &[f32],
        e: &[f32],
        w: &[f32],
        n: usize,
        streams: usize,
        eps: f32,
    ) -> Result<BoxCase<'_>, ParityError>;
    fn xprep(&self, x: &[f32], n: usize, fmt: ActFmt) -> Result<BoxCase<'_>, ParityError>;
    /// `ids` may name rows past the table on GPU backends (they must give NaN rows).
    fn embed(
        &self,
        ty: GgmlType,
        table: &[u8],
        row_len: usize,
        ids: &[u32],
    ) -> Result<BoxCase<'_>, ParityError>;
    fn slop_pen(&self, c: &SlopCase, nv: usize) -> Result<BoxCase<'_>, ParityError>;
    fn pick(&self, logits: &[f32], draft_ids: &[i32]) -> Result<BoxCase<'_>, ParityError>;
    fn route(&self, logits: &[f32], n_exp: usize, k: usize) -> Result<BoxCase<'_>, ParityError>;
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        k: usize,
        xq: &[u8],
        nt: usize,
    ) -> Result<BoxCase<'_>, ParityError>;
}
