//! The CUDA backend: [`CudaBackend`] implements the engine's core [`Backend`] and qwen4exp's
//! [`Qwen4expOps`] over device buffers, so `qwen4exp::Model<CudaBackend>` and
//! `qwen2::Model<CudaBackend>` run the model code unchanged (DESIGN.md §2.1, docs/BOUNDARY.md).
//!
//! - Weights are uploaded in their file formats ([`model::DevWeight`]); tensors read
//!   element-wise (norm weights, conv kernels, per-head constants) and tables the embed kernels
//!   do not take get an f32 image on first use.
//! - Stores ([`Backend::store`]) are allocated at their full capacity once; rows are written at
//!   device positions; recurrent states are updated in place.
//! - Every operation is one or a few launches of `kernels/*.cu` through the launchers of
//!   [`model`] and [`ops`] (the catalogue's optimized variants where the shape has one).
//! - Nothing is read back inside a step. Kernels that meet a position or id outside a store set
//!   a bit in the backend's error word instead of touching memory; [`Backend::download`] reads
//!   it with the results and turns a set bit into an error.
//!
//! Semantics are the CPU backend's; results agree with it within the cross-backend bounds of
//! `tests/model_ops.rs` (sums run in another order), and every row of a batch gets the bits it
//! gets alone (prefill = steps, window rows = single rows).

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
use strata_engine::backend::{
    AttnDims, Backend, DeviceBuf, DeviceIds, DevicePick, DeviceWeight, DraftMap, DraftPick,
    DraftSlop, ExpertWeights, KvType, StepInputs, StepKey, Usage,
};
use strata_engine::kernels::ActFmt;
use strata_engine::qwen4exp::ops::{
    moe_block_composed, qsa_prepare_composed, GdnParams, HcWeights, QsaCaches, QsaPrepW,
    QsaPrepared, QsaRows, QsaSelect, Qwen4expOps,
};
use strata_engine::qwen4exp::weights::MoeW;
use strata_engine::{EngineError, Result};
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::GgmlType;

use crate::device::{cfg, Gpu};
use crate::model::{self, DevWeight, ERR_CAPACITY, ERR_EXPERT, ERR_NAN_LOGIT};
use crate::ops;
use crate::record;
use crate::CudaError;

/// Attention scratch budget (floats): a long prefill over a large capacity runs its rows in
/// chunks of what this holds.
const ATTN_SCRATCH_FLOATS: usize = 64 << 20;

/// Scratch for batches of at most this many rows is kept between steps.
const SCRATCH_CACHE_ROWS: usize = 8;

/// Batches above this many rows run the routed experts grouped by expert (prefill); at most
/// this many, one (row, slot) pair a block (decode, verify windows). Both give the same bits.
const MOE_GROUPED_ABOVE: usize = 8;

/// Batches above this many rows run the GDN recurrence spread over the state's columns (three
/// launches); at most this many, one block a head. Both give the same bits.
const GDN_SCAN_ABOVE: usize = 8;

/// One launch of a kernel from backend code (errors become engine errors).
macro_rules! kernel {
    ($($t:tt)*) => {
        (|| -> std::result::Result<(), CudaError> { crate::ops::launch!($($t)*) })()
    };
}

fn dev(e: CudaError) -> EngineError {
    EngineError::Input(format!("CUDA: {e}"))
}

fn shape(op: &'static str, what: String) -> EngineError {
    EngineError::Shape { op, what }
}

/// Where the host's time of recorded steps goes (#10 point 4: the host time per step), summed
/// since the last [`CudaBackend::take_host_stats`]: the step body (the model's code and the
/// recording of its launches), the op list's signature, and the graph's launch (or its
/// capture, for a new op list). Waiting for the device is not in it.
#[derive(Clone, Debug, Default)]
pub struct HostStats {
    pub steps: u64,
    /// Parts the steps were handed to the device in ([`CudaBackend::submit_part`]).
    pub parts: u64,
    pub captures: u64,
    pub ops: u64,
    pub body_ns: u64,
    pub signature_ns: u64,
    pub launch_ns: u64,
    /// Device time from a step's first part starting to its last part ending (timed events
    /// around the step's graphs; it includes any wait of the device for a later part), and
    /// from that end to the next step's start: the device idle between two steps (the host's
    /// pick read, sampling and first part). One entry per consecutive pair of steps (`timed`
    /// of them, the first 65,536 since the last take); [`median_ns`] keeps the pairs across a
    /// new sequence out of the figure.
    pub timed: u64,
    /// Downloads of f32 buffers (logits) and the host's time in them once the device has
    /// finished the work before them (the copy and its own wait).
    pub downloads: u64,
    pub download_ns: u64,
    /// The part of `download_ns` spent copying out of the page-locked read-back buffer.
    pub copy_out_ns: u64,
    pub device_span_ns: Vec<u64>,
    pub device_gap_ns: Vec<u64>,
}

/// The median of `v` (0 for none).
pub fn median_ns(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// At most this many (span, gap) pairs are kept between two [`CudaBackend::take_host_stats`]
/// calls (the first ones; 1 MiB).
const TIMED_PAIRS_KEPT: usize = 1 << 16;

/// Timed events at a recorded step's start (before its first part) and end (after its last).
struct StepEvents {
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

/// A device buffer the backend hands out: owned (freed when dropped), or a view into a recorded
/// step's arena block (the block lives as long as any view of it; the view frees nothing).
pub struct Mem<T> {
    s: ManuallyDrop<CudaSlice<T>>,
    arena: Option<Arc<ArenaBlock>>,
}

impl<T> Mem<T> {
    fn owned(s: CudaSlice<T>) -> Mem<T> {
        Mem {
            s: ManuallyDrop::new(s),
            arena: None,
        }
    }
}

impl<T> Deref for Mem<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.s
    }
}

impl<T> DerefMut for Mem<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.s
    }
}

impl<T> Drop for Mem<T> {
    fn drop(&mut self) {
        // SAFETY: `s` is taken once, here.
        let s = unsafe { ManuallyDrop::take(&mut self.s) };
        if self.arena.is_some() {
            // A view: the memory belongs to the arena block.
            let _ = s.leak();
        }
    }
}

/// One block of a step's arena.
pub struct ArenaBlock {
    /// Owns the block's memory (freed when the last view and the arena let go).
    _mem: CudaSlice<u8>,
    base: u64,
}

/// Where an arena puts each request: (block, offset), blocks in order, requests rounded to 256
/// bytes; a request no block has room for from the current position goes to a new block of
/// at least [`ARENA_BLOCK`] bytes. The same requests after [`Bump::reset`] get the same
/// places, which is what makes a recorded step's addresses repeat. (No device here: tested on
/// any machine.)
#[derive(Default)]
struct Bump {
    sizes: Vec<usize>,
    at: usize,
    off: usize,
}

impl Bump {
    /// The place of `bytes`, and the size of the block to add first when the place is in a
    /// block that does not exist yet.
    fn place(&mut self, bytes: usize) -> (usize, usize, Option<usize>) {
        let bytes = bytes.max(1).div_ceil(256) * 256;
        loop {
            match self.sizes.get(self.at) {
                Some(&size) if self.off + bytes <= size => {
                    let off = self.off;
                    self.off += bytes;
                    return (self.at, off, None);
                }
                Some(_) => {
                    self.at += 1;
                    self.off = 0;
                }
                None => {
                    let size = bytes.max(ARENA_BLOCK);
                    self.sizes.push(size);
                    self.off = bytes;
                    return (self.at, 0, Some(size));
                }
            }
        }
    }

    fn reset(&mut self) {
        self.at = 0;
        self.off = 0;
    }
}

/// A step's temporaries, handed out in the same order (so at the same addresses) every time
/// the step runs: recorded ops, and the graphs made from them, stay valid from step to step.
#[derive(Default)]
struct Arena {
    bump: Bump,
    blocks: Vec<Arc<ArenaBlock>>,
}

const ARENA_BLOCK: usize = 64 << 20;

impl Arena {
    fn take(
        &mut self,
        gpu: &Gpu,
        bytes: usize,
    ) -> std::result::Result<(Arc<ArenaBlock>, u64), CudaError> {
        let (block, off, new) = self.bump.place(bytes);
        if let Some(size) = new {
            let mem = match gpu.alloc_uninit::<u8>(size) {
                Ok(m) => m,
                Err(e) => {
                    // The block was not made: forget it, so the layout stays the blocks'.
                    self.bump.sizes.pop();
                    self.bump.reset();
                    return Err(e);
                }
            };
            let base = record::addr(&mem, gpu.stream());
            self.blocks.push(Arc::new(ArenaBlock { _mem: mem, base }));
        }
        let b = &self.blocks[block];
        Ok((Arc::clone(b), b.base + off as u64))
    }

    fn reset(&mut self) {
        self.bump.reset();
    }
}

/// Pinned host staging for a recorded step's inputs, handed out in order like the arena: the
/// copy ops read it when the step's graph runs.
#[derive(Default)]
struct Staging {
    blocks: Vec<(cudarc::driver::PinnedHostSlice<u8>, *mut u8)>,
    at: usize,
    off: usize,
}

// SAFETY: the raw pointers point into the pinned blocks owned alongside them.
unsafe impl Send for Staging {}

const STAGING_BLOCK: usize = 1 << 20;

impl Staging {
    fn take(&mut self, gpu: &Gpu, bytes: usize) -> std::result::Result<*mut u8, CudaError> {
        let bytes = bytes.max(1).div_ceil(64) * 64;
        loop {
            if let Some((b, ptr)) = self.blocks.get(self.at) {
                if self.off + bytes <= b.len() {
                    // SAFETY: within the block.
                    let p = unsafe { ptr.add(self.off) };
                    self.off += bytes;
                    return Ok(p);
                }
                self.at += 1;
                self.off = 0;
                continue;
            }
            let mut b = gpu.alloc_pinned(bytes.max(STAGING_BLOCK))?;
            let ptr = b
                .as_mut_ptr()
                .map_err(crate::device::drv("cuMemHostAlloc"))?;
            self.blocks.push((b, ptr));
        }
    }

    fn reset(&mut self) {
        self.at = 0;
        self.off = 0;
    }
}

/// The graphs captured for one part of a key's steps ([`CudaBackend::submit_part`]), by the
/// signature of the op list each was captured from.
type PartGraphs = Vec<(Vec<u64>, crate::Graph)>;

/// What the backend keeps per step key: its arena and staging, the graphs captured from its
/// recorded ops (per part of the step, by signature), and the event of its last run.
#[derive(Default)]
struct KeyState {
    arena: Arena,
    staging: Staging,
    graphs: Vec<PartGraphs>,
    last: Option<cudarc::driver::CudaEvent>,
    /// A run read device data back inside the step: later runs go eagerly.
    uncapturable: bool,
    used: u64,
}

/// The step being recorded.
struct StepRun {
    arena: Arena,
    staging: Staging,
    /// The recording was cut short (a host read inside the step): its ops were issued.
    flushed: bool,
    /// The key's graphs per part, while the step runs; the part being recorded and the ops of
    /// the parts before it; whether a part was captured now, and whether one could not be.
    graphs: Vec<PartGraphs>,
    part: usize,
    ops_before: usize,
    captured: bool,
    uncapturable: bool,
    /// A timed event recorded before the step's first part ([`HostStats::device_span_ns`]).
    started: Option<cudarc::driver::CudaEvent>,
}

/// A part of a recorded step is handed to the device ([`CudaBackend::submit_part`]) once it
/// holds this many ops: small enough that the device starts early (the host records an op in
/// ≈ 1 µs, the device runs one in ≈ 5), large enough that the parts' boundaries (a launch
/// without programmatic overlap, a graph launch) stay few.
const PART_OPS: usize = 128;

/// The first part of a step goes at this many ops (`STRATA_CUDA_PARTS_EARLY`, on): the device
/// waits for the host only until then.
const FIRST_PART_OPS: usize = 32;

