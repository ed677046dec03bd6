//! [`WgpuBackend`]: the core [`Backend`] of `strata_engine` on wgpu, so `qwen2::Model` and
//! `qwen4exp::Model` run unchanged on Vulkan, Metal or lavapipe. This module owns the device
//! buffers of the boundary (activations, ids, weights in their file formats and stores, both
//! split by rows under the binding limit, routes), the recording of a step's dispatches into one
//! command stream, and the core operations; qwen4exp's family operations are in
//! [`crate::qwen4exp`].
//!
//! **Steps.** Operations never submit: each appends its dispatches to the pending list, and the
//! list is submitted as one compute pass when a step ends (or when a download needs the
//! results; on GPUs also every 256 dispatches, so the device starts while the host records), so
//! nothing is read back inside a step. A re-encoding backend, not a capturing one (wgpu
//! consumes a command buffer on submit), but temporaries come from a pool by size and bind
//! groups of pooled and persistent buffers are cached, so a step with the same key as an
//! earlier one mostly reuses both ([`WgpuBackend::temp`] says why reuse is safe).
//!
//! **Numerics** (DESIGN.md §3). Against the CPU backend: copies, stores, adds, biases, RMS norm,
//! RoPE (cos/sin from the CPU's own f64 formula, tabled on the host), the activation images,
//! pooling and the QSA scores and rules are bit-exact; sigmoid/silu/softplus/softmax differ by
//! the driver's `exp`; products by their summation order (the 256-lane tree of `gemv.wgsl`
//! instead of the CPU's block-integer dot). Every output depends only on its own row, so a
//! prefill gives the same bits as token-by-token decode (tests/model.rs checks it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use strata_engine::backend::{
    AttnDims, Backend, DeviceBuf, DeviceIds, DeviceWeight, ExpertWeights, KvType, StepKey, Usage,
};
use strata_engine::kernels::ActFmt;
use strata_engine::{EngineError, Result};
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::GgmlType;

use crate::device::{Buf, Launch, Wgpu};
use crate::shaders;
use crate::WgpuError;

/// Largest element count of a weight that also gets an f32 image (norm weights, biases, conv
/// kernels, per-head constants: the tensors read element-wise).
const VALUES_MAX: u64 = 1 << 22;

/// Largest head (attention, GDN) the kernels' private arrays hold.
const MAX_HEAD: usize = 256;

/// Loop iterations an attention kernel may run in one dispatch.
///
/// Lavapipe (llvmpipe's gallivm, Mesa 22.3.6 here) gives every shader one loop limiter of
/// `LP_MAX_TGSI_LOOP_ITERATIONS` = 65,535 back edges, shared by all of its loops, nested ones
/// included, and counted per SIMD vector of invocations (gallivm's
/// `lp_exec_mask_function_init` and `lp_exec_endloop`): once it is spent, every loop ends
/// after its current iteration, silently (a probe on lavapipe here: a loop of 66,000
/// iterations ran 65,535, and a loop of 71 after it ran once). The serial kernel
/// `model::attend` runs about 5.2·d + 17 iterations a visible token (measured: at head dim 16
/// the last right count is 674 tokens, at 64 193 tokens, at 256 49), so past that its last
/// loop, the one storing the head's values, stores only value 0 and leaves the rest 0 (issue
/// #16, docs/WGPU.md). So the host splits its token lists into ranges of at most
/// [`attend_tokens`] tokens a dispatch, on every adapter (the same bits: the phases' sums in
/// the same order; only more dispatches). `model::attend_wg` runs about 3·d + 800 a tile of
/// 256 tokens (measured: wrong from 10,750 tokens at head dim 256, from 17,089 at 64), so on a
/// CPU adapter a list longer than [`attend_wg_tokens`] goes to the split serial kernel, which
/// gives its bits.
pub(crate) const ATTEND_LOOP_BUDGET: usize = 32_768;

/// Tokens a serial attention dispatch may visit at head dim `d` within
/// [`ATTEND_LOOP_BUDGET`]: at most 6·d + 64 loop iterations a token (the scores, the weighted
/// values, the division's steps), 4·d + 64 more for the query, the carried values and the
/// output.
fn attend_tokens(d: usize) -> usize {
    (ATTEND_LOOP_BUDGET.saturating_sub(4 * d + 64) / (6 * d + 64)).max(1)
}

/// Rows one `model::gdn` / `gdn_wg` dispatch (`nt` invocations a head) may run on an adapter
/// with a loop limiter, within [`ATTEND_LOOP_BUDGET`]: a row costs an invocation (the vector
/// holding invocation 0) at most ⌈dv/nt⌉·(2·dk + 3) iterations for its state columns,
/// dk + dv for the norms' sums, ⌈dk/nt⌉ for the normed q and k, and 512 for the divisions',
/// roots' and subnormal loops; 512 more once for the query scale.
pub(crate) fn gdn_rows(dk: usize, dv: usize, nt: usize) -> usize {
    let per_row = dv.div_ceil(nt) * (2 * dk + 3) + dk + dv + dk.div_ceil(nt) + 512;
    (ATTEND_LOOP_BUDGET.saturating_sub(512) / per_row).max(1)
}

/// Blocks one serial `model::qsa_select` dispatch may score on an adapter with a loop limiter
/// (within [`ATTEND_LOOP_BUDGET`]): a block costs its row's invocation heads·(d + 1) + 1
/// iterations.
pub(crate) fn qsa_blocks(heads: usize, d: usize) -> usize {
    (ATTEND_LOOP_BUDGET.saturating_sub(512) / (heads * (d + 1) + 1)).max(1)
}

/// Tokens `model::attend_wg` may visit at head dim `d` on an adapter with a loop limiter:
/// whole tiles of 256 at 4·d + 1,024 iterations each within [`ATTEND_LOOP_BUDGET`], 1,024
/// for the rest.
fn attend_wg_tokens(d: usize) -> usize {
    256 * (ATTEND_LOOP_BUDGET.saturating_sub(1024) / (4 * d + 1024)).max(1)
}

pub(crate) fn dev(e: WgpuError) -> EngineError {
    EngineError::Input(format!("wgpu backend: {e}"))
}

pub(crate) fn shape(op: &'static str, what: impl Into<String>) -> EngineError {
    EngineError::Shape {
        op,
        what: what.into(),
    }
}

pub(crate) fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{v} exceeds the kernels' 32-bit indices")))
}

/// A 2-D f32 activation buffer: the first `rows·cols` values of `b`; or a store split by rows
/// under the binding limit (`parts`; `b` is then a placeholder that no kernel may bind).
#[derive(Clone)]
pub struct WBuf {
    pub(crate) b: Arc<Buf>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) parts: Option<Arc<Vec<Part>>>,
}

impl WBuf {
    /// The row parts (buffer, first row, rows); an unsplit buffer is one part.
    pub(crate) fn row_parts(&self) -> Vec<(&Buf, usize, usize)> {
        match &self.parts {
            Some(p) => p.iter().map(|p| (&p.b, p.row0, p.rows)).collect(),
            None => vec![(&*self.b, 0, self.rows)],
        }
    }

    /// How many storage buffers hold the rows.
    pub fn parts(&self) -> usize {
        self.parts.as_ref().map_or(1, |p| p.len())
    }
}

impl DeviceBuf for WBuf {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// u32 ids on the device: entries `off..off + len` of `b` (views share the buffer).
#[derive(Clone)]
pub struct WIds {
    pub(crate) b: Arc<Buf>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

impl DeviceIds for WIds {
    fn len(&self) -> usize {
        self.len
    }
}

/// Rows `row0..row0 + rows` of a weight, in one storage buffer.
pub(crate) struct Part {
    pub(crate) b: Buf,
    pub(crate) row0: usize,
    pub(crate) rows: usize,
}

/// A weight in its file format, split by rows so no part exceeds the binding limit, plus an
/// f32 image when it is small.
pub struct WWeight {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    pub(crate) row_len: usize,
    pub(crate) row_bytes: usize,
    pub(crate) parts: Vec<Part>,
    pub(crate) values: Option<(Buf, usize)>,
}

impl WWeight {
    /// Rows of one matrix (`dims[1]`; 1 for a vector).
    pub(crate) fn n_rows2(&self) -> usize {
        self.dims.get(1).copied().unwrap_or(1) as usize
    }

    /// The f32 image and its length (tensors read element-wise).
    pub(crate) fn values(&self) -> Result<(&Buf, usize)> {
        self.values.as_ref().map(|(b, n)| (b, *n)).ok_or_else(|| {
            shape(
                "weight values",
                format!("{} is too large for an f32 image", self.name),
            )
        })
    }