thread_local! {
    /// Whether this thread is inside a [`Backend::step`] of the CUDA backend.
    static IN_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Clears [`IN_STEP`] when a step ends (also by an early return).
struct InStep;

impl Drop for InStep {
    fn drop(&mut self) {
        IN_STEP.with(|s| s.set(false));
    }
}

/// Steps of at most this many rows are recorded and replayed as graphs (decode, verify
/// windows, drafts, catch-ups); larger ones (prefill chunks) run eagerly.
const GRAPH_ROWS: usize = 8;
/// Step keys (shape × sequence) whose arenas and graphs are kept.
const GRAPH_KEYS: usize = 48;
/// Graphs kept per key (one per distinct op list: another sequence's buffers, another source
/// of a step's input buffers).
const GRAPHS_PER_KEY: usize = 4;

/// A row-major f32 buffer on the device; `data` may hold more than `rows · cols` values (a
/// truncated temporary keeps its allocation).
pub struct CudaBuf {
    rows: usize,
    cols: usize,
    data: Mem<f32>,
}

impl CudaBuf {
    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

impl DeviceBuf for CudaBuf {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// A step's u32 inputs on the device.
pub struct CudaIds {
    len: usize,
    data: Mem<u32>,
}

impl DeviceIds for CudaIds {
    fn len(&self) -> usize {
        self.len
    }
}

/// A weight on the device in its file format, with an f32 image made on first element-wise use.
pub struct CudaWeight {
    info: TensorInfo,
    ty: GgmlType,
    file: Arc<GgufFile>,
    dev: ManuallyDrop<DevWeight>,
    values: OnceLock<CudaSlice<f32>>,
    /// Host memory the weight's bytes live in when they are not on the device (the PLE table
    /// with `STRATA_CUDA_PLE_HOST=1`): `dev.bytes` is then a view of it, never freed as device
    /// memory.
    host: Option<cudarc::driver::PinnedHostSlice<u8>>,
}

impl Drop for CudaWeight {
    fn drop(&mut self) {
        // SAFETY: `dev` is taken once, here.
        let dev = unsafe { ManuallyDrop::take(&mut self.dev) };
        if self.host.is_some() {
            // A view of host memory: not device memory to free (the host slice frees it).
            std::mem::forget(dev.bytes);
        }
    }
}

/// Whether the PLE n-gram table stays in host memory, read by the gather over the bus
/// (`STRATA_CUDA_PLE_HOST=1`), instead of going to the device with the other weights.
fn ple_host() -> bool {
    static W: OnceLock<bool> = OnceLock::new();
    match PLE_HOST.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => *W.get_or_init(|| crate::device::switch_set("STRATA_CUDA_PLE_HOST")),
    }
}

/// 0: from `STRATA_CUDA_PLE_HOST`; 1: on the device; 2: in host memory ([`set_ple_host`]).
static PLE_HOST: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Overrides `STRATA_CUDA_PLE_HOST` for the models loaded after it in this process (None: the
/// environment's choice), for tests that bind the two placements.
pub fn set_ple_host(on: Option<bool>) {
    let v = match on {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    PLE_HOST.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The PLE n-gram table's tensor (`qwen4exp::weights`).
const PLE_TABLE: &str = "per_layer_token_embd.weight";

impl CudaWeight {
    fn row_len(&self) -> usize {
        self.info.ne(0) as usize
    }
    fn n_rows2(&self) -> usize {
        self.info.ne(1) as usize
    }
    pub fn bytes_on_device(&self) -> usize {
        self.dev.bytes.len() + self.values.get().map_or(0, |v| v.len() * 4)
    }
}

impl DeviceWeight for CudaWeight {
    fn name(&self) -> &str {
        &self.info.name
    }
    fn ty(&self) -> GgmlType {
        self.ty
    }
    fn dims(&self) -> &[u64] {
        &self.info.dims
    }
}

/// Router decisions on the device: `[rows, k]` expert ids and weights in rank order.
pub struct CudaRoutes {
    rows: usize,
    k: usize,
    ids: Mem<i32>,
    wts: Mem<f32>,
}

/// QSA decisions on the device: the query rows' positions and, for an indexed layer, the
/// selected token lists.
pub struct CudaSelection {
    rows: usize,
    pos: Mem<u32>,
    sparse: Option<model::Selection>,
    /// Where the selection buffers go back when dropped (kept for decode shapes).
    cache: Option<(SelectionCache, Vec<usize>)>,
}

type ScratchList<T> = Vec<(Vec<usize>, T)>;
type SelectionCache = Arc<Mutex<ScratchList<model::Selection>>>;

impl Drop for CudaSelection {
    fn drop(&mut self) {
        if let (Some((list, key)), Some(s)) = (self.cache.take(), self.sparse.take()) {
            list.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((key, s));
        }
    }
}

/// A launcher of an element-wise `out = f(a, b)` kernel over `n` values.
type BinaryLauncher = fn(
    &Gpu,
    &CudaSlice<f32>,
    &CudaSlice<f32>,
    &mut CudaSlice<f32>,
    usize,
) -> std::result::Result<(), CudaError>;

/// (rotated dims, θ bits).
type FreqKey = (usize, u32);

/// The CUDA backend over one device.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    ordinal: usize,
    /// The error word kernels set bits in (ERR_CAPACITY, ERR_EXPERT, …).
    err: Mutex<CudaSlice<u32>>,
    /// Inverse rope frequencies per (rot, θ bits), uploaded once.
    freqs: Mutex<Vec<(FreqKey, Arc<CudaSlice<f64>>)>>,
    /// Bytes of weights uploaded.
    weight_bytes: Mutex<usize>,
    /// Weight bytes kept in mapped host memory instead (the PLE table with `ple_host`).
    host_bytes: Mutex<usize>,
    /// Told the bytes of each weight as it is uploaded (a load's progress bar).
    on_upload: Mutex<Option<UploadHook>>,
    /// Scratch kept between steps for the decode and verify shapes (one stream runs the
    /// operations in order, so one scratch serves every layer).
    hc_scratch: Mutex<Vec<(Vec<usize>, model::HcScratch)>>,
    moe_scratch: Mutex<Vec<(Vec<usize>, model::MoeScratch)>>,
    attn_scratch: Mutex<Vec<(Vec<usize>, model::AttnSplitScratch)>>,
    sel_scratch: Arc<Mutex<ScratchList<model::Selection>>>,
    /// Recorded steps: per key, arena, staging and graphs; the step being recorded.
    steps: Mutex<HashMap<StepKey, KeyState>>,
    /// Host time of the recorded steps ([`CudaBackend::take_host_stats`]).
    host: Mutex<HostStats>,
    /// The last recorded step's timed events, until the next step's start is known.
    prev_events: Mutex<Option<StepEvents>>,
    cur: Mutex<Option<StepRun>>,
    tick: std::sync::atomic::AtomicU64,
    /// One step at a time (a step's recording is the backend's state).
    step_lock: Mutex<()>,
    /// Whether small steps are recorded and replayed as graphs (`STRATA_CUDA_GRAPHS=0`: no),
    /// read once at start.
    graphs: bool,
    /// The fast prefill (`--prefill fast`, `STRATA_CUDA_FAST_PREFILL=1`): dense products of
    /// many rows by cuBLAS on BF16 images ([`model::blas_applies`]), within a stated tolerance
    /// of the exact kernels instead of their bits. Off: every product is the GEMV's bits.
    fast_prefill: std::sync::atomic::AtomicBool,
    /// Whether a batch of sequences runs as one step (`STRATA_CUDA_BATCH=1`, off by default:
    /// bound for plain rows by `model_gpu`'s batch test, not yet for speculative windows).
    batch: std::sync::atomic::AtomicBool,
}

/// A callback told the bytes of each weight the backend uploads.
pub type UploadHook = Box<dyn Fn(usize) + Send + Sync>;

/// The residual a hyper-connection mix reads: as it is, or after the previous block's combine
/// (`x_s += inj_s · y`), which the mix applies to it first.
enum Resid<'a> {
    Plain(&'a CudaBuf),
    Combine {
        x: &'a mut CudaBuf,
        y: &'a CudaBuf,
        inj: &'a CudaBuf,
    },
}

impl Resid<'_> {
    fn shape(&self) -> (usize, usize) {
        match self {
            Resid::Plain(x) => (x.rows, x.cols),
            Resid::Combine { x, .. } => (x.rows, x.cols),
        }
    }
}

impl CudaBackend {
    /// Opens device `ordinal` (compiling or loading the kernels). Fails with an error naming
    /// what is missing (driver, GPU, NVRTC) and never panics.
    pub fn new(ordinal: usize) -> std::result::Result<CudaBackend, CudaError> {
        let gpu = Gpu::new(ordinal)?;
        let err = gpu.zeros::<u32>(1)?;
        Ok(CudaBackend {
            gpu: Arc::new(gpu),
            ordinal,
            err: Mutex::new(err),
            freqs: Mutex::new(Vec::new()),
            weight_bytes: Mutex::new(0),
            host_bytes: Mutex::new(0),
            on_upload: Mutex::new(None),
            hc_scratch: Mutex::new(Vec::new()),
            moe_scratch: Mutex::new(Vec::new()),
            attn_scratch: Mutex::new(Vec::new()),
            sel_scratch: Arc::new(Mutex::new(Vec::new())),
            steps: Mutex::new(HashMap::new()),
            host: Mutex::new(HostStats::default()),
            prev_events: Mutex::new(None),
            cur: Mutex::new(None),
            tick: std::sync::atomic::AtomicU64::new(0),
            step_lock: Mutex::new(()),
            graphs: crate::device::switch_on("STRATA_CUDA_GRAPHS"),
            fast_prefill: std::sync::atomic::AtomicBool::new(crate::device::switch_set(
                "STRATA_CUDA_FAST_PREFILL",
            )),
            batch: std::sync::atomic::AtomicBool::new(crate::device::switch_set(
                "STRATA_CUDA_BATCH",
            )),
        })
    }

    /// Turns the fast prefill on or off (see `fast_prefill`); on needs cuBLAS, and says so
    /// by name when it cannot be loaded.
    pub fn set_fast_prefill(&self, on: bool) -> std::result::Result<(), CudaError> {
        if on {
            // cuBLAS is loaded and its handle made now, not inside the first prompt.
            self.gpu.with_blas(|_| Ok(()))?;
        }
        self.fast_prefill
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether a batch of several sequences runs as one step (see `batch`); off: each
    /// sequence's rows are a step of their own (the same bits, the solo graphs).
    pub fn set_batches_sequences(&self, on: bool) {
        self.batch.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the fast prefill is on.
    pub fn fast_prefill(&self) -> bool {
        self.fast_prefill.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether `w`'s product of `rows` rows goes to cuBLAS (the fast prefill on, the shape one
    /// it takes, not inside a recorded step).
    fn blas_for(&self, w: &CudaWeight, rows: usize) -> bool {
        model::blas_now(&self.gpu, self.fast_prefill(), &w.dev, rows)
    }

    /// The activation format `w`'s product of `rows` rows reads: BF16 for a cuBLAS product,
    /// else the weight's paired format.
    fn act_for(&self, w: &CudaWeight, rows: usize) -> Result<ActFmt> {
        if self.blas_for(w, rows) {
            Ok(ActFmt::Bf16)
        } else {
            w.dev.act().map_err(dev)
        }
    }

    /// Sets (or clears) the callback told the bytes of each weight as it is uploaded.
    pub fn on_upload(&self, f: Option<UploadHook>) {
        *self.on_upload.lock().unwrap_or_else(|p| p.into_inner()) = f;
    }

    /// Launches one part's op list: the graph captured earlier from an equal list (signature
    /// `sig`), or a new capture (`captured`); a list the driver will not capture is issued op
    /// by op (`uncapturable`: the key's later steps run eagerly).
    fn launch_part(
        &self,
        graphs: &mut Vec<PartGraphs>,
        part: usize,
        sig: Vec<u64>,
        ops: &[record::Op],
        captured: &mut bool,
        uncapturable: &mut bool,
    ) -> Result<()> {
        if graphs.len() <= part {
            graphs.resize_with(part + 1, Vec::new);
        }
        let list = &mut graphs[part];
        if let Some(i) = list.iter().position(|(k, _)| *k == sig) {
            return list[i].1.launch().map_err(dev);
        }
        match self.gpu.capture_ops(ops) {
            Ok(g) => {
                *captured = true;
                let out = g.launch().map_err(dev);
                if list.len() >= GRAPHS_PER_KEY {
                    list.remove(0);
                }
                list.push((sig, g));
                out
            }
            // A list the driver would not capture still runs, op by op.
            Err(_) => {
                *uncapturable = true;
                record::issue(ops, self.gpu.stream(), self.gpu.pdl).map_err(dev)
            }
        }
    }

    /// Records the step's end event and, with the step before it, adds a (span, gap) pair to
    /// the stats once the device has passed this step's start (never waiting for it).
    fn time_step(&self, started: Option<cudarc::driver::CudaEvent>, ok: bool) {
        let mut prev = self.prev_events.lock().unwrap_or_else(|p| p.into_inner());
        let now = match (started, ok) {
            (Some(start), true) => self
                .gpu
                .timed_event()
                .ok()
                .map(|end| StepEvents { start, end }),
            _ => None,
        };
        if let (Some(p), Some(n)) = (prev.as_ref(), now.as_ref()) {
            if n.start.is_complete() {
                if let (Ok(span), Ok(gap)) =
                    (p.start.elapsed_ms(&p.end), p.end.elapsed_ms(&n.start))
                {
                    let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
                    // A process that never takes its stats (a server) keeps a bounded sample.
                    if h.device_span_ns.len() < TIMED_PAIRS_KEPT {
                        h.timed += 1;
                        h.device_span_ns.push((f64::from(span) * 1e6) as u64);
                        h.device_gap_ns.push((f64::from(gap.max(0.0)) * 1e6) as u64);
                    }
                }
            }
        }
        *prev = now;
    }

    /// The host time of the recorded steps since the last call, and zeroes it.
    pub fn take_host_stats(&self) -> HostStats {
        std::mem::take(&mut *self.host.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes of weights uploaded so far (file formats plus f32 images).
    /// Weight bytes kept in mapped host memory (`STRATA_CUDA_PLE_HOST=1`: the PLE table).
    pub fn host_weight_bytes(&self) -> usize {
        *self.host_bytes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn weight_bytes(&self) -> usize {
        *self.weight_bytes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        cudarc::driver::result::mem_get_info()
            .map_err(|e| EngineError::Input(format!("CUDA: cuMemGetInfo failed: {e}")))
    }

    fn err_word(&self) -> MutexGuard<'_, CudaSlice<u32>> {
        self.err.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads (and clears) the error word: a set bit is an error naming what went wrong.
    fn check_err(&self) -> Result<()> {
        self.flush()?;
        let mut e = self.err_word();
        let v = self.gpu.download(&*e).map_err(dev)?;
        if v.first().copied().unwrap_or(0) == 0 {
            return Ok(());
        }
        self.gpu.write(&mut e, &[0u32]).map_err(dev)?;
        let bits = v[0];
        let mut what = Vec::new();
        if bits & ERR_CAPACITY != 0 {
            what.push("a position, block or selection past a store's capacity");
        }
        if bits & ERR_EXPERT != 0 {
            what.push("an expert id outside the layer's experts");
        }
        if bits & ERR_NAN_LOGIT != 0 {
            what.push("a NaN logit where a greedy pick refuses one");
        }
        if bits & !(ERR_CAPACITY | ERR_EXPERT | ERR_NAN_LOGIT) != 0 {
            what.push("an id outside its table");
        }
        Err(EngineError::Input(format!(
            "CUDA: a kernel met {} (error word {bits:#x})",
            what.join(" and ")
        )))
    }

    /// An output buffer of `n` values: from the step's arena while a step is recorded, else
    /// owned. Every operation's kernels write all of it before it is read.
    fn mem<T: DeviceRepr>(&self, n: usize) -> Result<Mem<T>> {
        let bytes = n.max(1) * std::mem::size_of::<T>();
        let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(run) = cur.as_mut() {
            let (block, ptr) = run
                .arena
                .take(&self.gpu, bytes)
                .map_err(|e| self.oom(bytes, e))?;
            // SAFETY: `ptr` is `bytes` of the arena block, which the view keeps alive.
            let s = unsafe { self.gpu.stream().upgrade_device_ptr::<T>(ptr, n.max(1)) };
            return Ok(Mem {
                s: ManuallyDrop::new(s),
                arena: Some(block),
            });
        }
        drop(cur);
        Ok(Mem::owned(
            self.gpu
                .alloc_uninit::<T>(n)
                .map_err(|e| self.oom(bytes, e))?,
        ))
    }

    fn alloc(&self, n: usize) -> Result<Mem<f32>> {
        self.mem::<f32>(n)
    }

    fn alloc_u8(&self, n: usize) -> Result<Mem<u8>> {
        self.mem::<u8>(n)
    }

    /// A zeroed buffer of `n` values (a recorded memset inside a recorded step).
    fn mem_zeroed<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<Mem<T>> {
        if self.cur.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            return Ok(Mem::owned(
                self.gpu
                    .zeros::<T>(n)
                    .map_err(|e| self.oom(n * std::mem::size_of::<T>(), e))?,
            ));
        }
        let mut m = self.mem::<T>(n)?;
        let bytes = n.max(1) * std::mem::size_of::<T>();
        let dst = record::addr_mut(&mut m, self.gpu.stream());
        if let Some(op) = self.gpu.record(record::Op::Zero { dst, bytes }) {
            record::issue(&[op], self.gpu.stream(), false).map_err(dev)?;
        }
        Ok(m)
    }

    /// `bytes` bytes from `src` to `dst` on the device (a recorded copy inside a recorded step).
    fn copy_dev(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if let Some(op) = self.gpu.record(record::Op::CopyDtoD { dst, src, bytes }) {
            record::issue(&[op], self.gpu.stream(), false).map_err(dev)?;
        }
        Ok(())
    }

    /// Host values to a new device buffer: through the step's pinned staging while a step is
    /// recorded (the copy is one of the step's ops), else a plain copy.
    fn upload_mem<T: DeviceRepr + Copy>(&self, data: &[T]) -> Result<Mem<T>> {
        let bytes = std::mem::size_of_val(data);
        let recording = self.gpu.recording();
        let in_step = self.cur.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        if !in_step {
            let s = if data.is_empty() {
                self.gpu.alloc_uninit::<T>(1)
            } else {
                self.gpu.upload(data)
            }
            .map_err(|e| self.oom(bytes, e))?;
            return Ok(Mem::owned(s));
        }
        let mut m = self.mem::<T>(data.len())?;
        if bytes == 0 {
            return Ok(m);
        }
        if recording {
            let host = {
                let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
                let run = cur
                    .as_mut()
                    .ok_or_else(|| EngineError::Input("CUDA: no step".into()))?;
                run.staging.take(&self.gpu, bytes).map_err(dev)?
            };
            // SAFETY: `host` holds `bytes` bytes of pinned staging that no copy is reading
            // (the step waited for its previous run before recording).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, host, bytes) };
            let dst = record::addr_mut(&mut m, self.gpu.stream());
            let op = record::Op::CopyHtoD {
                dst,
                src: host,
                bytes,
            };
            if let Some(op) = self.gpu.record(op) {
                record::issue(&[op], self.gpu.stream(), false).map_err(dev)?;
            }
        } else {
            self.gpu.write(&mut m, data).map_err(dev)?;
        }
        Ok(m)
    }

    /// A host read inside a recorded step: the ops so far are issued, the rest of the step runs
    /// eagerly, and the key is not recorded again.
    fn flush(&self) -> Result<()> {
        if let Some(ops) = self.gpu.take_recording() {
            record::issue(&ops, self.gpu.stream(), self.gpu.pdl).map_err(dev)?;
            if let Some(run) = self.cur.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                run.flushed = true;
            }
        }
        Ok(())
    }

    /// A zeroed buffer (recurrent states start at zero; stores are read only where written,
    /// but zeroed all the same so a stray read sees zeros, not old data).
    fn zeroed(&self, rows: usize, cols: usize) -> Result<CudaBuf> {
        Ok(CudaBuf {
            rows,
            cols,
            data: self.mem_zeroed::<f32>(rows * cols)?,
        })
    }

    /// A scratch of `T` for `key` from the cache (decode and verify shapes only: a prefill's
    /// scratch is large and its shapes vary), or a new one.
    fn take_scratch<T>(
        list: &Mutex<Vec<(Vec<usize>, T)>>,
        key: &[usize],
        make: impl FnOnce() -> std::result::Result<T, CudaError>,
    ) -> Result<T> {
        let mut l = list.lock().unwrap_or_else(|p| p.into_inner());
        match l.iter().position(|(k, _)| k == key) {
            Some(i) => Ok(l.swap_remove(i).1),
            None => {
                drop(l);
                make().map_err(dev)
            }
        }
    }

    fn put_scratch<T>(list: &Mutex<Vec<(Vec<usize>, T)>>, key: Vec<usize>, rows: usize, s: T) {
        if rows <= SCRATCH_CACHE_ROWS {
            list.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((key, s));
        }
    }

    fn oom(&self, bytes: usize, e: CudaError) -> EngineError {
        match self.mem_info() {
            Ok((free, total)) => EngineError::Input(format!(
                "CUDA: cannot allocate {:.1} MiB on device {} ({:.1} of {:.1} GiB free): {e}",
                bytes as f64 / (1 << 20) as f64,
                self.ordinal,
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            )),
            Err(_) => dev(e),
        }
    }

    fn buf(&self, rows: usize, cols: usize) -> Result<CudaBuf> {
        Ok(CudaBuf {
            rows,
            cols,
            data: self.alloc(rows * cols)?,
        })
    }

    fn freqs(&self, rot: usize, theta: f32) -> Result<Arc<CudaSlice<f64>>> {
        let key = (rot, theta.to_bits());
        let mut f = self.freqs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, s)) = f.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(s));
        }
        self.flush()?;
        let s = Arc::new(
            self.gpu
                .upload(&model::rope_freqs(rot, theta))
                .map_err(dev)?,
        );
        f.push((key, Arc::clone(&s)));
        Ok(s)
    }

    /// The f32 image of a weight (dequantized on the host once, then kept on the device).
    fn values<'a>(&self, w: &'a CudaWeight) -> Result<&'a CudaSlice<f32>> {
        if let Some(v) = w.values.get() {
            return Ok(v);
        }
        let n = usize::try_from(w.info.n_elements)
            .map_err(|_| shape("weight", format!("{}: too many elements", w.info.name)))?;
        self.flush()?;
        let mut host = vec![0f32; n];
        strata_quant::dequantize(w.ty, w.file.tensor_data(&w.info)?, &mut host)?;
        let d = self.gpu.upload(&host).map_err(|e| self.oom(n * 4, e))?;
        *self.weight_bytes.lock().unwrap_or_else(|p| p.into_inner()) += n * 4;
        Ok(w.values.get_or_init(|| d))
    }

    fn same_shape(op: &'static str, a: &CudaBuf, b: &CudaBuf) -> Result<()> {
        if a.rows != b.rows || a.cols != b.cols {
            return Err(shape(
                op,
                format!("{}×{} vs {}×{}", a.rows, a.cols, b.rows, b.cols),
            ));
        }
        Ok(())
    }

    fn check_matmul(w: &CudaWeight, x: &CudaBuf) -> Result<()> {
        if w.info.dims.len() > 2 || x.cols != w.row_len() {
            return Err(shape(
                "matmul",
                format!(
                    "{}: rows of {} against weight {:?}",
                    w.info.name, x.cols, w.info.dims
                ),
            ));
        }
        Ok(())
    }

    /// `x`'s rows in `w`'s paired activation format.
    fn prepare(&self, w: &CudaWeight, x: &CudaBuf) -> Result<(ActFmt, Mem<u8>)> {
        let f = self.act_for(w, x.rows)?;
        let rb = f.row_bytes(x.cols).ok_or_else(|| {
            shape(
                "matmul",
                format!("rows of {} are not whole {} blocks", x.cols, f.name()),
            )
        })?;
        let mut out = self.alloc_u8(x.rows * rb)?;
        if x.rows > 0 {
            if f == ActFmt::Bf16 && w.dev.act().map_err(dev)? != ActFmt::Bf16 {
                ops::xprep(&self.gpu, "optimized", &x.data, &mut out, x.rows, x.cols, f)
                    .map_err(dev)?;
            } else {
                model::prepare(&self.gpu, &w.dev, &x.data, x.rows, &mut out).map_err(dev)?;
            }
        }
        Ok((f, out))
    }

    /// F32/BF16 weights whose rows are not whole 32-element units: products by the generic
    /// kernel straight from the f32 activations.
    fn odd_float(w: &CudaWeight) -> bool {
        matches!(w.ty, GgmlType::F32 | GgmlType::BF16) && !w.row_len().is_multiple_of(32)
    }

    fn matmul_odd(&self, w: &CudaWeight, x: &CudaBuf) -> Result<CudaBuf> {
        let rows = w.n_rows2();
        let mut y = self.buf(x.rows, rows)?;
        if x.rows == 0 || rows == 0 {
            return Ok(y);
        }
        let (ri, ki, ti) = (
            rows as i32,
            w.row_len() as i32,
            (w.ty == GgmlType::BF16) as i32,
        );
        let grid = cudarc::driver::LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, x.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        kernel!(
            self.gpu,
            "elem",
            "matmul_float_any",
            grid,
            [&w.dev.bytes, &*x.data, &mut *y.data, &ri, &ki, &ti]
        )
        .map_err(dev)?;
        Ok(y)
    }

    fn product(&self, w: &CudaWeight, xq: &CudaSlice<u8>, rows: usize) -> Result<CudaBuf> {
        let mut y = self.buf(rows, w.n_rows2())?;
        if rows > 0 {
            model::product(&self.gpu, &w.dev, xq, rows, &mut y.data).map_err(dev)?;
        }
        Ok(y)
    }

    /// [`Self::product`] from an image in format `f` (from [`Self::act_for`]): by cuBLAS when
    /// the fast prefill takes it, else the exact kernels.
    fn product_from(
        &self,
        w: &CudaWeight,
        f: ActFmt,
        xq: &CudaSlice<u8>,
        rows: usize,
    ) -> Result<CudaBuf> {
        if !self.blas_for(w, rows) {
            return self.product(w, xq, rows);
        }
        if f != ActFmt::Bf16 {
            return Err(shape(
                "matmul",
                format!("{}: a cuBLAS product of a {} image", w.info.name, f.name()),
            ));
        }
        let mut y = self.buf(rows, w.n_rows2())?;
        model::matmul_blas(&self.gpu, &w.dev, xq, rows, &mut y.data).map_err(dev)?;
        Ok(y)
    }

    fn ids_of(&self, ids: &[u32]) -> Result<CudaIds> {
        Ok(CudaIds {
            len: ids.len(),
            data: self.upload_mem(ids)?,
        })
    }

    /// The first `len` of `ids` for a buffer that only reads them while `ids` is unchanged (a
    /// selection's positions): a second view where they live in a step's arena (no copy op in
    /// the step; the block lives as long as either view), else a copy.
    fn ids_view(&self, ids: &Mem<u32>, len: usize) -> Result<Mem<u32>> {
        let Some(block) = &ids.arena else {
            return self.copy_ids(ids, 0, len);
        };
        if len > ids.len() {
            return Err(shape("ids_view", format!("{len} of {} ids", ids.len())));
        }
        let ptr = record::addr(&ids.s, self.gpu.stream());
        // SAFETY: `ptr` is `len` ids of the arena block, which the view keeps alive; the view
        // frees nothing (`Mem::drop` leaks arena views).
        let s = unsafe { self.gpu.stream().upgrade_device_ptr::<u32>(ptr, len.max(1)) };
        Ok(Mem {
            s: ManuallyDrop::new(s),
            arena: Some(Arc::clone(block)),
        })
    }

    fn copy_ids(&self, ids: &CudaSlice<u32>, start: usize, len: usize) -> Result<Mem<u32>> {
        let mut out = self.mem::<u32>(len)?;
        let st = self.gpu.stream();
        let (dst, src) = (record::addr_mut(&mut out, st), record::addr(ids, st));
        self.copy_dev(dst, src + 4 * start as u64, 4 * len)?;
        Ok(out)
    }

    /// `f(a, b)` element-wise into a fresh buffer (one of model.rs's binary launchers).
    fn binary(
        &self,
        op: &'static str,
        f: BinaryLauncher,
        a: &CudaBuf,
        b: &CudaBuf,
    ) -> Result<CudaBuf> {
        Self::same_shape(op, a, b)?;
        let mut out = self.buf(a.rows, a.cols)?;
        f(&self.gpu, &a.data, &b.data, &mut out.data, a.len()).map_err(dev)?;
        Ok(out)
    }

    /// The generic hyper-connection mix (formats the fused launcher does not take).
    /// The routed experts' scratch for `rows` rows of `k` slots (taken from the cache; put it
    /// back with its key).
    fn expert_scratch(
        &self,
        devs: &model::ExpertsDev<'_>,
        rows: usize,
        k: usize,
    ) -> Result<(Vec<usize>, model::MoeScratch)> {
        let key = vec![
            rows,
            k,
            devs.gate.rows,
            devs.gate.k,
            devs.down.rows,
            devs.gate.n_expert,
            devs.gate.act_row_bytes().map_err(dev)?,
            devs.up.act_row_bytes().map_err(dev)?,
            devs.down.act_row_bytes().map_err(dev)?,
        ];
        let s = Self::take_scratch(&self.moe_scratch, &key, || {
            model::MoeScratch::new(&self.gpu, devs, rows, k)
        })?;
        Ok((key, s))
    }

    /// The index of each row's largest logit by the device's pick (sample.cu pick_rows, ties
    /// to the lower index); `nan_err`: a NaN logit is an error (reported with the ids'
    /// download), else never chosen.
    fn pick_on_device(&self, logits: &CudaBuf, nan_err: bool) -> Result<CudaIds> {
        if logits.cols == 0 {
            return Err(EngineError::Input("pick: no logits".to_string()));
        }
        let mut out = CudaIds {
            len: logits.rows,
            data: self.mem::<u32>(logits.rows)?,
        };
        let mut err = self.err_word();
        model::pick_rows(
            &self.gpu,
            &logits.data,
            logits.rows,
            logits.cols,
            nan_err,
            &mut out.data,
            &mut err,
        )
        .map_err(dev)?;
        Ok(out)
    }

    /// The activation formats the products of `ws` read (odd float weights read `x` itself).
    fn formats_of(&self, ws: &[&CudaWeight], x: &CudaBuf) -> Result<Vec<ActFmt>> {
        let mut fmts = Vec::new();
        for w in ws {
            Self::check_matmul(w, x)?;
            if Self::odd_float(w) {
                continue;
            }
            let f = self.act_for(w, x.rows)?;
            if !fmts.contains(&f) {
                fmts.push(f);
            }
        }
        Ok(fmts)
    }

    /// The activation images of `x` in `fmts`: BF16, Q8_0 and Q8_K together in one launch
    /// (each image xprep's bits), F32 (and a lone format) by xprep.
    fn images(&self, x: &CudaBuf, fmts: &[ActFmt]) -> Result<Vec<(ActFmt, Mem<u8>)>> {
        let n = x.cols;
        let mut out = Vec::with_capacity(fmts.len());
        for &f in fmts {
            let rb = f.row_bytes(n).ok_or_else(|| {
                shape(
                    "matmul",
                    format!("rows of {n} are not whole {} blocks", f.name()),
                )
            })?;
            out.push((f, self.alloc_u8(x.rows * rb)?));
        }
        if x.rows == 0 {
            return Ok(out);
        }
        let multi = |f: &ActFmt| matches!(f, ActFmt::Bf16 | ActFmt::Q8_0 | ActFmt::Q8K);
        if out.iter().filter(|(f, _)| multi(f)).count() >= 2 {
            let mut slots: [Option<&mut CudaSlice<u8>>; 3] = [None, None, None];
            for (f, m) in out.iter_mut() {
                let i = match f {
                    ActFmt::Bf16 => 0,
                    ActFmt::Q8_0 => 1,
                    ActFmt::Q8K => 2,
                    ActFmt::F32 => continue,
                };
                slots[i] = Some(&mut **m);
            }
            let [b, q, k] = slots;
            model::prepare_multi(&self.gpu, &x.data, x.rows, n, b, q, k).map_err(dev)?;
            for (f, m) in out.iter_mut().filter(|(f, _)| !multi(f)) {
                ops::xprep(&self.gpu, "optimized", &x.data, m, x.rows, n, *f).map_err(dev)?;
            }
        } else {
            for (f, m) in out.iter_mut() {
                ops::xprep(&self.gpu, "optimized", &x.data, m, x.rows, n, *f).map_err(dev)?;
            }
        }
        Ok(out)
    }

    /// The products of `ws` with `x` from its images: weights of one format and row length
    /// that run the unit-parallel product share one launch (up to four).
    fn products_on(
        &self,
        ws: &[&CudaWeight],
        x: &CudaBuf,
        imgs: &[(ActFmt, Mem<u8>)],
    ) -> Result<Vec<CudaBuf>> {
        let n = ws.len();
        let mut ys: Vec<Option<CudaBuf>> = (0..n).map(|_| None).collect();
        let mut plan: Vec<Option<usize>> = vec![None; n];
        for (j, w) in ws.iter().enumerate() {
            if Self::odd_float(w) {
                ys[j] = Some(self.matmul_odd(w, x)?);
                continue;
            }
            let f = self.act_for(w, x.rows)?;
            plan[j] = Some(
                imgs.iter()
                    .position(|(p, _)| *p == f)
                    .ok_or_else(|| shape("matmul", format!("no {} image", f.name())))?,
            );
        }
        let shared = |j: usize| model::units_preferred(&ws[j].dev, x.rows);
        for j in 0..n {
            let (Some(i), None) = (plan[j], &ys[j]) else {
                continue;
            };
            let group: Vec<usize> = if shared(j) {
                (j..n)
                    .filter(|&m| {
                        plan[m] == Some(i)
                            && ys[m].is_none()
                            && ws[m].dev.ty == ws[j].dev.ty
                            && ws[m].dev.k == ws[j].dev.k
                            && shared(m)
                    })
                    .take(4)
                    .collect()
            } else {
                vec![j]
            };
            if group.len() == 1 {
                ys[j] = Some(self.product_from(ws[j], imgs[i].0, &imgs[i].1, x.rows)?);
                continue;
            }
            let mut outs = group
                .iter()
                .map(|&m| self.buf(x.rows, ws[m].n_rows2()))
                .collect::<Result<Vec<_>>>()?;
            {
                let gw: Vec<&model::DevWeight> = group.iter().map(|&m| &*ws[m].dev).collect();
                let mut gy: Vec<&mut CudaSlice<f32>> =
                    outs.iter_mut().map(|o| &mut *o.data).collect();
                model::product_units(&self.gpu, &gw, &mut gy, &imgs[i].1, x.rows).map_err(dev)?;
            }
            for (&m, o) in group.iter().zip(outs) {
                ys[m] = Some(o);
            }
        }
        ys.into_iter()
            .map(|y| y.ok_or_else(|| shape("matmuls", "a product left out".into())))
            .collect()
    }

    /// The mix of [`Qwen4expOps::hc_mix`], of `x` as it is or after the previous block's
    /// combine (fused into the mix's first launch where the fused mix applies).
    fn hc_mix_on(
        &self,
        hc: &HcWeights<'_, CudaWeight>,
        x: Resid<'_>,
    ) -> Result<(CudaBuf, Option<CudaBuf>)> {
        let (rows, cols) = x.shape();
        let s = hc.streams;
        if s == 0 || !cols.is_multiple_of(s) {
            return Err(shape("hc_mix", format!("rows of {cols} in {s} streams")));
        }
        let h = cols / s;
        // The multi-launch mix takes a BF16 up weight (its activation rounding is fused), an
        // inject weight sharing the down weight's activation image, and whole-unit rows.
        let launcher = hc.up.ty == GgmlType::BF16
            && hc
                .inject
                .is_none_or(|wi| wi.dev.act().ok() == hc.down.dev.act().ok())
            && [Some(hc.down), Some(hc.up), hc.inject]
                .into_iter()
                .flatten()
                .all(|w| !Self::odd_float(w) && w.info.dims.len() == 2);
        let norm = self.values(hc.norm)?;
        let devs = model::HcDev {
            norm,
            down: &hc.down.dev,
            up: &hc.up.dev,
            inject: hc.inject.map(|w| &*w.dev),
            streams: s,
            h,
            eps: hc.eps,
            fast: self.fast_prefill(),
        };
        let fused = launcher && model::hc_fused_applies(&devs, rows);
        // A combine that does not fuse runs first, on its own.
        let x = match x {
            Resid::Combine { x, y, inj } if !fused => {
                self.hc_combine(x, y, Some(inj))?;
                Resid::Plain(x)
            }
            x => x,
        };
        if !launcher {
            return match x {
                Resid::Plain(x) => self.hc_mix_composed(hc, x, h),
                Resid::Combine { .. } => Err(shape("hc_mix", "an unfused combine".into())),
            };
        }
        let mut u = self.buf(rows, h)?;
        let mut inj = match hc.inject {
            Some(_) => Some(self.buf(rows, s)?),
            None => None,
        };
        if rows > 0 {
            let key = vec![
                rows,
                cols,
                hc.down.dev.rows,
                hc.down.dev.act_row_bytes().map_err(dev)?,
                hc.up.dev.act_row_bytes().map_err(dev)?,
            ];
            let mut scratch = Self::take_scratch(&self.hc_scratch, &key, || {
                model::HcScratch::new(&self.gpu, &devs, rows)
            })?;
            let inj_out = inj.as_mut().map(|b| &mut *b.data);
            match (fused, x) {
                (true, x) => {
                    let input = match x {
                        Resid::Plain(x) => model::MixInput::Plain(&x.data),
                        Resid::Combine { x, y, inj } => model::MixInput::Combine {
                            x: &mut x.data,
                            y: &y.data,
                            inj: &inj.data,
                        },
                    };
                    model::hc_mix_fused(
                        &self.gpu,
                        &devs,
                        input,
                        rows,
                        &mut scratch,
                        &mut u.data,
                        inj_out,
                    )
                }
                (false, Resid::Plain(x)) => model::hc_mix(
                    &self.gpu,
                    &devs,
                    &x.data,
                    rows,
                    &mut scratch,
                    &mut u.data,
                    inj_out,
                ),
                (false, Resid::Combine { .. }) => {
                    return Err(shape("hc_mix", "an unfused combine".into()))
                }
            }
            .map_err(dev)?;
            Self::put_scratch(&self.hc_scratch, key, rows, scratch);
        }
        Ok((u, inj))
    }

    fn hc_mix_composed(
        &self,
        hc: &HcWeights<'_, CudaWeight>,
        x: &CudaBuf,
        h: usize,
    ) -> Result<(CudaBuf, Option<CudaBuf>)> {
        let s = hc.streams;
        let xn = self.rms_norm(x, hc.norm, h, hc.eps)?;
        let inv_s = 1.0 / s as f32;
        let a = self.matmul(hc.down, &xn)?;
        let mut act = self.buf(a.rows, a.cols)?;
        let n = a.len() as u64;
        if n > 0 {
            kernel!(
                self.gpu,
                "elem",
                "hc_act_f32",
                cfg((a.len().div_ceil(256)).clamp(1, 1 << 16) as u32, 256),
                [&*a.data, &mut *act.data, &n, &inv_s]
            )
            .map_err(dev)?;
        }
        let g = self.matmul(hc.up, &act)?;
        Self::same_shape("hc_mix (up)", &g, &xn)?;
        let mut u = self.buf(x.rows, h)?;
        if x.rows > 0 {
            let (ri, hi, si) = (x.rows as i32, h as i32, s as i32);
            kernel!(
                self.gpu,
                "elem",
                "hc_u_f32",
                cfg((x.rows * h).div_ceil(256).clamp(1, 1 << 16) as u32, 256),
                [&*g.data, &*xn.data, &mut *u.data, &ri, &hi, &si, &inv_s]
            )
            .map_err(dev)?;
        }
        let inj = match hc.inject {
            Some(wi) => {
                let mut inj = self.matmul(wi, &xn)?;
                if inj.cols != s {
                    return Err(shape(
                        "hc_mix",
                        format!(
                            "{}: {} inject weights for {s} streams",
                            wi.info.name, inj.cols
                        ),
                    ));
                }
                let ni = inj.len() as u64;
                if ni > 0 {
                    let grid = cfg(inj.len().div_ceil(256).clamp(1, 1 << 16) as u32, 256);
                    kernel!(
                        self.gpu,
                        "elem",
                        "hc_inj_f32",
                        grid,
                        [&mut *inj.data, &ni, &inv_s]
                    )
                    .map_err(dev)?;
                }
                Some(inj)
            }
            None => None,
        };
        Ok((u, inj))
    }
}

impl Backend for CudaBackend {
    fn batches_sequences(&self) -> bool {
        self.batch.load(std::sync::atomic::Ordering::Relaxed)
    }

    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Ids = CudaIds;
    type Routes = CudaRoutes;
    type Images = ();

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_memory_used(&self) -> Option<u64> {
        self.mem_info()
            .ok()
            .map(|(free, total)| (total - free) as u64)
    }

    fn supports(&self, ty: GgmlType, usage: Usage) -> bool {
        match usage {
            Usage::MatMul => model::has_products(ty) && ActFmt::for_weight(ty).is_some(),
            Usage::Rows | Usage::Values => strata_quant::format_fns(ty).dequantize.is_some(),
        }
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> Result<CudaWeight> {
        let ty = file.tensor_type(info)?;
        let bytes = file.tensor_data(info)?;
        let k = info.ne(0) as usize;
        let rows = if info.dims.len() >= 2 {
            info.ne(1) as usize
        } else {
            1
        };
        let n_expert = if info.dims.len() >= 3 {
            info.ne(2) as usize
        } else {
            1
        };
        let named = |e: CudaError| EngineError::Input(format!("CUDA: weight '{}': {e}", info.name));
        if info.name == PLE_TABLE && ple_host() {
            let (host, view) = self.gpu.map_host(bytes).map_err(named)?;
            let dw = DevWeight::over(ty, view, bytes.len(), rows, k, n_expert);
            let w = CudaWeight {
                info: info.clone(),
                ty,
                file: Arc::clone(file),
                dev: ManuallyDrop::new(match dw {
                    Ok(d) => d,
                    Err(e) => {
                        // Forget nothing half-made: the view goes with the host memory.
                        return Err(named(e));
                    }
                }),
                values: OnceLock::new(),
                host: Some(host),
            };
            *self.host_bytes.lock().unwrap_or_else(|p| p.into_inner()) += bytes.len();
            return Ok(w);
        }
        let dw =
            DevWeight::upload(&self.gpu, ty, bytes, rows, k, n_expert).map_err(|e| match e {
                CudaError::Driver { .. } => self.oom(bytes.len(), e),
                e => named(e),
            })?;
        *self.weight_bytes.lock().unwrap_or_else(|p| p.into_inner()) += bytes.len();
        if let Some(f) = self
            .on_upload
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            f(bytes.len());
        }
        Ok(CudaWeight {
            info: info.clone(),
            ty,
            file: Arc::clone(file),
            dev: ManuallyDrop::new(dw),
            values: OnceLock::new(),
            host: None,
        })
    }

    /// Steps of up to [`GRAPH_ROWS`] rows are recorded: their launches, copies and input
    /// uploads become an op list (temporaries from the key's arena, inputs through its pinned
    /// staging), which replays a graph captured earlier from the same list or is captured now.
    /// Larger steps, nested steps and keys that read device data inside run eagerly.
    fn step<R: Send>(&self, key: StepKey, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        if key.rows > GRAPH_ROWS
            || IN_STEP.with(|s| s.get())
            || self.gpu.profiling()
            || !self.graphs
        {
            // Prefill chunks, a step inside a step (recorded into the outer one when it is
            // recorded), profiles (events around every launch) and STRATA_CUDA_GRAPHS=0 run
            // eagerly.
            return f();
        }
        // Steps from several threads take turns: a step's recording is the backend's state.
        let _one = self.step_lock.lock().unwrap_or_else(|p| p.into_inner());
        IN_STEP.with(|s| s.set(true));
        let _reset = InStep;
        let mut st = {
            let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
            if steps.get(&key).is_some_and(|k| k.uncapturable) {
                drop(steps);
                return f();
            }
            if !steps.contains_key(&key) && steps.len() >= GRAPH_KEYS {
                // The least recently used key goes (views of its arena keep their blocks).
                if let Some(old) = steps.iter().min_by_key(|(_, v)| v.used).map(|(k, _)| *k) {
                    steps.remove(&old);
                }
            }
            steps.remove(&key).unwrap_or_default()
        };
        st.used = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The staging is rewritten below: the key's last run must have read it.
        if let Some(e) = st.last.take() {
            e.synchronize()
                .map_err(|e| dev(crate::device::drv("cuEventSynchronize")(e)))?;
        }
        st.arena.reset();
        st.staging.reset();
        *self.cur.lock().unwrap_or_else(|p| p.into_inner()) = Some(StepRun {
            arena: std::mem::take(&mut st.arena),
            staging: std::mem::take(&mut st.staging),
            flushed: false,
            graphs: std::mem::take(&mut st.graphs),
            part: 0,
            ops_before: 0,
            captured: false,
            uncapturable: false,
            started: None,
        });
        self.gpu.start_recording();
        let t0 = std::time::Instant::now();
        let r = f();
        let ops = self.gpu.take_recording();
        let t1 = std::time::Instant::now();
        let mut t2 = t1;
        let run = self.cur.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (mut n_parts, mut n_ops, mut captured) = (1, 0, false);
        let mut started = None;
        if let Some(run) = run {
            started = run.started;
            st.arena = run.arena;
            st.staging = run.staging;
            st.graphs = run.graphs;
            st.uncapturable |= run.flushed || run.uncapturable;
            n_parts = run.part + 1;
            n_ops = run.ops_before;
            captured = run.captured;
        }
        n_ops += ops.as_ref().map_or(0, Vec::len);
        let done = match (&r, ops) {
            // A failed body issues nothing more: its recorded ops are dropped (parts handed to
            // the device before the failure ran, as an eager body's ops would have).
            (Err(_), _) | (_, None) => Ok(()),
            (Ok(_), Some(ops)) => {
                let sig = record::signature(&ops);
                t2 = std::time::Instant::now();
                if started.is_none() {
                    started = self.gpu.timed_event().ok();
                }
                let (mut c, mut u) = (false, false);
                let out = self.launch_part(&mut st.graphs, n_parts - 1, sig, &ops, &mut c, &mut u);
                captured |= c;
                st.uncapturable |= u;
                out
            }
        };
        let t3 = std::time::Instant::now();
        {
            let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
            h.steps += 1;
            h.parts += n_parts as u64;
            h.captures += u64::from(captured);
            h.ops += n_ops as u64;
            h.body_ns += (t1 - t0).as_nanos() as u64;
            h.signature_ns += (t2 - t1).as_nanos() as u64;
            h.launch_ns += (t3 - t2).as_nanos() as u64;
        }
        st.last = self.gpu.event().ok();
        self.time_step(started, done.is_ok() && r.is_ok());
        self.steps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, st);
        done?;
        r
    }

    /// Hands the ops recorded so far to the device as a part of their own once they are
    /// `PART_OPS` (128) or more (`FIRST_PART_OPS`, 32, for a step's first part;
    /// `STRATA_CUDA_PARTS=0`: one graph a step): the device runs the
    /// layers recorded so far while the host records the rest, instead of waiting for the whole
    /// body. Each part is a graph captured once and replayed (per part, by signature); parts
    /// run in stream order, so the results are the same bits.
    fn submit_part(&self) -> Result<()> {
        if !crate::device::switch_on("STRATA_CUDA_PARTS") {
            return Ok(());
        }
        let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        let Some(run) = cur.as_mut() else {
            return Ok(());
        };
        let first = run.part == 0 && crate::device::switch_on("STRATA_CUDA_PARTS_EARLY");
        if run.flushed || self.gpu.recorded() < if first { FIRST_PART_OPS } else { PART_OPS } {
            return Ok(());
        }
        let Some(ops) = self.gpu.take_recording() else {
            return Ok(());
        };
        self.gpu.start_recording();
        let sig = record::signature(&ops);
        if run.part == 0 {
            run.started = self.gpu.timed_event().ok();
        }
        let (mut c, mut u) = (false, false);
        let out = self.launch_part(&mut run.graphs, run.part, sig, &ops, &mut c, &mut u);
        run.part += 1;
        run.ops_before += ops.len();
        run.captured |= c;
        run.uncapturable |= u;
        out
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CudaBuf> {
        self.zeroed(rows, cols)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaBuf> {
        if data.len() != rows * cols {
            return Err(shape(
                "upload",
                format!("{} values for {rows}×{cols}", data.len()),
            ));
        }
        let data = self.upload_mem(data)?;
        Ok(CudaBuf { rows, cols, data })
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<CudaIds> {
        self.ids_of(ids)
    }

    fn ids_range(&self, ids: &CudaIds, start: usize, len: usize) -> Result<CudaIds> {
        if start + len > ids.len {
            return Err(shape(
                "ids_range",
                format!("{start}..{} of {} ids", start + len, ids.len),
            ));
        }
        Ok(CudaIds {
            len,
            data: self.copy_ids(&ids.data, start, len)?,
        })
    }

    fn download(&self, x: &CudaBuf) -> Result<Vec<f32>> {
        self.flush()?;
        // The wait for the work before it, then the copy alone (timed apart for the stats).
        self.gpu.sync().map_err(dev)?;
        let t0 = std::time::Instant::now();
        let c0 = self.gpu.copy_out_ns();
        let v = self.gpu.download_f32(&x.data, x.len()).map_err(dev)?;
        {
            let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
            h.downloads += 1;
            h.download_ns += t0.elapsed().as_nanos() as u64;
            h.copy_out_ns += self.gpu.copy_out_ns() - c0;
        }
        self.check_err()?;
        Ok(v)
    }

    fn download_ids(&self, ids: &CudaIds) -> Result<Vec<u32>> {
        self.flush()?;
        let v = if ids.len == 0 {
            Vec::new()
        } else {
            self.gpu
                .stream()
                .clone_dtoh(&ids.data.slice(0..ids.len))
                .map_err(|e| dev(crate::device::drv("cuMemcpyDtoH")(e)))?
        };
        self.check_err()?;
        Ok(v)
    }

    fn copy(&self, x: &CudaBuf) -> Result<CudaBuf> {
        let mut out = self.buf(x.rows, x.cols)?;
        self.copy_into(&mut out, x)?;
        Ok(out)
    }

    fn copy_into(&self, dst: &mut CudaBuf, src: &CudaBuf) -> Result<()> {
        Self::same_shape("copy_into", dst, src)?;
        let st = self.gpu.stream();
        let (d, s) = (
            record::addr_mut(&mut *dst.data, st),
            record::addr(&*src.data, st),
        );
        self.copy_dev(d, s, 4 * src.len())
    }

    fn reshape(&self, x: CudaBuf, rows: usize, cols: usize) -> Result<CudaBuf> {
        if rows * cols != x.len() {
            return Err(shape(
                "reshape",
                format!("{}×{} as {rows}×{cols}", x.rows, x.cols),
            ));
        }
        let mut x = x;
        x.rows = rows;
        x.cols = cols;
        Ok(x)
    }

    fn truncate_rows(&self, dst: &mut CudaBuf, rows: usize) -> Result<()> {
        if rows > dst.rows {
            return Err(shape(
                "truncate_rows",
                format!("{rows} rows asked of a buffer of {}", dst.rows),
            ));
        }
        dst.rows = rows;
        Ok(())
    }

    fn slice_cols(&self, x: &CudaBuf, start: usize, len: usize) -> Result<CudaBuf> {
        if start + len > x.cols {
            return Err(shape(
                "slice_cols",
                format!("columns {start}..{} of rows of {}", start + len, x.cols),
            ));
        }
        let mut out = self.buf(x.rows, len)?;
        let n = (x.rows * len) as u64;
        if n > 0 {
            let (c, s, l) = (x.cols as i32, start as i32, len as i32);
            kernel!(
                self.gpu,
                "elem",
                "slice_cols_f32",
                cfg((n as usize).div_ceil(256).clamp(1, 1 << 16) as u32, 256),
                [&*x.data, &mut *out.data, &n, &c, &s, &l]
            )
            .map_err(dev)?;
        }
        Ok(out)
    }

    fn deinterleave(&self, x: &CudaBuf, chunk: usize, parts: usize) -> Result<Vec<CudaBuf>> {
        if chunk == 0 || parts == 0 || !x.cols.is_multiple_of(chunk * parts) {
            return Err(shape(
                "deinterleave",
                format!("rows of {} into {parts} parts of {chunk}", x.cols),
            ));
        }
        let n = x.len();
        let mut all = self.alloc(n)?;
        if n > 0 {
            model::deinterleave(&self.gpu, &x.data, &mut all, x.rows, x.cols, chunk, parts)
                .map_err(dev)?;
        }
        let part = n / parts;
        let mut outs = Vec::with_capacity(parts);
        let base = record::addr(&all, self.gpu.stream());
        for p in 0..parts {
            let mut o = self.buf(x.rows, x.cols / parts)?;
            let dst = record::addr_mut(&mut *o.data, self.gpu.stream());
            self.copy_dev(dst, base + (4 * p * part) as u64, 4 * part)?;
            outs.push(o);
        }
        Ok(outs)
    }

    fn store(&self, cap: usize, cols: usize) -> Result<CudaBuf> {
        self.zeroed(cap, cols)
    }

    fn write_rows(&self, store: &mut CudaBuf, x: &CudaBuf, at: &CudaIds) -> Result<()> {
        self.write_kv(store, x, at, KvType::F32)
    }

    fn write_kv(&self, cache: &mut CudaBuf, x: &CudaBuf, at: &CudaIds, kv: KvType) -> Result<()> {
        if cache.cols != x.cols || at.len != x.rows {
            return Err(shape(
                "write_rows",
                format!(
                    "{} rows of {} at {} positions into rows of {}",
                    x.rows, x.cols, at.len, cache.cols
                ),
            ));
        }
        if x.rows == 0 || x.cols == 0 {
            return Ok(());
        }
        let (cap, ci, fi) = (cache.rows as u32, x.cols as i32, (kv == KvType::F16) as i32);
        let mut err = self.err_word();
        kernel!(
            self.gpu,
            "attn",
            "store_rows_f32",
            cfg(x.rows as u32, 256),
            [
                &mut *cache.data,
                &cap,
                &*x.data,
                &*at.data,
                &ci,
                &fi,
                &mut *err
            ]
        )
        .map_err(dev)
    }

    fn add_assign(&self, x: &mut CudaBuf, y: &CudaBuf) -> Result<()> {
        Self::same_shape("add_assign", x, y)?;
        let n = x.len();
        if n > 0 {
            model::add_assign(&self.gpu, &mut x.data, &y.data, n).map_err(dev)?;
        }
        Ok(())
    }

    fn embed_rows(&self, table: &CudaWeight, ids: &CudaIds, copies: usize) -> Result<CudaBuf> {
        let k = table.row_len();
        let rows = table.info.n_rows() as usize;
        let n = ids.len;
        let mut out = self.buf(n, k * copies)?;
        if n == 0 || k == 0 || copies == 0 {
            return Ok(out);
        }
        let kernel = strata_engine::kernels::embed::REPORT_FORMATS.contains(&table.ty)
            && k.is_multiple_of(32);
        if kernel {
            let mut e = if copies == 1 {
                None
            } else {
                Some(self.alloc(n * k)?)
            };
            let dst: &mut CudaSlice<f32> = match e.as_mut() {
                Some(e) => e,
                None => &mut out.data,
            };
            ops::embed(
                &self.gpu,
                "optimized",
                table.ty,
                &table.dev.bytes,
                rows,
                &ids.data,
                n,
                dst,
                k,
            )
            .map_err(dev)?;
            if let Some(e) = e {
                model::repeat_rows(&self.gpu, &e, &mut out.data, n, k, copies).map_err(dev)?;
            }
        } else {
            let t = self.values(table)?;
            let (nr, nn, c, cp) = (
                rows as u32,
                (n * k * copies) as u64,
                k as i32,
                copies as i32,
            );
            kernel!(
                self.gpu,
                "elem",
                "gather_rows_f32",
                cfg((nn as usize).div_ceil(256).clamp(1, 1 << 16) as u32, 256),
                [t, &nr, &*ids.data, &mut *out.data, &nn, &c, &cp]
            )
            .map_err(dev)?;
        }
        Ok(out)
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaBuf) -> Result<CudaBuf> {
        Self::check_matmul(w, x)?;
        if Self::odd_float(w) {
            return self.matmul_odd(w, x);
        }
        let (f, xq) = self.prepare(w, x)?;
        self.product_from(w, f, &xq, x.rows)
    }

    /// One activation image per format for all the products of `x`; weights of one format and
    /// row length that run the unit-parallel product share one launch.
    fn matmuls<const N: usize>(&self, ws: [&CudaWeight; N], x: &CudaBuf) -> Result<[CudaBuf; N]> {
        let fmts = self.formats_of(&ws, x)?;
        let imgs = self.images(x, &fmts)?;
        self.products_on(&ws, x, &imgs)?
            .try_into()
            .map_err(|_| shape("matmuls", "product count".into()))
    }

    fn matmul_rows(&self, w: &CudaWeight, rows: &CudaIds, x: &CudaBuf) -> Result<CudaBuf> {
        // The full product, then the wanted columns: each entry is the full product's bits.
        let y = self.matmul(w, x)?;
        let mut out = self.buf(x.rows, rows.len)?;
        let n = (x.rows * rows.len) as u64;
        if n > 0 {
            let (c, m) = (y.cols as i32, rows.len as i32);
            let mut err = self.err_word();
            kernel!(
                self.gpu,
                "elem",
                "gather_cols_f32",
                cfg((n as usize).div_ceil(256).clamp(1, 1 << 16) as u32, 256),
                [&*y.data, &*rows.data, &mut *out.data, &n, &c, &m, &mut *err]
            )
            .map_err(dev)?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaBuf, w: &CudaWeight, group: usize, eps: f32) -> Result<CudaBuf> {
        let wv = self.values(w)?;
        let mut out = self.buf(x.rows, x.cols)?;
        if x.rows == 0 {
            return Ok(out);
        }
        // The weight's image holds exactly its elements (the launcher checks the count).
        model::rms_norm(
            &self.gpu,
            &x.data,
            wv,
            &mut out.data,
            x.rows,
            x.cols,
            group,
            eps,
        )
        .map_err(dev)?;
        Ok(out)
    }

    fn rope_neox(
        &self,
        x: &mut CudaBuf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &CudaIds,
    ) -> Result<()> {
        if positions.len != x.rows {
            return Err(shape(
                "rope_neox",
                format!("{} positions for {} rows", positions.len, x.rows),
            ));
        }
        if x.rows == 0 || rot == 0 {
            return Ok(());
        }
        let f = self.freqs(rot, theta)?;
        let (rows, cols) = (x.rows, x.cols);
        model::rope_neox(
            &self.gpu,
            &mut x.data,
            &positions.data,
            &f,
            rows,
            cols,
            head_dim,
            rot,
        )
        .map_err(dev)
    }

    fn mul_sigmoid(&self, x: &CudaBuf, gate: &CudaBuf) -> Result<CudaBuf> {
        self.binary("mul_sigmoid", model::mul_sigmoid, x, gate)
    }

    /// The catalogue's `route` kernel (optimized where the shape has one).
    fn route(&self, logits: &CudaBuf, k: usize) -> Result<CudaRoutes> {
        if k == 0 || k > logits.cols {
            return Err(shape(
                "route",
                format!("top {k} of {} experts", logits.cols),
            ));
        }
        let n = logits.rows;
        let mut ids = self.mem::<i32>(n * k)?;
        let mut wts = self.alloc(n * k)?;
        if n > 0 {
            ops::route(
                &self.gpu,
                "optimized",
                &logits.data,
                &mut ids,
                &mut wts,
                n,
                logits.cols,
                k,
            )
            .map_err(dev)?;
        }
        Ok(CudaRoutes {
            rows: n,
            k,
            ids,
            wts,
        })
    }

    fn moe_experts(
        &self,
        ex: &ExpertWeights<'_, CudaWeight>,
        x: &CudaBuf,
        routes: &CudaRoutes,
    ) -> Result<CudaBuf> {
        let h = x.cols;
        if routes.rows != x.rows
            || ex.gate.row_len() != h
            || ex.up.row_len() != h
            || ex.down.n_rows2() != h
            || ex.down.row_len() != ex.gate.n_rows2()
        {
            return Err(shape(
                "moe_experts",
                format!(
                    "{} rows of {h} for experts {:?}/{:?}/{:?}",
                    x.rows, ex.gate.info.dims, ex.up.info.dims, ex.down.info.dims
                ),
            ));
        }
        let mut out = self.buf(x.rows, h)?;
        if x.rows == 0 {
            return Ok(out);
        }
        if [ex.gate, ex.up, ex.down].iter().any(|w| Self::odd_float(w)) {
            return self.moe_experts_odd(ex, x, routes, out);
        }
        let devs = model::ExpertsDev {
            gate: &ex.gate.dev,
            up: &ex.up.dev,
            down: &ex.down.dev,
        };
        let (key, mut s) = self.expert_scratch(&devs, x.rows, routes.k)?;
        let mut err = self.err_word();
        let grouped = x.rows > MOE_GROUPED_ABOVE;
        if !grouped && model::experts_fuse(&devs, routes.k) {
            model::moe_experts_fused(
                &self.gpu,
                &devs,
                &x.data,
                &routes.ids,
                &routes.wts,
                &mut s,
                None,
                &mut out.data,
                &mut err,
            )
        } else {
            model::moe_experts(
                &self.gpu,
                &devs,
                &x.data,
                &routes.ids,
                &routes.wts,
                &mut s,
                grouped,
                &mut out.data,
                &mut err,
            )
        }
        .map_err(dev)?;
        drop(err);
        Self::put_scratch(&self.moe_scratch, key, x.rows, s);
        Ok(out)
    }

    fn swiglu(&self, g: &CudaBuf, u: &CudaBuf) -> Result<CudaBuf> {
        self.binary("swiglu", model::swiglu, g, u)
    }

    fn add_sigmoid_gated(&self, y: &mut CudaBuf, x: &CudaBuf, gate: &CudaBuf) -> Result<()> {
        Self::same_shape("add_sigmoid_gated", y, x)?;
        if gate.rows != y.rows || gate.cols != 1 {
            return Err(shape(
                "add_sigmoid_gated",
                format!("gate {}×{}", gate.rows, gate.cols),
            ));
        }
        let (rows, cols) = (y.rows, y.cols);
        if rows * cols == 0 {
            return Ok(());
        }
        model::add_sigmoid_gated(&self.gpu, &mut y.data, &x.data, &gate.data, rows, cols)
            .map_err(dev)
    }

    /// Greedy picks on the device (only the ids cross); seeded draws take the host's path.
    fn pick_rows(
        &self,
        logits: &CudaBuf,
        pick: DevicePick,
        first_position: u64,
    ) -> Result<CudaIds> {
        match pick {
            DevicePick::Greedy => self.pick_on_device(logits, true),
            DevicePick::Draw { .. } => {
                strata_engine::backend::pick_rows_on_host(self, logits, pick, first_position)
            }
        }
    }

    fn pick_draft(&self, logits: &CudaBuf) -> Result<CudaIds> {
        self.pick_on_device(logits, false)
    }

    /// The draft pick mapped to token ids on the device (sample.cu `pick_draft_map`): only
    /// the ids exist, on the device, for the next draft step to embed.
    fn pick_draft_mapped(
        &self,
        logits: &CudaBuf,
        map: Option<&DraftMap<CudaIds>>,
    ) -> Result<DraftPick<CudaIds>> {
        let (rows, nv) = (logits.rows, logits.cols);
        if nv == 0 {
            return Err(EngineError::Input("pick: no draft logits".to_string()));
        }
        if let Some(m) = map {
            if m.dev.len != nv {
                return Err(shape(
                    "pick_draft_mapped",
                    format!("{} map ids for draft rows of {nv}", m.dev.len),
                ));
            }
        }
        let mut out = CudaIds {
            len: rows,
            data: self.mem::<u32>(rows)?,
        };
        let mut vals = CudaIds {
            len: rows,
            data: self.mem::<u32>(rows)?,
        };
        if rows == 0 {
            return Ok(DraftPick {
                ids: out,
                values: vals,
            });
        }
        let nvi = i32::try_from(nv)
            .map_err(|_| shape("pick_draft_mapped", format!("{nv} draft logits")))?;
        let mapped = map.is_some() as i32;
        // Without a map the kernel reads none: any id buffer stands in for the pointer.
        let none = self.err_word();
        let table: &CudaSlice<u32> = match map {
            Some(m) => &m.dev.data,
            None => &none,
        };
        kernel!(
            self.gpu,
            "sample",
            "pick_draft_map",
            cfg(rows as u32, 1024),
            [
                &*logits.data,
                &nvi,
                table,
                &mapped,
                &mut *out.data,
                &mut *vals.data
            ]
        )
        .map_err(dev)?;
        drop(none);
        Ok(DraftPick {
            ids: out,
            values: vals,
        })
    }

    /// Slop mode 1 on a draft row in place (sample.cu `slop_pen_chain`: `slop_pen_opt` with the
    /// previous draft's token read from the device), the tables uploaded once
    /// ([`DraftSlop::new`], which validated them), the state carried on the device.
    fn slop_pen_draft(
        &self,
        logits: &mut CudaBuf,
        slop: &DraftSlop<CudaIds, CudaBuf>,
        prev: Option<&CudaIds>,
        state: &CudaIds,
    ) -> Result<CudaIds> {
        let k = "slop_pen_draft";
        if logits.rows != 1 || logits.cols != slop.n_draft {
            return Err(shape(
                k,
                format!(
                    "logits {}×{} for one row of {} draft logits",
                    logits.rows, logits.cols, slop.n_draft
                ),
            ));
        }
        let len = strata_engine::kernels::slop::STATE_LEN;
        if state.len != len {
            return Err(shape(
                k,
                format!("a state of {} values, expected {len}", state.len),
            ));
        }
        let prev = prev.unwrap_or(&slop.no_prev);
        if prev.len != 1 {
            return Err(shape(
                k,
                format!("{} previous tokens, expected one", prev.len),
            ));
        }
        let t = &slop.tables;
        let i = |what: &str, n: usize| {
            i32::try_from(n).map_err(|_| shape("slop_pen_draft", format!("{n} {what}")))
        };
        let nvi = i("draft logits", slop.n_draft)?;
        let (n_pen, n_nl, n_bl, n_ph) = (
            i("penalties", t.pen_ids.len())?,
            i("newline tokens", t.newline.len())?,
            i("blank tokens", t.blank.len())?,
            i("phrases", t.n_phrases())?,
        );
        let (n_banned, mode) = (0i32, i32::from(slop.compiled.mode()));
        let mut out = CudaIds {
            len,
            data: self.mem::<u32>(len)?,
        };
        kernel!(
            self.gpu,
            "sample",
            "slop_pen_chain",
            cfg(1, 256),
            [
                &mut *logits.data,
                &nvi,
                &*slop.inverse.data,
                &*slop.pen_ids.data,
                &*slop.pen_vals.data,
                &n_pen,
                &*slop.newline.data,
                &n_nl,
                &*slop.blank.data,
                &n_bl,
                &*slop.phrase_tokens.data,
                &*slop.phrase_start.data,
                &*slop.phrase_pen.data,
                &n_ph,
                &*slop.none.data,
                &n_banned,
                &t.cap_newline,
                &t.cap_blank,
                &mode,
                &*prev.data,
                &*state.data,
                &mut *out.data
            ]
        )
        .map_err(dev)?;
        Ok(out)
    }

    /// A device copy into `dst` at `at` (a recorded copy inside a recorded step).
    fn write_ids(&self, dst: &mut CudaIds, at: usize, src: &CudaIds) -> Result<()> {
        if at + src.len > dst.len {
            return Err(shape(
                "write_ids",
                format!("{} ids at {at} of {}", src.len, dst.len),
            ));
        }
        let st = self.gpu.stream();
        let (d, s) = (
            record::addr_mut(&mut *dst.data, st),
            record::addr(&*src.data, st),
        );
        self.copy_dev(d + 4 * at as u64, s, 4 * src.len)
    }

    fn add_bias(&self, x: &mut CudaBuf, b: &CudaWeight) -> Result<()> {
        let bv = self.values(b)?;
        let (rows, cols) = (x.rows, x.cols);
        if rows == 0 {
            return Ok(());
        }
        model::add_bias(&self.gpu, &mut x.data, bv, rows, cols).map_err(dev)
    }

    fn attend_causal(
        &self,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        positions: &CudaIds,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<CudaBuf> {
        self.attend_over(
            q,
            k_cache,
            v_cache,
            &positions.data,
            positions.len,
            None,
            dims,
            kv,
            None,
        )
    }
}

impl CudaBackend {
    /// One expert product over every (row, slot) pair by the generic float kernel.
    fn moe_pairs_odd(
        &self,
        w: &CudaWeight,
        x: &CudaBuf,
        x_per_slot: bool,
        routes: &CudaRoutes,
    ) -> Result<CudaBuf> {
        let pairs = routes.rows * routes.k;
        let rows = w.n_rows2();
        let mut y = self.buf(pairs, rows)?;
        let slab = (rows * w.row_len()) as u64;
        let (ne, xps, ks) = (w.info.ne(2) as i32, x_per_slot as i32, routes.k as i32);
        let (ri, ki, ti) = (
            rows as i32,
            w.row_len() as i32,
            (w.ty == GgmlType::BF16) as i32,
        );
        let grid = cudarc::driver::LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, pairs as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut err = self.err_word();
        kernel!(
            self.gpu,
            "elem",
            "moe_float_any",
            grid,
            [
                &w.dev.bytes,
                &slab,
                &*routes.ids,
                &ne,
                &*x.data,
                &xps,
                &ks,
                &mut *y.data,
                &ri,
                &ki,
                &ti,
                &mut *err
            ]
        )
        .map_err(dev)?;
        Ok(y)
    }

    /// Routed experts whose float rows are not whole units: gate/up/down by the generic
    /// kernel, the same combine.
    fn moe_experts_odd(
        &self,
        ex: &ExpertWeights<'_, CudaWeight>,
        x: &CudaBuf,
        routes: &CudaRoutes,
        mut out: CudaBuf,
    ) -> Result<CudaBuf> {
        if [ex.gate, ex.up, ex.down]
            .iter()
            .any(|w| !matches!(w.ty, GgmlType::F32 | GgmlType::BF16))
        {
            return Err(shape(
                "moe_experts",
                format!(
                    "{}: float and block-quantized experts mixed with rows of {}",
                    ex.gate.info.name,
                    ex.gate.row_len()
                ),
            ));
        }
        let g = self.moe_pairs_odd(ex.gate, x, false, routes)?;
        let u = self.moe_pairs_odd(ex.up, x, false, routes)?;
        let act = self.swiglu(&g, &u)?;
        let y = self.moe_pairs_odd(ex.down, &act, true, routes)?;
        model::moe_combine(
            &self.gpu,
            &y.data,
            &routes.wts,
            &mut out.data,
            routes.rows,
            routes.k,
            x.cols,
        )
        .map_err(dev)?;
        Ok(out)
    }

    /// Attention over a selection (checked against the caches), gated or not.
    #[allow(clippy::too_many_arguments)]
    fn attend_selected(
        &self,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        sel: &CudaSelection,
        dims: AttnDims,
        kv: KvType,
        gate: Option<&CudaBuf>,
    ) -> Result<CudaBuf> {
        if let Some(s) = &sel.sparse {
            if s.cap > k_cache.rows {
                return Err(shape(
                    "attend",
                    format!(
                        "a selection over {} tokens for caches of {}",
                        s.cap, k_cache.rows
                    ),
                ));
            }
        }
        self.attend_over(
            q,
            k_cache,
            v_cache,
            &sel.pos,
            sel.rows,
            sel.sparse.as_ref(),
            dims,
            kv,
            gate,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_over(
        &self,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        pos: &CudaSlice<u32>,
        n_pos: usize,
        sel: Option<&model::Selection>,
        dims: AttnDims,
        kv: KvType,
        gate: Option<&CudaBuf>,
    ) -> Result<CudaBuf> {
        let kvc = dims.n_head_kv * dims.head_dim;
        if q.cols != dims.n_head * dims.head_dim
            || k_cache.cols != kvc
            || v_cache.cols != kvc
            || k_cache.rows != v_cache.rows
            || n_pos != q.rows
        {
            return Err(shape(
                "attend",
                format!(
                    "q {}×{}, caches {}×{} / {}×{}, {n_pos} positions, {dims:?}",
                    q.rows, q.cols, k_cache.rows, k_cache.cols, v_cache.rows, v_cache.cols
                ),
            ));
        }
        let mut out = self.buf(q.rows, q.cols)?;
        if q.rows == 0 {
            return Ok(out);
        }
        let cap = k_cache.rows;
        // The split-K form (one block per row, head and 256 tokens) keeps the GPU busy at one
        // row over a long context; it runs for every row count, so a prefill's rows stay the
        // bits of single steps.
        let max_chunks = cap.div_ceil(256).max(1);
        let per_row = dims.n_head * (cap + max_chunks * (2 + dims.head_dim));
        let rows_fit = (ATTN_SCRATCH_FLOATS / per_row.max(1)).clamp(1, q.rows);
        let key = vec![rows_fit, dims.n_head, dims.head_dim, cap];
        let mut scratch = Self::take_scratch(&self.attn_scratch, &key, || {
            model::AttnSplitScratch::new(&self.gpu, rows_fit, dims, cap)
        })?;
        let mut err = self.err_word();
        model::attend_split(
            &self.gpu,
            &q.data,
            &k_cache.data,
            &v_cache.data,
            cap,
            sel,
            pos,
            q.rows,
            dims,
            kv == KvType::F16,
            &mut out.data,
            &mut scratch,
            &mut err,
            gate.map(|g| &*g.data),
        )
        .map_err(dev)?;
        drop(err);
        Self::put_scratch(&self.attn_scratch, key, q.rows, scratch);
        Ok(out)
    }
}

impl Qwen4expOps for CudaBackend {
    type Selection = CudaSelection;

    fn hc_mix(
        &self,
        hc: &HcWeights<'_, CudaWeight>,
        x: &CudaBuf,
    ) -> Result<(CudaBuf, Option<CudaBuf>)> {
        self.hc_mix_on(hc, Resid::Plain(x))
    }

    fn hc_combine_mix(
        &self,
        x: &mut CudaBuf,
        y: &CudaBuf,
        inj: Option<&CudaBuf>,
        hc: &HcWeights<'_, CudaWeight>,
    ) -> Result<(CudaBuf, Option<CudaBuf>)> {
        match inj {
            Some(inj) => self.hc_mix_on(hc, Resid::Combine { x, y, inj }),
            None => {
                self.hc_combine(x, y, None)?;
                self.hc_mix(hc, x)
            }
        }
    }

    /// Decode and verify windows: every product of `u` from one set of images, the router
    /// and the shared expert's gate in one launch, the shared expert's swiglu fused into its
    /// down product's image, the routed experts in two launches with the shared expert's add
    /// in their epilogue (bitwise the composition). Larger batches: the composition.
    fn moe_block(&self, mw: &MoeW<CudaWeight>, u: &CudaBuf, n_used: usize) -> Result<CudaBuf> {
        let rows = u.rows;
        let devs = model::ExpertsDev {
            gate: &mw.gate_exps.dev,
            up: &mw.up_exps.dev,
            down: &mw.down_exps.dev,
        };
        let (h, ffs) = (u.cols, mw.gate_shexp.n_rows2());
        let shapes = mw.gate_exps.row_len() == h
            && mw.up_exps.row_len() == h
            && mw.down_exps.n_rows2() == h
            && mw.down_exps.row_len() == mw.gate_exps.n_rows2()
            && mw.up_shexp.n_rows2() == ffs
            && mw.down_shexp.row_len() == ffs
            && mw.down_shexp.n_rows2() == h
            && mw.shexp_gate.n_rows2() == 1
            && mw.router.n_rows2() == mw.gate_exps.dev.n_expert;
        let weights = [
            &mw.router,
            &mw.gate_shexp,
            &mw.up_shexp,
            &mw.shexp_gate,
            &mw.down_shexp,
            &mw.gate_exps,
            &mw.up_exps,
            &mw.down_exps,
        ];
        let fuse = (1..=MOE_GROUPED_ABOVE).contains(&rows)
            && shapes
            && weights.iter().all(|w| !Self::odd_float(w))
            && n_used > 0
            && n_used <= mw.router.n_rows2()
            && model::experts_fuse(&devs, n_used);
        if !fuse {
            return moe_block_composed(self, mw, u, n_used);
        }
        let front = [&mw.router, &mw.gate_shexp, &mw.up_shexp, &mw.shexp_gate];
        let mut fmts = self.formats_of(&front, u)?;
        let fe = mw.gate_exps.dev.act().map_err(dev)?;
        if !fmts.contains(&fe) {
            fmts.push(fe);
        }
        let imgs = self.images(u, &fmts)?;
        let xg = imgs
            .iter()
            .find(|(f, _)| *f == fe)
            .map(|(_, m)| m)
            .ok_or_else(|| shape("moe_block", "no image for the experts".into()))?;
        let (key, mut s) = self.expert_scratch(&devs, rows, n_used)?;
        let mut out = self.buf(rows, h)?;
        let mut err = self.err_word();
        // The shared expert: its gate and up products for the staged down to finish, or its
        // output (swiglu straight into its down product's image).
        enum Shared {
            Parts(CudaBuf, CudaBuf),
            Out(CudaBuf),
        }
        let (routes, gate, shared) =
            if model::shared_in_down(&self.gpu, &devs, xg, n_used, &mw.down_shexp.dev) {
                // The router and the shared gate, the route, then the shared expert's gate and
                // up products (so the route is settled two waiting launches before the experts).
                let mut ys = self
                    .products_on(&[&mw.router, &mw.shexp_gate], u, &imgs)?
                    .into_iter();
                let (Some(logits), Some(gate)) = (ys.next(), ys.next()) else {
                    return Err(shape("moe_block", "product count".into()));
                };
                let routes = self.route(&logits, n_used)?;
                let mut ys = self
                    .products_on(&[&mw.gate_shexp, &mw.up_shexp], u, &imgs)?
                    .into_iter();
                let (Some(g), Some(up)) = (ys.next(), ys.next()) else {
                    return Err(shape("moe_block", "product count".into()));
                };
                (routes, gate, Shared::Parts(g, up))
            } else {
                let mut ys = self.products_on(&front, u, &imgs)?.into_iter();
                let (Some(logits), Some(g), Some(up), Some(gate)) =
                    (ys.next(), ys.next(), ys.next(), ys.next())
                else {
                    return Err(shape("moe_block", "product count".into()));
                };
                // Route, then swiglu_prepare and the shared down product (one waiting launch
                // each) before the experts.
                let routes = self.route(&logits, n_used)?;
                let fd = mw.down_shexp.dev.act().map_err(dev)?;
                let mut hq =
                    self.alloc_u8(rows * mw.down_shexp.dev.act_row_bytes().map_err(dev)?)?;
                model::swiglu_prepare(&self.gpu, &g.data, &up.data, rows, ffs, fd, &mut hq)
                    .map_err(dev)?;
                (
                    routes,
                    gate,
                    Shared::Out(self.product(&mw.down_shexp, &hq, rows)?),
                )
            };
        let y = match &shared {
            Shared::Parts(g, up) => model::SharedY::Parts {
                g: &g.data,
                u: &up.data,
                down: &mw.down_shexp.dev,
            },
            Shared::Out(y) => model::SharedY::Out(&y.data),
        };
        model::moe_experts_fused_on(
            &self.gpu,
            &devs,
            xg,
            &routes.ids,
            &routes.wts,
            rows,
            n_used,
            &mut s.aq,
            Some(model::SharedAdd {
                y,
                gate: &gate.data,
                settled: true,
            }),
            &mut out.data,
            &mut err,
        )
        .map_err(dev)?;
        drop(err);
        Self::put_scratch(&self.moe_scratch, key, rows, s);
        Ok(out)
    }

    fn hc_combine(&self, x: &mut CudaBuf, y: &CudaBuf, inj: Option<&CudaBuf>) -> Result<()> {
        let h = y.cols;
        if h == 0 || !x.cols.is_multiple_of(h) || x.rows != y.rows {
            return Err(shape(
                "hc_combine",
                format!("x {}×{}, y {}×{}", x.rows, x.cols, y.rows, y.cols),
            ));
        }
        let streams = x.cols / h;
        let rows = x.rows;
        if rows == 0 {
            return Ok(());
        }
        match inj {
            Some(inj) => {
                if inj.rows != rows || inj.cols != streams {
                    return Err(shape(
                        "hc_combine",
                        format!(
                            "{}×{} stream weights for {streams} streams",
                            inj.rows, inj.cols
                        ),
                    ));
                }
                model::hc_combine(&self.gpu, &mut x.data, &y.data, &inj.data, rows, h, streams)
                    .map_err(dev)
            }
            None => {
                // Unit weights: X_s += y for every stream (the MTP head's combine).
                let mut rep = self.alloc(rows * streams * h)?;
                model::repeat_rows(&self.gpu, &y.data, &mut rep, rows, h, streams).map_err(dev)?;
                model::add_assign(&self.gpu, &mut x.data, &rep, rows * streams * h).map_err(dev)
            }
        }
    }

    fn conv1d_silu(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        history: &mut CudaBuf,
        dilation: usize,
    ) -> Result<CudaBuf> {
        let c = x.cols;
        let k = w.row_len();
        if w.n_rows2() != c || history.cols != c || history.rows != (k.max(1) - 1) * dilation {
            return Err(shape(
                "conv1d_silu",
                format!(
                    "{}: kernel {:?} for rows of {c}, history {}×{} (dilation {dilation})",
                    w.info.name, w.info.dims, history.rows, history.cols
                ),
            ));
        }
        let wv = self.values(w)?;
        let mut out = self.buf(x.rows, c)?;
        if x.rows == 0 {
            return Ok(out);
        }
        model::conv1d_silu(
            &self.gpu,
            &x.data,
            wv,
            &mut history.data,
            &mut out.data,
            x.rows,
            c,
            k,
            dilation,
        )
        .map_err(dev)?;
        Ok(out)
    }

    fn gdn_step(
        &self,
        p: &GdnParams<'_, CudaWeight>,
        qkv: &CudaBuf,
        z: &CudaBuf,
        a: &CudaBuf,
        b: &CudaBuf,
        state: &mut CudaBuf,
    ) -> Result<CudaBuf> {
        let d = p.dims;
        let n = qkv.rows;
        if qkv.cols != d.conv_dim()
            || z.cols != d.value_dim()
            || a.cols != d.n_v_heads
            || b.cols != d.n_v_heads
            || z.rows != n
            || a.rows != n
            || b.rows != n
        {
            return Err(shape(
                "gdn_step",
                format!(
                    "qkv {}×{}, z {}×{}, a {}×{}, b {}×{} for {d:?}",
                    qkv.rows, qkv.cols, z.rows, z.cols, a.rows, a.cols, b.rows, b.cols
                ),
            ));
        }
        let devs = model::GdnDev {
            ssm_a: self.values(p.a)?,
            dt_bias: self.values(p.dt_bias)?,
            norm: self.values(p.norm)?,
            dims: d,
            eps: p.eps,
        };
        let mut out = self.buf(n, d.value_dim())?;
        if n == 0 {
            return Ok(out);
        }
        let scan =
            matches!(d.head_k, 32 | 64 | 128) && d.head_v.is_multiple_of(32) && d.head_v <= 256;
        if n > GDN_SCAN_ABOVE && scan {
            let mut s = model::GdnScratch::new(&self.gpu, d, n).map_err(dev)?;
            model::gdn_step_scan(
                &self.gpu,
                &devs,
                &qkv.data,
                &z.data,
                &a.data,
                &b.data,
                &mut state.data,
                &mut out.data,
                n,
                &mut s,
            )
            .map_err(dev)?;
        } else {
            model::gdn_step(
                &self.gpu,
                &devs,
                &qkv.data,
                &z.data,
                &a.data,
                &b.data,
                &mut state.data,
                &mut out.data,
                n,
            )
            .map_err(dev)?;
        }
        Ok(out)
    }

    fn qsa_pool_blocks(
        &self,
        kraw: &CudaBuf,
        positions: &CudaIds,
        ratio: usize,
    ) -> Result<CudaBuf> {
        if ratio == 0 {
            return Err(shape("qsa_pool_blocks", "block size 0".into()));
        }
        let d = kraw.cols;
        let n = positions.len;
        let mut out = self.buf(n, d)?;
        let nn = (n * d) as u64;
        if nn > 0 {
            let (cap, di, ri) = (kraw.rows as u32, d as i32, ratio as i32);
            let mut err = self.err_word();
            kernel!(
                self.gpu,
                "elem",
                "qsa_mean_f32",
                cfg((nn as usize).div_ceil(256).clamp(1, 1 << 16) as u32, 256),
                [
                    &*kraw.data,
                    &cap,
                    &*positions.data,
                    &mut *out.data,
                    &nn,
                    &di,
                    &ri,
                    &mut *err
                ]
            )
            .map_err(dev)?;
        }
        Ok(out)
    }

    fn qsa_select(
        &self,
        qi: &CudaBuf,
        blocks: &CudaBuf,
        positions: &CudaIds,
        sel: QsaSelect,
    ) -> Result<CudaSelection> {
        let d = blocks.cols;
        if d == 0 || !qi.cols.is_multiple_of(d) || positions.len != qi.rows || sel.ratio == 0 {
            return Err(shape(
                "qsa_select",
                format!(
                    "queries {}×{}, blocks of {d}, {} positions, ratio {}",
                    qi.rows, qi.cols, positions.len, sel.ratio
                ),
            ));
        }
        let n = qi.rows;
        // The token capacity the selection indexes: the pooled store is made with as many rows
        // as the token stores (qwen4exp::state::AttnCache), so its row count is that capacity.
        let cap = blocks.rows;
        let skey = vec![
            n.max(1),
            cap,
            sel.ratio,
            sel.budget,
            (sel.rule == strata_engine::QsaRule::LlamaCpp) as usize,
        ];
        let mut s = Self::take_scratch(&self.sel_scratch, &skey, || {
            model::Selection::new(&self.gpu, n.max(1), cap, sel)
        })?;
        if n > 0 {
            let mut err = self.err_word();
            model::qsa_select(
                &self.gpu,
                &qi.data,
                &blocks.data,
                &positions.data,
                n,
                qi.cols / d,
                d,
                sel,
                &mut s,
                &mut err,
            )
            .map_err(dev)?;
        }
        Ok(CudaSelection {
            rows: n,
            pos: self.ids_view(&positions.data, n)?,
            sparse: Some(s),
            cache: (n <= SCRATCH_CACHE_ROWS).then(|| (Arc::clone(&self.sel_scratch), skey)),
        })
    }

    fn select_causal(&self, positions: &CudaIds) -> Result<CudaSelection> {
        Ok(CudaSelection {
            rows: positions.len,
            pos: self.ids_view(&positions.data, positions.len)?,
            sparse: None,
            cache: None,
        })
    }

    fn attend(
        &self,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        sel: &CudaSelection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<CudaBuf> {
        self.attend_selected(q, k_cache, v_cache, sel, dims, kv, None)
    }

    /// Attention whose last pass applies the output gate (mul_sigmoid's bits).
    fn attend_gated(
        &self,
        q: &CudaBuf,
        gate: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        sel: &CudaSelection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<CudaBuf> {
        Self::same_shape("attend_gated", q, gate)?;
        self.attend_selected(q, k_cache, v_cache, sel, dims, kv, Some(gate))
    }

    /// One launch for the rows of a decode step, a verify window or a prefill chunk
    /// (`attn.cu qsa_prep`), bitwise the composition; shapes it does not take, positions that
    /// are not consecutive and `STRATA_CUDA_QSA_PREP=0` run the composition.
    fn qsa_prepare(
        &self,
        w: &QsaPrepW<'_, CudaWeight>,
        x: QsaRows<CudaBuf>,
        inputs: &StepInputs<Self>,
        caches: QsaCaches<'_, CudaBuf>,
    ) -> Result<QsaPrepared<CudaBuf>> {
        let n = x.qg.rows;
        let hd = w.head_dim;
        let hp = inputs.host_positions();
        let consecutive = hp.len() == n && hp.windows(2).all(|p| p[1] == p[0].wrapping_add(1));
        let kvc = x.k.cols;
        let base = n > 0
            && consecutive
            && model::qsa_prep_on()
            && hd > 0
            && hd <= 1024
            && w.rot <= hd
            && w.rot.is_multiple_of(2)
            && x.qg.cols.is_multiple_of(2 * hd)
            && kvc.is_multiple_of(hd)
            && kvc > 0
            && x.k.rows == n
            && x.v.rows == n
            && x.v.cols == kvc
            && caches.k.cols == kvc
            && caches.v.cols == kvc
            && caches.k.rows == caches.v.rows
            && inputs.positions.len == n
            && w.q_norm.info.n_elements == hd as u64
            && w.k_norm.info.n_elements == hd as u64;
        let index_ok = match (&x.index, &w.index, &caches.index) {
            (None, _, _) => true,
            (Some((qi, kraw)), Some(ix), Some((ks, bs))) => {
                let di = ix.head_dim;
                di > 0
                    && di <= 1024
                    && w.rot <= di
                    && ix.ratio > 0
                    && qi.rows == n
                    && kraw.rows == n
                    && qi.cols.is_multiple_of(di)
                    && qi.cols > 0
                    && kraw.cols == di
                    && ks.cols == di
                    && bs.cols == di
                    && ix.q_norm.info.n_elements == di as u64
                    && ix.k_norm.info.n_elements == di as u64
            }
            _ => false,
        };
        if !(base && index_ok) {
            return qsa_prepare_composed(self, w, x, inputs, caches);
        }
        let geom = model::QsaPrepGeom {
            hq: x.qg.cols / (2 * hd),
            hkv: kvc / hd,
            hd,
            hi: match (&x.index, &w.index) {
                (Some((qi, _)), Some(ix)) => qi.cols / ix.head_dim,
                _ => 0,
            },
            di: w.index.as_ref().map_or(0, |ix| ix.head_dim),
            rot: w.rot,
            ratio: w.index.as_ref().map_or(1, |ix| ix.ratio),
            eps: w.eps,
        };
        let f = self.freqs(w.rot, w.theta)?;
        let (wq, wk) = (self.values(w.q_norm)?, self.values(w.k_norm)?);
        let mut q = self.buf(n, x.qg.cols / 2)?;
        let mut gate = self.buf(n, x.qg.cols / 2)?;
        let cap = caches.k.rows;
        let QsaCaches {
            k: kc,
            v: vc,
            index,
        } = caches;
        let mut qi_out = None;
        let ix_dev = match (&x.index, &w.index, index) {
            (Some((qi, kraw)), Some(ix), Some((ks, bs))) => {
                qi_out = Some(self.buf(n, qi.cols)?);
                Some((qi, kraw, ix, ks, bs))
            }
            _ => None,
        };
        let index_dev = match (ix_dev, qi_out.as_mut()) {
            (Some((qi, kraw, ix, ks, bs)), Some(qo)) => Some(model::QsaPrepIndex {
                qi: &qi.data,
                kraw: &kraw.data,
                wiq: self.values(ix.q_norm)?,
                wik: self.values(ix.k_norm)?,
                qi_out: &mut qo.data,
                kraw_cap: ks.rows,
                kraw_store: &mut ks.data,
                blocks_cap: bs.rows,
                blocks: &mut bs.data,
            }),
            _ => None,
        };
        let mut err = self.err_word();
        model::qsa_prep(
            &self.gpu,
            &geom,
            n,
            &x.qg.data,
            &x.k.data,
            &x.v.data,
            wq,
            wk,
            &inputs.positions.data,
            &f,
            &mut q.data,
            &mut gate.data,
            &mut kc.data,
            &mut vc.data,
            cap,
            index_dev,
            &mut err,
        )
        .map_err(dev)?;
        drop(err);
        Ok(QsaPrepared {
            q,
            gate,
            qi: qi_out,
        })
    }

    fn ple_gate(&self, k: &CudaBuf, q: &CudaBuf, v: &CudaBuf, streams: usize) -> Result<CudaBuf> {
        let h = v.cols;
        if k.rows != v.rows || q.rows != v.rows || k.cols != streams * h || q.cols != streams * h {
            return Err(shape(
                "ple_gate",
                format!(
                    "k {}×{}, q {}×{}, v {}×{} for {streams} streams",
                    k.rows, k.cols, q.rows, q.cols, v.rows, v.cols
                ),
            ));
        }
        let mut out = self.buf(v.rows, streams * h)?;
        if v.rows == 0 {
            return Ok(out);
        }
        model::ple_gate(
            &self.gpu,
            &k.data,
            &q.data,
            &v.data,
            &mut out.data,
            v.rows,
            h,
            streams,
        )
        .map_err(dev)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{Bump, ARENA_BLOCK};

    #[test]
    fn the_arena_layout_repeats_after_a_reset_and_keeps_requests_apart() {
        let mut b = Bump::default();
        let reqs = [
            10usize,
            256,
            257,
            ARENA_BLOCK - 1100,
            4096,
            3 * ARENA_BLOCK,
            1,
        ];
        let first: Vec<_> = reqs.iter().map(|&r| b.place(r)).collect();
        // Rounded to 256 bytes, in order, in the first block while it has room.
        assert_eq!(first[0], (0, 0, Some(ARENA_BLOCK)));
        assert_eq!(first[1], (0, 256, None));
        assert_eq!(first[2], (0, 512, None));
        // ARENA_BLOCK − 1,100 rounds to ARENA_BLOCK − 1,024: the rest of block 0, exactly.
        assert_eq!(first[3], (0, 1024, None));
        // Nothing left in block 0: a new block; a huge request gets a block its size.
        assert_eq!(first[4], (1, 0, Some(ARENA_BLOCK)));
        assert_eq!(first[5], (2, 0, Some(3 * ARENA_BLOCK)));
        assert_eq!(first[6], (3, 0, Some(ARENA_BLOCK)));
        // The same requests after a reset: the same places, no new block.
        b.reset();
        let again: Vec<_> = reqs.iter().map(|&r| b.place(r)).collect();
        for (x, y) in first.iter().zip(&again) {
            assert_eq!((x.0, x.1), (y.0, y.1));
            assert_eq!(y.2, None);
        }
        // No two live requests overlap: within a block, places are increasing and disjoint.
        b.reset();
        let mut last: Option<(usize, usize, usize)> = None;
        for &r in &reqs {
            let (blk, off, _) = b.place(r);
            let end = off + r.max(1).div_ceil(256) * 256;
            if let Some((pb, _, pend)) = last {
                assert!(
                    blk > pb || off >= pend,
                    "overlap at block {blk}, offset {off}"
                );
            }
            last = Some((blk, off, end));
        }
    }
}