    /// How many storage buffers hold the weight's bytes.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }
}

impl DeviceWeight for WWeight {
    fn name(&self) -> &str {
        &self.name
    }
    fn ty(&self) -> GgmlType {
        self.ty
    }
    fn dims(&self) -> &[u64] {
        &self.dims
    }
}

/// Router decisions on the device: per row `k` expert ids (i32) and weights.
pub struct WRoutes {
    pub(crate) ids: Arc<Buf>,
    pub(crate) wts: Arc<Buf>,
    pub(crate) rows: usize,
    pub(crate) k: usize,
}

/// One kernel's line of a profile: launches and (timed profiles) seconds.
#[derive(Debug, Clone)]
pub struct KernelStat {
    pub name: String,
    pub launches: u64,
    pub secs: f64,
}

struct Profile {
    timed: bool,
    by: HashMap<String, (u64, f64)>,
}

/// Counters of the command streams (for the tests and PERF notes).
#[derive(Default, Debug, Clone, Copy)]
pub struct Counters {
    pub dispatches: u64,
    pub submits: u64,
}

/// RoPE cos/sin tables by (rotated dims, theta bits): (table, positions it covers).
type RopeTables = HashMap<(usize, u32), (Arc<Buf>, usize)>;

/// The whole-model backend on one wgpu adapter.
pub struct WgpuBackend {
    pub(crate) g: Arc<Wgpu>,
    tab: Buf,
    dummies: Vec<Buf>,
    pending: Mutex<Vec<Launch>>,
    /// RoPE cos/sin tables by (rotated dims, theta bits): (table, positions it covers).
    rope: Mutex<RopeTables>,
    /// Largest store capacity asked for (the RoPE tables cover that many positions).
    max_cap: AtomicUsize,
    dispatches: AtomicU64,
    submits: AtomicU64,
    split: AtomicUsize,
    /// The product kernel ([`ProductKernel`]): `mq::mm1` on CPU adapters, `Auto` (`mq::mmb`
    /// for large products, `mq::mm` for small ones) on GPUs: the same bits;
    /// `STRATA_WGPU_MM=lanes|wg|rows|blocks|auto` forces one.
    products: ProductKernel,
    /// The first failed submit of a step, until a download reports it.
    failed: Mutex<Option<String>>,
    /// Largest part of a weight (the binding limit, or less: a test forces small parts).
    weight_limit: u64,
    /// Largest part of a store (likewise).
    store_limit: u64,
    /// Fused variants on (element-wise ops folded into product epilogues); off, the baseline
    /// dispatches (`STRATA_WGPU_FUSE=0`): the same bits either way (tests/model.rs).
    pub(crate) fuse: bool,
    /// The products' and gathers' f16 scales by the hardware's conversion (mq.wgsl
    /// SPEC_HWF16) instead of the integer decoder: the same bits (a test checks every format
    /// both ways); on with `fuse`, off with `STRATA_WGPU_HWF16=0`.
    hw_f16: bool,
    split_stores: AtomicUsize,
    /// Reused temporaries ([`WgpuBackend::temp`]), or `None`: every temporary fresh.
    pool: Option<Mutex<Pool>>,
    /// Dispatches after which a step's pending list is submitted while the step goes on
    /// recording (0: one submit at the end of the step). On GPUs 256, so the device runs the
    /// first dispatches while the host records the rest (a decode step is ~2,500 dispatches
    /// of a few µs of host time each); on CPU adapters 0 (the driver shares the host's cores).
    /// `STRATA_WGPU_CHUNK=N` forces it. Nothing is read back inside a step either way.
    chunk: usize,
    /// The core RMS norm's kernel: the lane order by a workgroup on GPUs, by one invocation
    /// on CPU adapters (the same bits); `STRATA_WGPU_NORM=seq|lanes1|wg` forces one.
    norm: NormKernel,
    /// Attention over an unsplit store by `model::attend_wg` (a 256-wide workgroup per row and
    /// head) instead of `model::attend` (one invocation per row and head, serial over the
    /// tokens and the head's values): the same bits. On by default on every adapter (on
    /// lavapipe the serial kernel returns only a head's first value for head dims of 64 and
    /// more: docs/WGPU.md). A split store's attention always runs the baseline's three phases.
    attn_wg: bool,
    /// The QSA block scores by `model::qsa_score` (a workgroup per row and block) before
    /// `qsa_select` selects, and GDN by `model::gdn_wg` (128 invocations a head instead of
    /// 64): the same bits. On by default on GPUs; on CPU adapters the serial kernels (lavapipe
    /// runs each of qsa_score's workgroups, one per block the store can hold, most of them past
    /// the visible blocks, as a coroutine switch per invocation).
    /// `STRATA_WGPU_ATTN=serial|wg` sets both this and `attn_wg`.
    seq_wg: bool,
    /// Per-kernel counts (and seconds when timed) while a profile runs: from construction with
    /// `STRATA_WGPU_PROFILE` set (timed), or between `profile_start` and `profile_stop`.
    profile: Mutex<Option<Profile>>,
}

/// Temporaries by byte size, kept for reuse (see [`WgpuBackend::temp`]).
#[derive(Default)]
struct Pool {
    by_size: HashMap<u64, Vec<Arc<Buf>>>,
    bytes: u64,
}

/// Bytes the pool keeps before it lets go of the buffers nobody holds.
const POOL_MAX: u64 = 1 << 30;

/// The kernel of the products (`mq.wgsl`), all in `mm`'s lane order: the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductKernel {
    /// `mq::mm1`: one invocation an output, keeping the 256 lane sums itself (CPU adapters).
    Lanes1,
    /// `mq::mm`: one 256-wide workgroup an output (the baseline).
    Workgroup,
    /// `mq::mmr`: one 256-wide workgroup for [`MMR_ROWS`] outputs, the activation read once
    /// for all and the tree's barriers shared.
    Rows,
    /// `mq::mmb`: a 64-wide workgroup for [`MMR_ROWS`] outputs, each invocation four
    /// adjacent lanes (one block's adjacent elements: their decoders share the scale and word
    /// loads), the activation read once for all outputs.
    Blocks,
    /// `mq::mmt`: a 64-wide workgroup for [`MMR_ROWS`] outputs, 8 invocations an output, each
    /// keeping 32 adjacent lanes in registers (one block of every block format a step) and
    /// running the tree's first five levels itself: no barrier in the loop.
    Threads,
    /// `mq::mmt` where [`mmt_pays`] (short rows or very many outputs), `mq::mm` elsewhere
    /// (GPUs).
    Auto,
}

/// Outputs per workgroup of `mq::mmr` and `mq::mmb`.
pub const MMR_ROWS: usize = 8;

/// Outputs of a product from which [`ProductKernel::Auto`] may take `mq::mmt` (16,384
/// invocations; below that `mm`'s 256 an output keep more of the GPU busy: a 320-output
/// product over 10,240 values would be 2,560 invocations of 1,280 elements each).
pub const MMT_MIN: usize = 2048;

/// Whether [`ProductKernel::Auto`] takes `mq::mmt` for `outputs` outputs over rows of `k`.
/// Measured on the H200 (docs/PERF.md, session 7 call 2): `mmt` wins where `mm`'s tree
/// dominates, short rows (hc_up: 10,240 outputs over 320, the experts' down products: 25,600
/// over 640) and the 248,320-output head, and loses where each of its invocations walks a
/// long row with few invocations in all (ssm_out, Q5_K, 2,560 outputs over 6,144: 376 µs
/// against `mm`'s 104), so rows longer than 1,024 stay on `mm` below 65,536 outputs.
pub fn mmt_pays(outputs: usize, k: usize) -> bool {
    outputs >= 65536 || (outputs >= MMT_MIN && k <= 1024)
}

/// The kernel of the core RMS norm (`Backend::rms_norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKernel {
    /// The CPU backend's sequential sum of squares, one invocation per group: the CPU's bits
    /// (a chain of `group` dependent adds: ~570 µs for a 2560-wide group on the H200).
    Sequential,
    /// The canonical 256-lane order (the CPU's `rms_norm` `lanes` variant, CUDA's order), one
    /// invocation per group: the baseline of that order.
    Lanes1,
    /// The canonical 256-lane order, one 256-wide workgroup per group: the same bits as
    /// `Lanes1`.
    Workgroup,
}

/// What a product applies to each output before storing it (mq.wgsl `epi`): `NONE`, or
/// model.wgsl's eltwise op 5 (silu(y·s)) or 6 (2σ(y·s)) folded in: the same bits, one
/// dispatch fewer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Epi(pub(crate) u32, pub(crate) f32);

impl Epi {
    pub(crate) const NONE: Epi = Epi(0, 0.0);
}

/// How a product's activations are imaged: a catalogue format (`kernels::actq`), or for F16
/// weights the rows rounded to F16 and kept as f32 values (the CPU pairs F16 weights with F16
/// activations; an f16·f16 product is exact in f32, so only the summation order differs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Img {
    Act(ActFmt),
    F16,
}

fn img_for(ty: GgmlType) -> Option<Img> {
    match ty {
        GgmlType::F16 => Some(Img::F16),
        // The CPU pairs Q4_1 and Q5_1 with Q8_1 images, whose codes and scale `d` are Q8_0's
        // (strata_quant's quantize_row_q8_1: d = amax/127, codes rne(x·127/amax)); the
        // products read values code·d only, so the Q8_0 image holds the same activations.
        GgmlType::Q4_1 | GgmlType::Q5_1 => Some(Img::Act(ActFmt::Q8_0)),
        _ => ActFmt::for_weight(ty).map(Img::Act),
    }
}

/// The formats the decoders read (`quants.wgsl`).
fn readable(ty: GgmlType) -> bool {
    shaders::FORMATS
        .iter()
        .chain(&shaders::FLOAT_FORMATS)
        .any(|(_, t)| *t == ty)
}

/// (x groups, y groups) covering `n` invocations of 64.
fn grid(n: usize) -> (u32, u32, u32) {
    let groups = n.div_ceil(64).max(1);
    let gx = groups.min(65535);
    (gx as u32, groups.div_ceil(gx) as u32, 1)
}

/// (x groups, y groups) covering `n` items of one workgroup each, and the x count.
pub(crate) fn item_grid(n: usize) -> (u32, u32) {
    let n = n.max(1);
    let gx = n.min(65535);
    (gx as u32, n.div_ceil(gx) as u32)
}

impl WgpuBackend {
    /// The adapter `sel` (an index into [`crate::list_adapters`] or part of an adapter's name;
    /// `None`: `STRATA_WGPU_ADAPTER`, else the first GPU, else a CPU adapter such as lavapipe).
    /// No adapter is an error that says what to install.
    pub fn new(sel: Option<&str>) -> Result<WgpuBackend, WgpuError> {
        let g = match sel {
            Some(s) => Wgpu::open(Some(s))?,
            None => Wgpu::new()?,
        };
        WgpuBackend::with_device(g)
    }

    /// A backend on an opened device (a test lowers its binding limit first).
    pub fn with_device(g: Wgpu) -> Result<WgpuBackend, WgpuError> {
        let mut g = g;
        let mut tab = g.upload("grid tables", &shaders::grid_table())?;
        tab.stable = true;
        let dummies = (0..8)
            .map(|_| {
                g.alloc("unused binding", 4).map(|mut b| {
                    b.stable = true;
                    b
                })
            })
            .collect::<Result<_, _>>()?;
        // Temporaries from a pool and bind groups cached across steps (the host's time per
        // dispatch: on lavapipe a tiny decode step records in ~1 ms instead of 3–4.5);
        // `STRATA_WGPU_POOL=0` gives every temporary and bind group fresh (the baseline).
        let env = |var: &'static str| std::env::var(var).ok();
        let pool_on = switch("STRATA_WGPU_POOL", env("STRATA_WGPU_POOL").as_deref())?;
        g.set_bind_cache(pool_on);
        let products = match choice(
            "STRATA_WGPU_MM",
            env("STRATA_WGPU_MM").as_deref(),
            &["lanes", "wg", "rows", "auto", "blocks", "threads"],
        )? {
            Some("lanes") => ProductKernel::Lanes1,
            Some("wg") => ProductKernel::Workgroup,
            Some("rows") => ProductKernel::Rows,
            Some("auto") => ProductKernel::Auto,
            Some("blocks") => ProductKernel::Blocks,
            Some("threads") => ProductKernel::Threads,
            _ if g.is_cpu() => ProductKernel::Lanes1,
            _ => ProductKernel::Auto,
        };
        let norm = match choice(
            "STRATA_WGPU_NORM",
            env("STRATA_WGPU_NORM").as_deref(),
            &["seq", "lanes1", "wg"],
        )? {
            Some("seq") => NormKernel::Sequential,
            Some("lanes1") => NormKernel::Lanes1,
            Some("wg") => NormKernel::Workgroup,
            _ if g.is_cpu() => NormKernel::Lanes1,
            _ => NormKernel::Workgroup,
        };
        let chunk = match count("STRATA_WGPU_CHUNK", env("STRATA_WGPU_CHUNK").as_deref())? {
            Some(n) => n,
            None if g.is_cpu() => 0,
            None => 256,
        };
        let (attn_wg, seq_wg) = match choice(
            "STRATA_WGPU_ATTN",
            env("STRATA_WGPU_ATTN").as_deref(),
            &["serial", "wg"],
        )? {
            Some("serial") => (false, false),
            Some(_) => (true, true),
            None => (true, !g.is_cpu()),
        };
        let fuse = switch("STRATA_WGPU_FUSE", env("STRATA_WGPU_FUSE").as_deref())?;
        let hw_f16 = switch("STRATA_WGPU_HWF16", env("STRATA_WGPU_HWF16").as_deref())?;
        Ok(WgpuBackend {
            pool: pool_on.then(|| Mutex::new(Pool::default())),
            attn_wg,
            seq_wg,
            norm,
            chunk,
            g: Arc::new(g),
            tab,
            dummies,
            pending: Mutex::new(Vec::new()),
            rope: Mutex::new(HashMap::new()),
            max_cap: AtomicUsize::new(0),
            dispatches: AtomicU64::new(0),
            submits: AtomicU64::new(0),
            split: AtomicUsize::new(0),
            products,
            failed: Mutex::new(None),
            weight_limit: u64::MAX,
            store_limit: u64::MAX,
            fuse,
            hw_f16: fuse && hw_f16,
            split_stores: AtomicUsize::new(0),
            profile: Mutex::new(std::env::var_os("STRATA_WGPU_PROFILE").map(|_| Profile {
                timed: true,
                by: HashMap::new(),
            })),
        })
    }

    /// Chooses the product kernel (`mq::mm1` when true, else `mq::mm`; the same bits).
    pub fn with_lane_products(self, on: bool) -> WgpuBackend {
        self.with_product_kernel(if on {
            ProductKernel::Lanes1
        } else {
            ProductKernel::Workgroup
        })
    }

    /// Chooses the product kernel ([`ProductKernel`]; the same bits).
    pub fn with_product_kernel(mut self, k: ProductKernel) -> WgpuBackend {
        self.products = k;
        self
    }

    /// Submits a step's dispatches every `n` dispatches (0: once, at the end of the step).
    pub fn with_submit_chunk(mut self, n: usize) -> WgpuBackend {
        self.chunk = n;
        self
    }

    /// Whether the QSA block scores and GDN run by workgroups (`qsa_score`, `gdn_wg`) rather
    /// than the serial baselines.
    pub(crate) fn seq_wg(&self) -> bool {
        self.seq_wg
    }

    /// A 4-byte buffer bound where a kernel reads nothing (qsa_select scoring no part).
    pub(crate) fn unused_f32(&self) -> &Buf {
        &self.dummies[1]
    }

    /// Attention, the QSA block scores and GDN by workgroups (`model::attend_wg`,
    /// `qsa_score`, `gdn_wg`: true) or the serial baselines: the same bits.
    pub fn with_attention_wg(mut self, on: bool) -> WgpuBackend {
        self.attn_wg = on;
        self.seq_wg = on;
        self
    }

    /// Chooses the core RMS norm's kernel ([`NormKernel`]).
    pub fn with_norm_kernel(mut self, k: NormKernel) -> WgpuBackend {
        self.norm = k;
        self
    }

    /// Temporaries from a pool and bind groups cached across steps, or every temporary and
    /// bind group fresh: the same bits.
    pub fn with_pool(mut self, on: bool) -> WgpuBackend {
        self.pool = on.then(|| Mutex::new(Pool::default()));
        if let Some(g) = Arc::get_mut(&mut self.g) {
            g.set_bind_cache(on);
        }
        self
    }

    /// Splits weights into parts of at most `bytes` (below the adapter's binding limit).
    pub fn with_weight_part_limit(mut self, bytes: u64) -> WgpuBackend {
        self.weight_limit = bytes;
        self
    }

    /// Optimized variants on or off (fused dispatches, hardware f16 scales), or the
    /// baselines: the same bits.
    pub fn with_fusion(mut self, on: bool) -> WgpuBackend {
        self.fuse = on;
        self.hw_f16 = on;
        self
    }

    /// Splits stores (caches) into parts of at most `bytes` (below the adapter's limit).
    pub fn with_store_part_limit(mut self, bytes: u64) -> WgpuBackend {
        self.store_limit = bytes;
        self
    }

    /// Stores made so far whose rows span more than one storage buffer.
    pub fn split_stores(&self) -> usize {
        self.split_stores.load(Ordering::Relaxed)
    }

    pub fn device(&self) -> &Wgpu {
        &self.g
    }

    pub fn counters(&self) -> Counters {
        Counters {
            dispatches: self.dispatches.load(Ordering::Relaxed),
            submits: self.submits.load(Ordering::Relaxed),
        }
    }

    /// Per-kernel dispatch counts and seconds so far, slowest (then most launched) first;
    /// empty when no profile runs.
    pub fn profile(&self) -> Vec<KernelStat> {
        let mut v: Vec<KernelStat> = match self.profile.lock() {
            Ok(p) => p
                .as_ref()
                .map(|p| {
                    p.by.iter()
                        .map(|(k, (n, s))| KernelStat {
                            name: k.clone(),
                            launches: *n,
                            secs: *s,
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        v.sort_by(|a, b| {
            b.secs
                .total_cmp(&a.secs)
                .then(b.launches.cmp(&a.launches))
                .then(a.name.cmp(&b.name))
        });
        v
    }

    /// Starts counting dispatches per kernel; `timed`: each dispatch is also submitted on its
    /// own and waited for, its wall time kept (host time included: on a fast GPU that is mostly
    /// submit and wait, so the counts are the measurement and the times only rank kernels).
    pub fn profile_start(&self, timed: bool) -> Result<()> {
        self.flush()?;
        *self.profile.lock().map_err(|_| dev(WgpuError::Poisoned))? = Some(Profile {
            timed,
            by: HashMap::new(),
        });
        Ok(())
    }

    /// Ends the profile, returning what [`WgpuBackend::profile`] would.
    pub fn profile_stop(&self) -> Result<Vec<KernelStat>> {
        self.flush()?;
        self.g.wait().map_err(dev)?;
        let v = self.profile();
        *self.profile.lock().map_err(|_| dev(WgpuError::Poisoned))? = None;
        Ok(v)
    }

    /// Starts GPU timestamps between the dispatches of every submit (the step is recorded
    /// and submitted as without them); false when the adapter has none inside passes.
    pub fn gpu_profile_start(&self) -> Result<bool> {
        self.flush()?;
        self.g.wait().map_err(dev)?;
        self.g.stamps_start().map_err(dev)
    }

    /// Ends the timestamps: GPU time by kernel ([`crate::GpuProfile`]).
    pub fn gpu_profile_stop(&self) -> Result<crate::GpuProfile> {
        self.flush()?;
        self.g.stamps_stop().map_err(dev)
    }

    fn profiling(&self) -> bool {
        self.profile.lock().map(|p| p.is_some()).unwrap_or(false)
    }

    /// Weights loaded so far whose bytes span more than one storage buffer.
    pub fn split_weights(&self) -> usize {
        self.split.load(Ordering::Relaxed)
    }

    pub(crate) fn push(&self, l: Launch) -> Result<()> {
        let timed = {
            let mut p = self.profile.lock().map_err(|_| dev(WgpuError::Poisoned))?;
            match p.as_mut() {
                Some(p) if !p.timed => {
                    p.by.entry(l.name.clone()).or_insert((0, 0.0)).0 += 1;
                    false
                }
                Some(_) => true,
                None => false,
            }
        };
        if timed {
            // Timed profile: every dispatch on its own, waited for (breaks the one-stream rule
            // on purpose; only while a timed profile runs).
            self.flush()?;
            let t = std::time::Instant::now();
            self.g.submit(std::slice::from_ref(&l)).map_err(dev)?;
            self.g.wait().map_err(dev)?;
            let secs = t.elapsed().as_secs_f64();
            let mut p = self.profile.lock().map_err(|_| dev(WgpuError::Poisoned))?;
            if let Some(p) = p.as_mut() {
                let e = p.by.entry(l.name.clone()).or_insert((0, 0.0));
                e.0 += 1;
                e.1 += secs;
            }
            self.dispatches.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let full = {
            let mut p = self.pending.lock().map_err(|_| dev(WgpuError::Poisoned))?;
            p.push(l);
            self.chunk > 0 && p.len() >= self.chunk
        };
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        if full {
            self.flush()?;
        }
        Ok(())
    }

    /// Submits the pending dispatches as one command stream.
    /// A failure of an earlier step's submit, returned once (then cleared).
    fn take_failure(&self) -> Result<()> {
        match self
            .failed
            .lock()
            .map_err(|_| dev(WgpuError::Poisoned))?
            .take()
        {
            Some(e) => Err(EngineError::Input(format!(
                "a step failed on the device: {e}"
            ))),
            None => Ok(()),
        }
    }

    pub fn flush(&self) -> Result<()> {
        let work = std::mem::take(&mut *self.pending.lock().map_err(|_| dev(WgpuError::Poisoned))?);
        if work.is_empty() {
            return Ok(());
        }
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.g.submit(&work).map_err(dev)
    }

    /// A temporary of `values` f32/u32 words: from the pool when it is on (contents
    /// undefined: every caller writes what it reads), else a fresh zeroed buffer.
    pub(crate) fn alloc(&self, what: &str, values: usize) -> Result<Arc<Buf>> {
        self.temp(what, values as u64 * 4)
    }

    /// A temporary of `bytes` (see [`WgpuBackend::alloc`]). The pool hands out a buffer of the
    /// same size that nothing but the pool holds any more (its `WBuf`s are gone). That is safe
    /// while dispatches that used it are still pending or running: all of a step's dispatches
    /// run in recording order with a barrier between each two (every binding is read-write),
    /// so the new owner's writes come after the old owner's reads; no pooled buffer is ever
    /// written from the host (uploads are fresh buffers). A step with the same key allocates
    /// and frees in the same order, so it gets the same buffers, and its launches the cached
    /// bind groups (`Wgpu::set_bind_cache`).
    pub(crate) fn temp(&self, what: &str, bytes: u64) -> Result<Arc<Buf>> {
        let Some(pool) = &self.pool else {
            return Ok(Arc::new(self.g.alloc(what, bytes).map_err(dev)?));
        };
        let mut p = pool.lock().map_err(|_| dev(WgpuError::Poisoned))?;
        if let Some(b) = p
            .by_size
            .get(&bytes)
            .and_then(|v| v.iter().find(|b| Arc::strong_count(b) == 1))
        {
            return Ok(b.clone());
        }
        let padded = bytes.max(4).div_ceil(4) * 4;
        if p.bytes + padded > POOL_MAX {
            // Too much kept (many sizes, e.g. prompts of many lengths): let go of every
            // buffer nobody holds, and of the bind groups that keep them alive.
            for v in p.by_size.values_mut() {
                v.retain(|b| Arc::strong_count(b) > 1);
            }
            p.by_size.retain(|_, v| !v.is_empty());
            p.bytes = p
                .by_size
                .values()
                .flatten()
                .map(|b| b.bytes.max(4).div_ceil(4) * 4)
                .sum();
            self.g.clear_bind_cache().map_err(dev)?;
        }
        let mut b = self.g.alloc(what, bytes).map_err(dev)?;
        b.stable = true;
        let b = Arc::new(b);
        p.by_size.entry(bytes).or_default().push(b.clone());
        p.bytes += padded;
        Ok(b)
    }

    pub(crate) fn buf(&self, what: &str, rows: usize, cols: usize) -> Result<WBuf> {
        Ok(WBuf {
            b: self.alloc(what, rows * cols)?,
            rows,
            cols,
            parts: None,
        })
    }

    /// A fresh zero-filled buffer (zeros, stores), never from the pool, kept for as long as
    /// its owner holds it.
    fn fresh(&self, what: &str, rows: usize, cols: usize) -> Result<WBuf> {
        let mut b = self.g.alloc(what, (rows * cols) as u64 * 4).map_err(dev)?;
        b.stable = true;
        Ok(WBuf {
            b: Arc::new(b),
            rows,
            cols,
            parts: None,
        })
    }

    /// One dispatch of a `model.wgsl` entry: f32 buffers A..E, u32 buffers I..K.
    pub(crate) fn model(
        &self,
        entry: &str,
        params: &[u32],
        f: [Option<&Buf>; 5],
        u: [Option<&Buf>; 3],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        let mut bufs: Vec<&Buf> = Vec::with_capacity(8);
        for (i, b) in f.iter().chain(u.iter()).enumerate() {
            bufs.push(b.unwrap_or(&self.dummies[i]));
        }
        let mut l = self
            .g
            .launch("model", entry, &[], params, &bufs, groups)
            .map_err(dev)?;
        if entry == "eltwise" && self.profiling() {
            l.name = format!("{} {}", l.name, params.get(1).copied().unwrap_or(0));
        }
        self.push(l)
    }

    /// Element-wise entry over `n` invocations.
    pub(crate) fn model_n(
        &self,
        entry: &str,
        params: &[u32],
        f: [Option<&Buf>; 5],
        u: [Option<&Buf>; 3],
        n: usize,
    ) -> Result<()> {
        self.model(entry, params, f, u, grid(n))
    }

    fn eltwise(&self, op: u32, n: usize, extra: &[u32], f: [Option<&Buf>; 5]) -> Result<()> {
        let mut p = vec![u32_of("eltwise", n)?, op];
        p.extend_from_slice(extra);
        self.model_n("eltwise", &p, f, [None; 3], n)
    }

    /// `rows` rows of `len` from `src` (stride `ss`, offset `so`) to `dst` (`ds`, `do_`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_rows(
        &self,
        src: &Buf,
        dst: &Buf,
        rows: usize,
        len: usize,
        ss: usize,
        so: usize,
        ds: usize,
        do_: usize,
    ) -> Result<()> {
        let op = "copy";
        let p = [
            u32_of(op, rows)?,
            u32_of(op, len)?,
            u32_of(op, ss)?,
            u32_of(op, so)?,
            u32_of(op, ds)?,
            u32_of(op, do_)?,
        ];
        self.model_n(
            "copy_rows",
            &p,
            [Some(src), Some(dst), None, None, None],
            [None; 3],
            rows * len,
        )
    }

    /// `x`'s rows as the activation image `w` pairs with (kernels::actq, the CPU's bits), and
    /// the image's row bytes; F32 activations are `x` itself.
    pub(crate) fn image(
        &self,
        x: &WBuf,
        ty: GgmlType,
        name: &str,
    ) -> Result<(Arc<Buf>, usize, ActFmt)> {
        let img = img_for(ty).ok_or_else(|| {
            shape(
                "matmul",
                format!("{name}: {ty} has no activation format on wgpu"),
            )
        })?;
        let k = x.cols;
        let fmt = match img {
            Img::Act(ActFmt::F32) => return Ok((x.b.clone(), 4 * k, ActFmt::F32)),
            Img::F16 => {
                let n = x.rows * x.cols;
                let out = self.buf("f16 activation image", x.rows, x.cols)?;
                self.eltwise(7, n, &[], [Some(&x.b), None, Some(&out.b), None, None])?;
                return Ok((out.b, 4 * k, ActFmt::F32));
            }
            Img::Act(f) => f,
        };
        // The images are block-local, so rows may be imaged in pairs (as one row of 2k): that
        // keeps a Q8_0 image whose row is an odd number of 34-byte blocks in whole words.
        let rb = fmt.row_bytes(k).filter(|_| k > 0);
        let pack = if rb.is_some_and(|b| b.is_multiple_of(4)) {
            1
        } else {
            2
        };
        let rb = rb
            .filter(|b| (pack * b).is_multiple_of(4) && pack * k <= crate::ops::MAX_NORM_ROW)
            .ok_or_else(|| {
                shape(
                    "matmul",
                    format!(
                        "{name}: rows of {k} have no {} image the kernels take (whole 4-byte words, at most {} values)",
                        fmt.name(),
                        crate::ops::MAX_NORM_ROW
                    ),
                )
            })?;
        let rows = x.rows.div_ceil(pack);
        let out = self.temp("activation image", (rows.max(1) * pack * rb) as u64)?;
        if rows > 0 {
            // A pair's missing second row (odd row counts) reads clamped values: its image
            // bytes are past the rows and never read.
            let p = [
                u32_of("xprep", pack * k)?,
                0,
                fmt.code(),
                u32_of("xprep", rows)?,
                0,
            ];
            let l = self
                .g
                .launch(
                    "norm",
                    // The block scales spread over the workgroup (the same bits) unless the
                    // baselines run.
                    if self.fuse {
                        "rms_xprep_par"
                    } else {
                        "rms_xprep_base"
                    },
                    &[],
                    &p,
                    &[&x.b, &self.dummies[0], &out],
                    (u32_of("xprep", rows)?, 1, 1),
                )
                .map_err(dev)?;
            self.push(l)?;
        }
        Ok((out, rb, fmt))
    }

    /// One `mq::mm` dispatch per part of `w`: items `items` (mode 0: the part's rows), tokens
    /// `nt`, activation row `t / x_div`, output rows of `y_stride`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mm(
        &self,
        w: &WWeight,
        xq: &Buf,
        xrb: usize,
        fmt: ActFmt,
        y: &Buf,
        y_stride: usize,
        nt: usize,
        mode: u32,
        items: usize,
        ids: Option<(&Buf, usize)>,
        rows_per_expert: usize,
        x_div: usize,
        epi: Epi,
    ) -> Result<()> {
        let op = "matmul";
        if nt == 0 {
            return Ok(());
        }
        if nt > 65535 {
            return Err(shape(
                op,
                format!("{nt} rows in one product (at most 65535)"),
            ));
        }
        let k = w.row_len;
        for part in &w.parts {
            let n_items = if mode == 0 { part.rows } else { items };
            let kernel = match self.products {
                ProductKernel::Auto if mmt_pays(n_items * nt, k) => ProductKernel::Threads,
                ProductKernel::Auto => ProductKernel::Workgroup,
                k => k,
            };
            let rows_kernel = matches!(
                kernel,
                ProductKernel::Rows | ProductKernel::Blocks | ProductKernel::Threads
            );
            let (gx, gy) = if rows_kernel {
                item_grid(n_items.div_ceil(MMR_ROWS))
            } else {
                item_grid(n_items)
            };
            let total = n_items * nt;
            let p = [
                w.ty.id(),
                u32_of(op, n_items)?,
                u32_of(op, k)?,
                u32_of(op, nt)?,
                u32_of(op, w.row_bytes)?,
                u32_of(op, xrb)?,
                u32_of(op, w.ty.block_size())?,
                u32_of(op, w.ty.type_size())?,
                fmt.code(),
                mode,
                u32_of(op, part.row0)?,
                u32_of(op, part.rows)?,
                u32_of(op, y_stride)?,
                u32_of(op, ids.map_or(0, |(_, o)| o))?,
                u32_of(op, rows_per_expert)?,
                u32_of(op, x_div.max(1))?,
                gx,
                u32_of(op, total)?,
                epi.0,
                epi.1.to_bits(),
            ];
            let idb = ids.map_or(&self.dummies[0], |(b, _)| b);
            let bufs = [&part.b, xq, y, &self.tab, idb];
            let spec = [
                ("SPEC_TY", w.ty.id().to_string()),
                ("SPEC_HWF16", self.hw_f16.to_string()),
            ];
            let l = match kernel {
                ProductKernel::Lanes1 => self.g.launch("mq", "mm1", &spec, &p, &bufs, grid(total)),
                ProductKernel::Workgroup | ProductKernel::Auto => {
                    self.g
                        .launch("mq", "mm", &spec, &p, &bufs, (gx, gy, nt as u32))
                }
                ProductKernel::Rows => {
                    let spec = shaders::spec_mmr(w.ty, self.hw_f16, MMR_ROWS);
                    self.g
                        .launch("mq", "mmr", &spec, &p, &bufs, (gx, gy, nt as u32))
                }
                ProductKernel::Blocks => {
                    let spec = shaders::spec_mmr(w.ty, self.hw_f16, MMR_ROWS);
                    self.g
                        .launch("mq", "mmb", &spec, &p, &bufs, (gx, gy, nt as u32))
                }
                ProductKernel::Threads => {
                    let spec = shaders::spec_mmr(w.ty, self.hw_f16, MMR_ROWS);
                    self.g
                        .launch("mq", "mmt", &spec, &p, &bufs, (gx, gy, nt as u32))
                }
            }
            .map_err(dev)?;
            let mut l = l;
            // The weight rows read (mode 2: each token its expert's slab), the activation
            // rows and the outputs: what a GB/s figure should count (the bound buffers would
            // count every expert).
            let rows_read = if mode == 2 { n_items * nt } else { n_items };
            l.bytes = (rows_read * w.row_bytes + nt * xrb + total * 4) as u64;
            if self.profiling() {
                // The shape too (outputs × k, and "e" for an expert slab per token), so a
                // profile separates a format's products by shape.
                let e = if mode == 2 { "e" } else { "" };
                l.name = format!("{} {} {n_items}{e}×{k}", l.name, w.ty);
            }
            self.push(l)?;
        }
        Ok(())
    }

    fn check_matmul(w: &WWeight, x: &WBuf) -> Result<()> {
        if w.dims.len() > 2 || x.cols != w.row_len {
            return Err(shape(
                "matmul",
                format!("{}: rows of {} against weight {:?}", w.name, x.cols, w.dims),
            ));
        }
        Ok(())
    }

    /// The RoPE table of (rot, theta) covering the largest store's positions.
    fn rope_table(&self, rot: usize, theta: f32) -> Result<(Arc<Buf>, usize)> {
        let want = self.max_cap.load(Ordering::Relaxed).max(1);
        let mut t = self.rope.lock().map_err(|_| dev(WgpuError::Poisoned))?;
        if let Some((b, n)) = t.get(&(rot, theta.to_bits())) {
            if *n >= want {
                return Ok((b.clone(), *n));
            }
        }
        // The CPU's formula (cpu::ops::rope_freqs / rope_row), in f64, rounded to f32.
        let half = rot / 2;
        let freqs: Vec<f64> = (0..half)
            .map(|i| (theta as f64).powf(-(2.0 * i as f64) / rot as f64))
            .collect();
        let mut v = Vec::with_capacity(want * half * 2);
        for pos in 0..want {
            for &f in &freqs {
                let a = pos as f64 * f;
                v.push(a.cos() as f32);
                v.push(a.sin() as f32);
            }
        }
        let mut b = self.g.upload("rope table", &v).map_err(dev)?;
        b.stable = true;
        let b = Arc::new(b);
        t.insert((rot, theta.to_bits()), (b.clone(), want));
        Ok((b, want))
    }
}

impl WgpuBackend {
    /// Products of `x` by each weight (one activation image per format, shared, as the CPU
    /// shares it), each with its epilogue.
    pub(crate) fn matmuls_epi<const N: usize>(
        &self,
        ws: [(&WWeight, Epi); N],
        x: &WBuf,
    ) -> Result<[WBuf; N]> {
        let mut images: Vec<(Img, Arc<Buf>, usize, ActFmt)> = Vec::new();
        let mut out = Vec::with_capacity(N);
        for (w, epi) in ws {
            Self::check_matmul(w, x)?;
            let img = img_for(w.ty).ok_or_else(|| {
                shape(
                    "matmul",
                    format!("{}: {} has no product on wgpu", w.name, w.ty),
                )
            })?;
            let (xq, xrb, fmt) = match images.iter().find(|(f, _, _, _)| *f == img) {
                Some((_, b, rb, fmt)) => (b.clone(), *rb, *fmt),
                None => {
                    let (b, rb, fmt) = self.image(x, w.ty, &w.name)?;
                    images.push((img, b.clone(), rb, fmt));
                    (b, rb, fmt)
                }
            };
            let m = w.n_rows2();
            let y = self.buf("matmul", x.rows, m)?;
            self.mm(w, &xq, xrb, fmt, &y.b, m, x.rows, 0, m, None, 0, 1, epi)?;
            out.push(y);
        }
        out.try_into()
            .map_err(|_| shape("matmuls", "product count"))
    }
}

impl Backend for WgpuBackend {
    type Buf = WBuf;
    type Weight = WWeight;
    type Ids = WIds;
    type Routes = WRoutes;
    type Images = ();

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn supports(&self, ty: GgmlType, usage: Usage) -> bool {
        match usage {
            Usage::MatMul => readable(ty) && img_for(ty).is_some(),
            Usage::Rows => readable(ty),
            Usage::Values => strata_quant::format_fns(ty).dequantize.is_some(),
        }
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> Result<WWeight> {
        let ty = file.tensor_type(info)?;
        let bytes = file.tensor_data(info)?;
        let row_len = info.ne(0) as usize;
        let n = info.n_elements;
        let row_bytes = ty.row_bytes(row_len).filter(|&b| b > 0).ok_or_else(|| {
            shape(
                "load_weight",
                format!("{}: rows of {row_len} are not whole {ty} blocks", info.name),
            )
        })?;
        let total_rows = bytes.len() / row_bytes;
        let mut parts = Vec::new();
        if readable(ty) {
            let limit = self.weight_limit.min(self.g.max_binding) as usize;
            let mut per = limit / row_bytes;
            if per == 0 {
                return Err(dev(WgpuError::TooLarge {
                    what: format!("{}: one row", info.name),
                    bytes: row_bytes as u64,
                    limit: limit as u64,
                }));
            }
            // Keep an expert's slab in one part when a slab fits.
            let slab = info.ne(1).max(1) as usize;
            if info.dims.len() > 2 && slab <= per {
                per -= per % slab;
            }
            let mut row0 = 0;
            while row0 < total_rows {
                let rows = per.min(total_rows - row0);
                let mut b = self
                    .g
                    .upload_bytes(
                        &info.name,
                        &bytes[row0 * row_bytes..(row0 + rows) * row_bytes],
                    )
                    .map_err(dev)?;
                b.stable = true;
                parts.push(Part { b, row0, rows });
                row0 += rows;
            }
        }
        if parts.len() > 1 {
            self.split.fetch_add(1, Ordering::Relaxed);
        }
        // An image that would exceed the binding limit is left out (its users then say so).
        let values = if n <= VALUES_MAX
            && n * 4 <= self.g.max_binding
            && strata_quant::format_fns(ty).dequantize.is_some()
        {
            let mut v = vec![0f32; n as usize];
            strata_quant::dequantize(ty, bytes, &mut v)?;
            let mut b = self.g.upload(&info.name, &v).map_err(dev)?;
            b.stable = true;
            Some((b, v.len()))
        } else {
            None
        };
        if parts.is_empty() && values.is_none() {
            return Err(EngineError::UnsupportedType {
                file: file.name().to_string(),
                tensor: info.name.clone(),
                ty: ty.name().to_string(),
                backend: "the wgpu backend".into(),
                usage: "any use",
            });
        }
        Ok(WWeight {
            name: info.name.clone(),
            ty,
            dims: info.dims.clone(),
            row_len,
            row_bytes,
            parts,
            values,
        })
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<WBuf> {
        self.fresh("zeros", rows, cols)
    }

    /// All `cap` rows are allocated up front (zeros); the RoPE tables grow to cover them. A
    /// store larger than the binding limit is split by rows (parts of a multiple of 256 rows
    /// when a part holds that many), which the store's readers and writers take part by part.
    fn store(&self, cap: usize, cols: usize) -> Result<WBuf> {
        self.max_cap.fetch_max(cap, Ordering::Relaxed);
        let row_bytes = cols.max(1) * 4;
        let limit = self.store_limit.min(self.g.max_binding) as usize;
        if cap * row_bytes <= limit {
            return self.fresh("store", cap, cols);
        }
        let mut per = limit / row_bytes;
        if per == 0 {
            return Err(dev(WgpuError::TooLarge {
                what: format!("a store row of {cols} values"),
                bytes: row_bytes as u64,
                limit: limit as u64,
            }));
        }
        if per >= 256 {
            per -= per % 256;
        }
        let mut parts = Vec::new();
        let mut row0 = 0;
        while row0 < cap {
            let rows = per.min(cap - row0);
            let mut b = self
                .g
                .alloc("store part", (rows * row_bytes) as u64)
                .map_err(dev)?;
            b.stable = true;
            parts.push(Part { b, row0, rows });
            row0 += rows;
        }
        self.split_stores.fetch_add(1, Ordering::Relaxed);
        Ok(WBuf {
            b: Arc::new(self.g.placeholder("split store").map_err(dev)?),
            rows: cap,
            cols,
            parts: Some(Arc::new(parts)),
        })
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<WBuf> {
        if data.len() != rows * cols {
            return Err(shape(
                "upload",
                format!("{} values for {rows}×{cols}", data.len()),
            ));
        }
        Ok(WBuf {
            b: Arc::new(self.g.upload("upload", data).map_err(dev)?),
            rows,
            cols,
            parts: None,
        })
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<WIds> {
        Ok(WIds {
            b: Arc::new(self.g.upload("ids", ids).map_err(dev)?),
            off: 0,
            len: ids.len(),
        })
    }

    fn ids_range(&self, ids: &WIds, start: usize, len: usize) -> Result<WIds> {
        if start + len > ids.len {
            return Err(shape(
                "ids_range",
                format!("{start}..{} of {} ids", start + len, ids.len),
            ));
        }
        Ok(WIds {
            b: ids.b.clone(),
            off: ids.off + start,
            len,
        })
    }

    fn download(&self, x: &WBuf) -> Result<Vec<f32>> {
        self.take_failure()?;
        self.flush()?;
        let mut v = Vec::with_capacity(x.rows * x.cols);
        for (b, _, rows) in x.row_parts() {
            let mut p: Vec<f32> = self.g.download(b).map_err(dev)?;
            p.truncate(rows * x.cols);
            v.extend(p);
        }
        v.truncate(x.rows * x.cols);
        Ok(v)
    }

    fn download_ids(&self, ids: &WIds) -> Result<Vec<u32>> {
        self.take_failure()?;
        self.flush()?;
        let v: Vec<u32> = self.g.download(&ids.b).map_err(dev)?;
        Ok(v[ids.off..ids.off + ids.len].to_vec())
    }

    fn copy(&self, x: &WBuf) -> Result<WBuf> {
        let y = self.buf("copy", x.rows, x.cols)?;
        let n = x.rows * x.cols;
        self.copy_rows(&x.b, &y.b, 1, n, n, 0, n, 0)?;
        Ok(y)
    }

    fn copy_into(&self, dst: &mut WBuf, src: &WBuf) -> Result<()> {
        if dst.rows != src.rows || dst.cols != src.cols {
            return Err(shape(
                "copy_into",
                format!("{}×{} vs {}×{}", dst.rows, dst.cols, src.rows, src.cols),
            ));
        }
        let n = src.rows * src.cols;
        self.copy_rows(&src.b, &dst.b, 1, n, n, 0, n, 0)
    }

    fn reshape(&self, x: WBuf, rows: usize, cols: usize) -> Result<WBuf> {
        if rows * cols != x.rows * x.cols {
            return Err(shape(
                "reshape",
                format!("{}×{} as {rows}×{cols}", x.rows, x.cols),
            ));
        }
        if x.parts.is_some() {
            return Err(shape("reshape", "a split store keeps its rows"));
        }
        Ok(WBuf {
            b: x.b,
            rows,
            cols,
            parts: None,
        })
    }

    fn truncate_rows(&self, dst: &mut WBuf, rows: usize) -> Result<()> {
        if rows > dst.rows {
            return Err(shape(
                "truncate_rows",
                format!("{rows} rows asked of a buffer of {}", dst.rows),
            ));
        }
        dst.rows = rows;
        Ok(())
    }

    fn slice_cols(&self, x: &WBuf, start: usize, len: usize) -> Result<WBuf> {
        if start + len > x.cols {
            return Err(shape(
                "slice_cols",
                format!("columns {start}..{} of rows of {}", start + len, x.cols),
            ));
        }
        let y = self.buf("slice", x.rows, len)?;
        self.copy_rows(&x.b, &y.b, x.rows, len, x.cols, start, len, 0)?;
        Ok(y)
    }

    fn deinterleave(&self, x: &WBuf, chunk: usize, parts: usize) -> Result<Vec<WBuf>> {
        if chunk == 0 || parts == 0 || !x.cols.is_multiple_of(chunk * parts) {
            return Err(shape(
                "deinterleave",
                format!("rows of {} into {parts} parts of {chunk}", x.cols),
            ));
        }
        let pieces = x.rows * x.cols / (chunk * parts);
        (0..parts)
            .map(|p| {
                let y = self.buf("deinterleave", x.rows, x.cols / parts)?;
                self.copy_rows(
                    &x.b,
                    &y.b,
                    pieces,
                    chunk,
                    chunk * parts,
                    p * chunk,
                    chunk,
                    0,
                )?;
                Ok(y)
            })
            .collect()
    }

    fn write_rows(&self, store: &mut WBuf, x: &WBuf, at: &WIds) -> Result<()> {
        self.write_kv(store, x, at, KvType::F32)
    }

    fn write_kv(&self, cache: &mut WBuf, x: &WBuf, at: &WIds, kv: KvType) -> Result<()> {
        if cache.cols != x.cols || at.len != x.rows {
            return Err(shape(
                "write_rows",
                format!(
                    "{} rows of {} at {} positions into rows of {}",
                    x.rows, x.cols, at.len, cache.cols
                ),
            ));
        }
        let op = "write_rows";
        for (part, row0, rows) in cache.row_parts() {
            let p = [
                u32_of(op, x.rows)?,
                u32_of(op, x.cols)?,
                u32_of(op, rows)?,
                u32_of(op, at.off)?,
                (kv == KvType::F16) as u32,
                u32_of(op, row0)?,
            ];
            self.model_n(
                "write_rows",
                &p,
                [Some(&x.b), Some(part), None, None, None],
                [Some(&at.b), None, None],
                x.rows * x.cols,
            )?;
        }
        Ok(())
    }

    /// One command stream per step: the body records, the end submits.
    fn step<R: Send>(&self, _key: StepKey, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        let t = std::time::Instant::now();
        let r = f();
        if std::env::var_os("STRATA_WGPU_TRACE").is_some() {
            let rec = t.elapsed().as_secs_f64();
            let _ = self.flush();
            let _ = self.g.wait();
            eprintln!(
                "step: recorded in {rec:.3} s, ran in {:.3} s",
                t.elapsed().as_secs_f64() - rec
            );
        }
        // `step` returns the body's result as it is; a failed submit is kept and returned by
        // the next download, before any value is read back.
        if let Err(e) = self.flush() {
            if let Ok(mut f) = self.failed.lock() {
                f.get_or_insert(e.to_string());
            }
        }
        r
    }

    fn add_assign(&self, x: &mut WBuf, y: &WBuf) -> Result<()> {
        if x.rows != y.rows || x.cols != y.cols {
            return Err(shape(
                "add_assign",
                format!("{}×{} vs {}×{}", x.rows, x.cols, y.rows, y.cols),
            ));
        }
        self.eltwise(
            0,
            x.rows * x.cols,
            &[],
            [Some(&x.b), Some(&y.b), None, None, None],
        )
    }

    fn embed_rows(&self, table: &WWeight, ids: &WIds, copies: usize) -> Result<WBuf> {
        let op = "embed_rows";
        let k = table.row_len;
        if table.parts.is_empty() || copies == 0 {
            return Err(shape(
                op,
                format!(
                    "{}: {} rows cannot be gathered on wgpu",
                    table.name, table.ty
                ),
            ));
        }
        let out = self.buf(op, ids.len, k * copies)?;
        if ids.len == 0 {
            return Ok(out);
        }
        if ids.len > 65535 {
            return Err(shape(
                op,
                format!("{} ids in one gather (at most 65535)", ids.len),
            ));
        }
        let total: usize = table.parts.iter().map(|p| p.rows).sum();
        for part in &table.parts {
            let p = [
                table.ty.id(),
                u32_of(op, k)?,
                u32_of(op, table.row_bytes)?,
                u32_of(op, part.row0)?,
                u32_of(op, part.rows)?,
                u32_of(op, table.ty.block_size())?,
                u32_of(op, table.ty.type_size())?,
                u32_of(op, ids.off)?,
                u32_of(op, copies)?,
                u32_of(op, total)?,
            ];
            let l = self
                .g
                .launch(
                    "mq",
                    "gather",
                    &[
                        ("SPEC_TY", table.ty.id().to_string()),
                        ("SPEC_HWF16", self.hw_f16.to_string()),
                    ],
                    &p,
                    &[&part.b, &self.dummies[0], &out.b, &self.tab, &ids.b],
                    (ids.len as u32, 1, 1),
                )
                .map_err(dev)?;
            self.push(l)?;
        }
        Ok(out)
    }

    fn matmul(&self, w: &WWeight, x: &WBuf) -> Result<WBuf> {
        let [y] = self.matmuls([w], x)?;
        Ok(y)
    }

    /// One activation image per format, shared by the products (as the CPU shares it).
    fn matmuls<const N: usize>(&self, ws: [&WWeight; N], x: &WBuf) -> Result<[WBuf; N]> {
        self.matmuls_epi(ws.map(|w| (w, Epi::NONE)), x)
    }

    fn matmul_rows(&self, w: &WWeight, rows: &WIds, x: &WBuf) -> Result<WBuf> {
        Self::check_matmul(w, x)?;
        let (xq, xrb, fmt) = self.image(x, w.ty, &w.name)?;
        let y = self.buf("matmul_rows", x.rows, rows.len)?;
        if rows.len > 0 {
            self.mm(
                w,
                &xq,
                xrb,
                fmt,
                &y.b,
                rows.len,
                x.rows,
                1,
                rows.len,
                Some((&rows.b, rows.off)),
                0,
                1,
                Epi::NONE,
            )?;
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &WBuf, w: &WWeight, group: usize, eps: f32) -> Result<WBuf> {
        let (wv, wn) = w.values()?;
        if group == 0 || !x.cols.is_multiple_of(group) || (wn != x.cols && wn != group) {
            return Err(shape(
                "rms_norm",
                format!(
                    "{}: {wn} weights, rows of {} in groups of {group}",
                    w.name, x.cols
                ),
            ));
        }
        let op = "rms_norm";
        let out = self.buf(op, x.rows, x.cols)?;
        let groups = x.rows * (x.cols / group);
        let (gx, gy) = item_grid(groups);
        let p = [
            u32_of(op, x.rows)?,
            u32_of(op, x.cols)?,
            u32_of(op, group)?,
            eps.to_bits(),
            u32_of(op, wn)?,
            gx,
        ];
        let f: [Option<&Buf>; 5] = [Some(&x.b), Some(wv), Some(&out.b), None, None];
        match self.norm {
            NormKernel::Sequential => self.model_n("rms_norm", &p, f, [None; 3], groups)?,
            NormKernel::Lanes1 => self.model_n("rms_norm_lanes1", &p, f, [None; 3], groups)?,
            NormKernel::Workgroup => {
                if groups > 0 {
                    self.model("rms_norm_wg", &p, f, [None; 3], (gx, gy, 1))?
                }
            }
        }
        Ok(out)
    }

    fn rope_neox(
        &self,
        x: &mut WBuf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &WIds,
    ) -> Result<()> {
        if positions.len != x.rows
            || head_dim == 0
            || !x.cols.is_multiple_of(head_dim)
            || rot > head_dim
            || !rot.is_multiple_of(2)
        {
            return Err(shape(
                "rope_neox",
                format!(
                    "{} positions for {} rows of {} (head {head_dim}, rot {rot})",
                    positions.len, x.rows, x.cols
                ),
            ));
        }
        if rot == 0 || x.rows == 0 {
            return Ok(());
        }
        let (tab, n) = self.rope_table(rot, theta)?;
        let op = "rope_neox";
        let p = [
            u32_of(op, x.rows)?,
            u32_of(op, x.cols)?,
            u32_of(op, head_dim)?,
            u32_of(op, rot / 2)?,
            u32_of(op, n)?,
            u32_of(op, positions.off)?,
        ];
        self.model_n(
            "rope",
            &p,
            [Some(&x.b), Some(&tab), None, None, None],
            [Some(&positions.b), None, None],
            x.rows * (x.cols / head_dim) * (rot / 2),
        )
    }

    fn mul_sigmoid(&self, x: &WBuf, gate: &WBuf) -> Result<WBuf> {
        if x.rows != gate.rows || x.cols != gate.cols {
            return Err(shape("mul_sigmoid", "shapes differ"));
        }
        let out = self.buf("mul_sigmoid", x.rows, x.cols)?;
        self.eltwise(
            2,
            x.rows * x.cols,
            &[],
            [Some(&x.b), Some(&gate.b), Some(&out.b), None, None],
        )?;
        Ok(out)
    }

    fn route(&self, logits: &WBuf, k: usize) -> Result<WRoutes> {
        let op = "route";
        let (nt, ne) = (logits.rows, logits.cols);
        if k == 0 || k > ne || ne > 512 || k > 16 {
            return Err(shape(
                op,
                format!("top {k} of {ne} experts (the kernels take up to 512 experts, k ≤ 16)"),
            ));
        }
        // Pooled: the route kernel writes every row's k ids and weights.
        let ids = self.temp("route ids", (nt.max(1) * k * 4) as u64)?;
        let wts = self.temp("route weights", (nt.max(1) * k * 4) as u64)?;
        if nt > 0 {
            let l = self
                .g
                .launch(
                    "route",
                    "route_opt",
                    &shaders::spec_route(ne, k),
                    &[u32_of(op, ne)?, u32_of(op, k)?, u32_of(op, nt)?],
                    &[&logits.b, &ids, &wts],
                    (u32_of(op, nt)?, 1, 1),
                )
                .map_err(dev)?;
            self.push(l)?;
        }
        Ok(WRoutes {
            ids,
            wts,
            rows: nt,
            k,
        })
    }

    fn moe_experts(
        &self,
        ex: &ExpertWeights<'_, WWeight>,
        x: &WBuf,
        routes: &WRoutes,
    ) -> Result<WBuf> {
        let op = "moe_experts";
        let hdim = x.cols;
        let m = ex.gate.n_rows2();
        if routes.rows != x.rows
            || ex.gate.row_len != hdim
            || ex.up.row_len != hdim
            || ex.down.n_rows2() != hdim
            || ex.down.row_len != m
            || ex.up.n_rows2() != m
        {
            return Err(shape(
                op,
                format!(
                    "{} rows of {hdim} for experts {:?}/{:?}/{:?}",
                    x.rows,
                    ex.gate.dims(),
                    ex.up.dims(),
                    ex.down.dims()
                ),
            ));
        }
        let k = routes.k;
        let nrk = x.rows * k;
        let out = self.buf(op, x.rows, hdim)?;
        if nrk == 0 {
            return Ok(out);
        }
        let mut gu = Vec::new();
        // Gate and up share x's activation image when their formats pair with the same one.
        let gate_img = self.image(x, ex.gate.ty, &ex.gate.name)?;
        for w in [ex.gate, ex.up] {
            let (xq, xrb, fmt) = if img_for(w.ty) == img_for(ex.gate.ty) {
                gate_img.clone()
            } else {
                self.image(x, w.ty, &w.name)?
            };
            let y = self.buf(op, nrk, m)?;
            self.mm(
                w,
                &xq,
                xrb,
                fmt,
                &y.b,
                m,
                nrk,
                2,
                m,
                Some((&routes.ids, 0)),
                m,
                k,
                Epi::NONE,
            )?;
            gu.push(y);
        }
        let act = self.swiglu(&gu[0], &gu[1])?;
        let (aq, arb, afmt) = self.image(&act, ex.down.ty, &ex.down.name)?;
        let yd = self.buf(op, nrk, hdim)?;
        self.mm(
            ex.down,
            &aq,
            arb,
            afmt,
            &yd.b,
            hdim,
            nrk,
            2,
            hdim,
            Some((&routes.ids, 0)),
            hdim,
            1,
            Epi::NONE,
        )?;
        let p = [u32_of(op, x.rows)?, u32_of(op, k)?, u32_of(op, hdim)?];
        self.model_n(
            "moe_sum",
            &p,
            [Some(&out.b), Some(&yd.b), Some(&routes.wts), None, None],
            [None; 3],
            x.rows * hdim,
        )?;
        Ok(out)
    }

    fn swiglu(&self, g: &WBuf, u: &WBuf) -> Result<WBuf> {
        if g.rows != u.rows || g.cols != u.cols {
            return Err(shape("swiglu", "shapes differ"));
        }
        let out = self.buf("swiglu", g.rows, g.cols)?;
        self.eltwise(
            3,
            g.rows * g.cols,
            &[],
            [Some(&g.b), Some(&u.b), Some(&out.b), None, None],
        )?;
        Ok(out)
    }

    fn add_sigmoid_gated(&self, y: &mut WBuf, x: &WBuf, gate: &WBuf) -> Result<()> {
        if y.rows != x.rows || y.cols != x.cols || gate.rows != y.rows || gate.cols != 1 {
            return Err(shape(
                "add_sigmoid_gated",
                format!("gate {}×{}", gate.rows, gate.cols),
            ));
        }
        self.eltwise(
            4,
            y.rows * y.cols,
            &[u32_of("add_sigmoid_gated", y.cols.max(1))?],
            [Some(&y.b), Some(&x.b), Some(&gate.b), None, None],
        )
    }

    fn add_bias(&self, x: &mut WBuf, b: &WWeight) -> Result<()> {
        let (bv, bn) = b.values()?;
        if bn != x.cols {
            return Err(shape(
                "add_bias",
                format!("{}: {bn} values for rows of {}", b.name, x.cols),
            ));
        }
        if x.cols == 0 {
            return Ok(());
        }
        self.eltwise(
            1,
            x.rows * x.cols,
            &[u32_of("add_bias", x.cols)?],
            [Some(&x.b), Some(bv), None, None, None],
        )
    }

    fn attend_causal(
        &self,
        q: &WBuf,
        k_cache: &WBuf,
        v_cache: &WBuf,
        positions: &WIds,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<WBuf> {
        self.attention(q, k_cache, v_cache, Sel::Causal(positions), dims, kv, true)
    }
}

/// Which tokens a query row attends to.
pub(crate) enum Sel<'a> {
    /// `0..=positions[r]`.
    Causal(&'a WIds),
    /// Rows of `[count, tokens…]`, `stride` u32 each.
    Sparse {
        b: &'a Buf,
        stride: usize,
        rows: usize,
    },
}

impl WgpuBackend {
    /// Softmax attention over the selected tokens; `causal_arith`: the CPU's attend_causal
    /// arithmetic (eight partial sums, `p·(1/z)`), else its attend (sequential, `p/z`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        q: &WBuf,
        k_cache: &WBuf,
        v_cache: &WBuf,
        sel: Sel<'_>,
        dims: AttnDims,
        kv: KvType,
        causal_arith: bool,
    ) -> Result<WBuf> {
        let op = "attend";
        let AttnDims {
            n_head,
            n_head_kv,
            head_dim,
        } = dims;
        let kv_cols = n_head_kv * head_dim;
        let sel_rows = match &sel {
            Sel::Causal(p) => p.len,
            Sel::Sparse { rows, .. } => *rows,
        };
        let ok = n_head_kv > 0
            && n_head % n_head_kv == 0
            && q.cols == n_head * head_dim
            && k_cache.cols == kv_cols
            && v_cache.cols == kv_cols
            && k_cache.rows == v_cache.rows
            && sel_rows == q.rows
            && head_dim <= MAX_HEAD;
        if !ok {
            return Err(shape(
                op,
                format!(
                    "q {}×{}, caches {}×{} / {}×{}, {sel_rows} selection rows, {dims:?} (heads up to {MAX_HEAD})",
                    q.rows, q.cols, k_cache.rows, k_cache.cols, v_cache.rows, v_cache.cols
                ),
            ));
        }
        let out = self.buf(op, q.rows, q.cols)?;
        if q.rows == 0 || head_dim == 0 {
            return Ok(out);
        }
        let (mode, stride, ids_off, ib, jb) = match sel {
            Sel::Causal(p) => (0u32, 0usize, p.off, Some(&*p.b), None),
            Sel::Sparse { b, stride, .. } => (1, stride, 0, None, Some(b)),
        };
        let (kp, vp) = (k_cache.row_parts(), v_cache.row_parts());
        let same =
            kp.len() == vp.len() && kp.iter().zip(&vp).all(|(a, b)| a.1 == b.1 && a.2 == b.2);
        if !same {
            return Err(shape(op, "the K and V caches are split differently"));
        }
        let mut p = vec![
            u32_of(op, q.rows)?,
            u32_of(op, n_head)?,
            u32_of(op, n_head_kv)?,
            u32_of(op, head_dim)?,
            (kv == KvType::F16) as u32,
            mode,
            u32_of(op, stride)?,
            u32_of(op, k_cache.rows)?,
            u32_of(op, ids_off)?,
            causal_arith as u32,
            0,
            u32_of(op, k_cache.rows)?,
            0,
            1,
            1,
            0,
            u32::MAX,
        ];
        let n = q.rows * n_head;
        // The most tokens a row's list can hold (the kernels clamp their count to this).
        let listed = match mode {
            0 => k_cache.rows,
            _ => stride.saturating_sub(1),
        };
        let wg_fits = !self.g.is_cpu() || listed <= attend_wg_tokens(head_dim);
        if kp.len() == 1 && self.attn_wg && wg_fits {
            let (gx, gy) = item_grid(n);
            self.model(
                "attend_wg",
                &p,
                [Some(&q.b), Some(kp[0].0), Some(vp[0].0), Some(&out.b), None],
                [ib, jb, None],
                (gx, gy, 1),
            )?;
            return Ok(out);
        }
        // The most tokens one dispatch may visit (`ATTEND_LOOP_BUDGET`: lavapipe's loop
        // limiter).
        let span = attend_tokens(head_dim);
        if kp.len() == 1 && listed <= span {
            self.model_n(
                "attend",
                &p,
                [Some(&q.b), Some(kp[0].0), Some(vp[0].0), Some(&out.b), None],
                [ib, jb, None],
                n,
            )?;
            return Ok(out);
        }
        // A split store, or more tokens than one dispatch may visit: the max, the sum and the
        // weighted values each over the parts in row order and, within a part, over the token
        // list in ranges of `span` in list order (a causal list's tokens are its indices, so
        // a part only needs the ranges that reach its rows), the running (m, z, o) carried in
        // `state`: the same sums in the same order as one dispatch.
        let mut pieces: Vec<(usize, usize)> = Vec::new();
        for (j, (_, row0, rows)) in kp.iter().enumerate() {
            let (lo, hi) = match mode {
                0 => (*row0, (row0 + rows).min(listed)),
                _ => (0, listed),
            };
            let mut x = lo;
            while x < hi {
                pieces.push((j, x));
                x += span;
            }
        }
        if pieces.is_empty() {
            // Nothing to visit: one empty piece still starts and ends the carried state.
            pieces.push((0, 0));
        }
        let state = self.alloc("attention state", n * (head_dim + 2))?;
        let last = pieces.len() - 1;
        for phase in 1..=3u32 {
            for (at, &(j, x0)) in pieces.iter().enumerate() {
                let (kb, row0, rows) = kp[j];
                let x1 = match mode {
                    0 => (x0 + span).min(row0 + rows),
                    _ => x0 + span,
                };
                p[10] = u32_of(op, row0)?;
                p[11] = u32_of(op, rows)?;
                p[12] = phase;
                p[13] = (at == 0) as u32;
                p[14] = (at == last) as u32;
                p[15] = u32_of(op, x0)?;
                p[16] = u32_of(op, x1)?;
                self.model_n(
                    "attend",
                    &p,
                    [
                        Some(&q.b),
                        Some(kb),
                        Some(vp[j].0),
                        Some(&out.b),
                        Some(&state),
                    ],
                    [ib, jb, None],
                    n,
                )?;
            }
        }
        Ok(out)
    }
}

// ---- settings: `STRATA_WGPU_*` values are checked when the backend is made, and one the
// backend does not know is an error naming it (never a silent fall-back to the default).

/// An on/off setting: unset or empty is on, `1` on, `0` off.
fn switch(var: &'static str, v: Option<&str>) -> Result<bool, WgpuError> {
    match v.map(str::trim) {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(x) => Err(WgpuError::Setting {
            var,
            value: x.to_string(),
            expected: "expected 0 (off) or 1 (on)".into(),
        }),
    }
}

/// One of `names`, or None when unset or empty.
fn choice<'a>(
    var: &'static str,
    v: Option<&'a str>,
    names: &[&'static str],
) -> Result<Option<&'a str>, WgpuError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(x) if names.contains(&x) => Ok(Some(x)),
        Some(x) => Err(WgpuError::Setting {
            var,
            value: x.to_string(),
            expected: format!("expected one of {}", names.join(", ")),
        }),
    }
}

/// A whole number, or None when unset or empty.
fn count(var: &'static str, v: Option<&str>) -> Result<Option<usize>, WgpuError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(x) => x.parse().map(Some).map_err(|_| WgpuError::Setting {
            var,
            value: x.to_string(),
            expected: "expected a whole number of dispatches (0: one submit a step)".into(),
        }),
    }
}

#[cfg(test)]
mod setting_tests {
    use super::*;

    /// Known values are taken, unset and empty mean the default, and anything else is an
    /// error that names the variable, the value and what it accepts.
    #[test]
    fn settings_take_known_values_and_refuse_the_rest_by_name() {
        assert!(switch("STRATA_WGPU_POOL", None).unwrap());
        assert!(switch("STRATA_WGPU_POOL", Some("")).unwrap());
        assert!(switch("STRATA_WGPU_POOL", Some("1")).unwrap());
        assert!(!switch("STRATA_WGPU_POOL", Some("0")).unwrap());
        let e = switch("STRATA_WGPU_POOL", Some("off"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("STRATA_WGPU_POOL=off") && e.contains("0 (off) or 1"),
            "{e}"
        );
        let mm = ["lanes", "wg", "rows", "auto", "blocks"];
        assert_eq!(
            choice("STRATA_WGPU_MM", Some("rows"), &mm).unwrap(),
            Some("rows")
        );
        assert_eq!(choice("STRATA_WGPU_MM", None, &mm).unwrap(), None);
        let e = choice("STRATA_WGPU_MM", Some("block"), &mm)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("STRATA_WGPU_MM=block") && e.contains("blocks"),
            "{e}"
        );
        let e = choice("STRATA_WGPU_NORM", Some("fast"), &["seq", "lanes1", "wg"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("STRATA_WGPU_NORM=fast") && e.contains("seq"),
            "{e}"
        );
        assert_eq!(count("STRATA_WGPU_CHUNK", Some("64")).unwrap(), Some(64));
        assert_eq!(count("STRATA_WGPU_CHUNK", None).unwrap(), None);
        let e = count("STRATA_WGPU_CHUNK", Some("-1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("STRATA_WGPU_CHUNK=-1"), "{e}");
    }
}
