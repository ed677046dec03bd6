//! The device: context, stream, compiled modules and their functions, buffers, and timing
//! with events around captured graphs (so host launch overhead stays out of the numbers).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::sys::{
    CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr,
    DriverError, LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::{nvrtc, sources, CudaError};

pub(crate) fn drv(call: &str) -> impl Fn(DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver {
        call: call.to_string(),
        what: e.to_string(),
    }
}

/// Checks that the CUDA driver library can be loaded (without letting cudarc panic).
pub fn ensure_driver() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the candidate library names; no symbol is called.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::DriverMissing(
            "libcuda (the NVIDIA driver) was not found; this machine has no usable NVIDIA GPU"
                .into(),
        ))
    }
}

/// Checks that libcublas (CUDA 13) can be loaded (without letting cudarc panic): the fast
/// prefill's tensor-core products need it.
pub fn ensure_blas() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the candidate library names; no symbol is called.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::BlasMissing(
            "libcublas.so.13 was not found: install the CUDA 13 toolkit's cuBLAS (or the \
             nvidia-cublas wheel and put its lib folder on LD_LIBRARY_PATH), or use \
             --prefill exact"
                .into(),
        ))
    }
}

/// cuBLAS for the fast prefill (docs/CUDA.md, "Fast prefill"): its handle on the device's
/// stream, and the BF16 scratch that dequantized weights go to (grown on demand, one weight at a
/// time, in stream order).
pub struct Blas {
    pub handle: cudarc::cublas::CudaBlas,
    pub scratch: Option<CudaSlice<u16>>,
}

/// The on/off switches of the CUDA backend (each `0` turns a default off, for an A/B;
/// `STRATA_CUDA_TRIGGER_FIRST`, `STRATA_CUDA_PLE_HOST`, `STRATA_CUDA_FAST_PREFILL` and
/// `STRATA_CUDA_BATCH` are off unless `1`).
pub const SWITCHES: [&str; 19] = [
    "STRATA_CUDA_GRAPHS",
    "STRATA_CUDA_PDL",
    "STRATA_CUDA_EXPERTS_WIDE",
    "STRATA_CUDA_Q2T",
    "STRATA_CUDA_HC_UP4",
    "STRATA_CUDA_BF16W",
    "STRATA_CUDA_PINNED",
    "STRATA_CUDA_MOE_STAGE",
    "STRATA_CUDA_MOE_EARLY",
    "STRATA_CUDA_PLE_HOST",
    "STRATA_CUDA_TRIGGER_FIRST",
    "STRATA_CUDA_ATTN_GROUP",
    "STRATA_CUDA_GDN_RING",
    "STRATA_CUDA_CONV_ROWS",
    "STRATA_CUDA_MMQ_Q2T",
    "STRATA_CUDA_MMQ_WIDE",
    "STRATA_CUDA_FAST_PREFILL",
    "STRATA_CUDA_BATCH",
    "STRATA_CUDA_QSA_PREP",
];

/// Whether switch `var` (one of [`SWITCHES`]) is on: every value but `0` (the values were
/// checked by [`check_switches`] when the device opened).
pub fn switch_on(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v.trim() != "0")
}

/// Whether an opt-in switch (one of [`SWITCHES`] that is off by default) is set to `1`.
pub fn switch_set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v.trim() == "1")
}

/// Refuses, before anything is opened, a switch set to anything but unset, empty, 0 or 1
/// (`get` reads a variable), so a mistyped value is an error naming it, never silently "on".
pub fn check_switches(get: impl Fn(&str) -> Option<String>) -> Result<(), CudaError> {
    for var in SWITCHES {
        if let Some(v) = get(var) {
            if !matches!(v.trim(), "" | "0" | "1") {
                return Err(CudaError::Setting { var, value: v });
            }
        }
    }
    Ok(())
}

/// `STRATA_CUDA_L2_AHEAD=MiB`: the L2-ahead branch of recorded steps (off when unset or 0).
pub const L2_AHEAD: &str = "STRATA_CUDA_L2_AHEAD";

/// The L2-ahead window in bytes from `STRATA_CUDA_L2_AHEAD` (`get` reads a variable): unset,
/// empty or 0 is off; 1..=1024 MiB is the window; anything else is an error naming it.
pub fn l2_ahead_setting(get: impl Fn(&str) -> Option<String>) -> Result<Option<u64>, CudaError> {
    let Some(v) = get(L2_AHEAD) else {
        return Ok(None);
    };
    let t = v.trim();
    if t.is_empty() || t == "0" {
        return Ok(None);
    }
    match t.parse::<u64>() {
        Ok(m) if (1..=1024).contains(&m) => Ok(Some(m << 20)),
        _ => Err(CudaError::Number {
            var: L2_AHEAD,
            value: v,
            expected: "0 (off) or a window of 1 to 1024 MiB",
        }),
    }
}

/// The L2-ahead branch (`STRATA_CUDA_L2_AHEAD`): a recorded step's graph gets a second branch,
/// `norm.cu l2_ahead`, that pulls the dense weights the step's kernels will read into L2 while
/// the chain runs, `window` bytes ahead of the kernel in flight. The chain's kernels count
/// themselves past their waits into `ctl[0]` (common.cuh `step_progress`, through each module's
/// `strata_progress`); `ctl[1]` says the chain is done. It moves data into L2 only: the
/// results are unchanged.
struct Ahead {
    window: u64,
    blocks: u32,
    ctl: CudaSlice<u32>,
    side: Arc<CudaStream>,
    /// Dense weights on the device: (address, bytes), sorted by address.
    weights: Mutex<Vec<(u64, u64)>>,
}

/// Dense weights larger than this are not prefetched whole (the LM head, the n-gram table).
const AHEAD_MAX_WEIGHT: u64 = 64 << 20;

/// The prefetch items of an op list: each dense weight that a launch's arguments point into, at
/// its first launch, as (address, bytes, start) with `start` the count of the step's kernels
/// past their waits after which it may be pulled: the earliest at which the items not yet
/// reached by the chain (their launch not yet started), itself included, stay within `window`
/// bytes — and never later than its own launch's predecessor.
pub fn ahead_items(ops: &[crate::record::Op], weights: &[(u64, u64)], window: u64) -> Vec<u64> {
    let launches = ops.iter().filter_map(|op| match op {
        crate::record::Op::Launch { args, .. } => Some(args.as_slice()),
        _ => None,
    });
    ahead_plan(launches, weights, window)
}

/// [`ahead_items`] over the launches' argument lists, in order (copies and memsets are not
/// counted: they do not pass a `grid_dep_sync`).
pub fn ahead_plan<'a>(
    launches: impl Iterator<Item = &'a [crate::record::Arg]>,
    weights: &[(u64, u64)],
    window: u64,
) -> Vec<u64> {
    use crate::record::Arg;
    let mut seen = std::collections::HashSet::new();
    let mut list: Vec<(u64, u64, u32)> = Vec::new();
    let mut li = 0u32;
    for args in launches {
        for a in args {
            let Arg::B8(p) = *a else { continue };
            let i = weights.partition_point(|&(s, _)| s <= p);
            if i == 0 {
                continue;
            }
            let (s, b) = weights[i - 1];
            if p < s + b && seen.insert(s) {
                list.push((s, b, li));
            }
        }
        li += 1;
    }
    // Two pointers over the cumulative bytes: k is the first item that may still be in flight.
    let mut out = Vec::with_capacity(3 * list.len());
    let (mut k, mut in_flight) = (0usize, 0u64);
    for j in 0..list.len() {
        in_flight += list[j].1;
        while k < j && in_flight > window {
            in_flight -= list[k].1;
            k += 1;
        }
        let start = if k == 0 { 0 } else { list[k - 1].2 + 1 };
        out.extend([list[j].0, list[j].1, u64::from(start.min(list[j].2))]);
    }
    out
}

/// How one module was made ready at start.
#[derive(Clone, Debug)]
pub struct ModuleLoad {
    pub module: &'static str,
    pub from_cache: bool,
    pub seconds: f64,
    pub cubin_bytes: usize,
}

/// An initialized device with every kernel module loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub name: String,
    pub arch: (i32, i32),
    pub sms: i32,
    pub l2_bytes: i32,
    /// Whether recorded steps launch their kernels with programmatic stream serialization
    /// (sm_90 and later, unless `STRATA_CUDA_PDL=0`): each kernel starts with
    /// `grid_dep_sync()` (common.cuh), so the next kernel's launch overlaps this one's run.
    pub pdl: bool,
    pub loads: Vec<ModuleLoad>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
    /// Per-launch timing (events around every launch, and the bytes the launch must read
    /// when its launcher said so) while profiling is on.
    profile: Mutex<Option<Vec<Timed>>>,
    /// Whether `profile` is on, read without its lock by [`Gpu::note_bytes`] (which every
    /// product launcher calls, profiling or not).
    profiling_on: std::sync::atomic::AtomicBool,
    /// The bytes the next timed launch must read ([`Gpu::note_bytes`]).
    next_bytes: Mutex<Option<u64>>,
    /// Two page-locked staging buffers for weight uploads ([`Gpu::upload_weights`]), made at
    /// the first large upload.
    staging: Mutex<Option<[cudarc::driver::PinnedHostSlice<u8>; 2]>>,
    /// The ops of the step being recorded (record mode: launches are kept, not issued).
    rec: Mutex<Option<Vec<crate::record::Op>>>,
    /// cuBLAS, made at the first fast-prefill product ([`Gpu::with_blas`]).
    blas: Mutex<Option<Blas>>,
    /// The L2-ahead branch of recorded steps, when `STRATA_CUDA_L2_AHEAD` asks for one.
    ahead: Option<Ahead>,
}

/// One timed launch: its kernel, the events around it, the bytes its launcher stated.
struct Timed {
    name: String,
    start: CudaEvent,
    end: CudaEvent,
    bytes: Option<u64>,
}

/// One kernel's share of a profiled run: launches and device time.
#[derive(Clone, Debug)]
pub struct KernelTime {
    pub name: String,
    pub launches: usize,
    pub us: f64,
    /// The bytes its launches must read (weights and activations), when every launch's
    /// launcher states them ([`Gpu::note_bytes`]); the kernel's floor is these over the copy
    /// bandwidth.
    pub bytes: Option<u64>,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the cache) every module for its
    /// architecture and loads them.
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        check_switches(|v| std::env::var(v).ok())?;
        let window = l2_ahead_setting(|v| std::env::var(v).ok())?;
        ensure_driver()?;
        nvrtc::ensure_nvrtc()?;
        // cudarc panics on a few library-level failures; turn any into an error.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                CudaError::DriverMissing("cudarc panicked while opening the CUDA driver".into())
            })?
            .map_err(drv("cuCtxCreate / cuDevicePrimaryCtxRetain"))?;
        // One stream, no cross-stream tracking: launches carry no extra events.
        // SAFETY: this context is used from one stream only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        let arch = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute(compute capability)"))?;
        let attr = |a| ctx.attribute(a).map_err(drv("cuDeviceGetAttribute"));
        let sms = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let l2_bytes = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
        // Compile (or read from the cache) every module in parallel, then load them in order.
        let built: Vec<Result<(nvrtc::Compiled, f64), CudaError>> = std::thread::scope(|sc| {
            let hs: Vec<_> = sources::MODULES
                .iter()
                .map(|m| {
                    sc.spawn(move || {
                        let t = Instant::now();
                        nvrtc::cached_cubin(m.name, &m.source(), arch)
                            .map(|c| (c, t.elapsed().as_secs_f64()))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CudaError::Nvrtc {
                            module: "?".into(),
                            what: "the compile thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        let mut modules = HashMap::new();
        let mut loads = Vec::new();
        for (m, b) in sources::MODULES.iter().zip(built) {
            let (c, seconds) = b?;
            let module = ctx
                .load_module(Ptx::from_binary(c.cubin.clone()))
                .map_err(|e| CudaError::Driver {
                    call: format!("cuModuleLoadData({}, {})", m.name, c.path.display()),
                    what: e.to_string(),
                })?;
            loads.push(ModuleLoad {
                module: m.name,
                from_cache: c.from_cache,
                seconds,
                cubin_bytes: c.cubin.len(),
            });
            modules.insert(m.name, module);
        }
        let ahead = match window {
            Some(window) => {
                let mut ctl = stream.alloc_zeros::<u32>(2).map_err(drv("cuMemAlloc"))?;
                let at = crate::record::addr_mut(&mut ctl, &stream);
                for (name, m) in &modules {
                    let mut g = m.get_global("strata_progress", &stream).map_err(|e| {
                        CudaError::Driver {
                            call: format!("cuModuleGetGlobal({name}, strata_progress)"),
                            what: e.to_string(),
                        }
                    })?;
                    stream
                        .memcpy_htod(&at.to_le_bytes(), &mut g)
                        .map_err(drv("cuMemcpyHtoD (strata_progress)"))?;
                }
                stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
                Some(Ahead {
                    window,
                    blocks: 16,
                    ctl,
                    side: ctx.new_stream().map_err(drv("cuStreamCreate"))?,
                    weights: Mutex::new(Vec::new()),
                })
            }
            None => None,
        };
        Ok(Gpu {
            ahead,
            ctx,
            stream,
            name,
            arch,
            sms,
            l2_bytes,
            pdl: arch.0 >= 9 && switch_on("STRATA_CUDA_PDL"),
            loads,
            modules,
            funcs: Mutex::new(HashMap::new()),
            profile: Mutex::new(None),
            profiling_on: std::sync::atomic::AtomicBool::new(false),
            next_bytes: Mutex::new(None),
            staging: Mutex::new(None),
            rec: Mutex::new(None),
            blas: Mutex::new(None),
        })
    }

    /// Runs `f` with cuBLAS (its handle made on this device's stream at the first call, after
    /// [`ensure_blas`]). Never while recording: a step graph holds only this crate's kernels.
    pub fn with_blas<R>(
        &self,
        f: impl FnOnce(&mut Blas) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        if self.recording() {
            return Err(CudaError::Launch {
                kernel: "cublas".into(),
                what: "a cuBLAS product inside a recorded step".into(),
            });
        }
        let mut g = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            ensure_blas()?;
            let handle = cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|e| {
                CudaError::Driver {
                    call: "cublasCreate".into(),
                    what: e.to_string(),
                }
            })?;
            *g = Some(Blas {
                handle,
                scratch: None,
            });
        }
        match g.as_mut() {
            Some(b) => f(b),
            None => Err(CudaError::BlasMissing("cuBLAS handle".into())),
        }
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether launches are being recorded (see [`crate::record`]).
    pub fn recording(&self) -> bool {
        self.rec.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Starts recording: launches, copies and memsets are kept instead of issued.
    pub fn start_recording(&self) {
        *self.rec.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
    }

    /// Stops recording and returns the ops (None when recording was not on).
    pub fn take_recording(&self) -> Option<Vec<crate::record::Op>> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Keeps `op` when recording; false (the caller issues it) when not.
    pub fn record(&self, op: crate::record::Op) -> Option<crate::record::Op> {
        match self.rec.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(v) => {
                v.push(op);
                None
            }
            None => Some(op),
        }
    }

    /// Whether launches are being timed.
    pub fn profiling(&self) -> bool {
        self.profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Starts timing every launch (events around each; costs host time, so only for profiles).
    pub fn profile_start(&self) {
        *self.profile.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
        self.profiling_on
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops timing and sums the device time per kernel, costliest first.
    pub fn profile_stop(&self) -> Result<Vec<KernelTime>, CudaError> {
        let recs = self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        self.profiling_on
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.sync()?;
        let mut by: HashMap<String, KernelTime> = HashMap::new();
        for Timed {
            name,
            start,
            end,
            bytes,
        } in recs
        {
            let ms = start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))?;
            let e = by.entry(name.clone()).or_insert(KernelTime {
                name,
                launches: 0,
                us: 0.0,
                bytes: Some(0),
            });
            e.launches += 1;
            e.us += ms as f64 * 1000.0;
            e.bytes = e.bytes.zip(bytes).map(|(s, b)| s + b);
        }
        let mut v: Vec<KernelTime> = by.into_values().collect();
        v.sort_by(|a, b| b.us.total_cmp(&a.us));
        Ok(v)
    }

    /// States the bytes the next launch must read (its weights and activation rows), for the
    /// profile's floor column; a no-op unless profiling.
    pub fn note_bytes(&self, bytes: usize) {
        if self.profiling_on.load(std::sync::atomic::Ordering::Relaxed) {
            *self.next_bytes.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes as u64);
        }
    }

    /// The device's copy bandwidth in bytes a second (read + write) of a device-to-device copy of
    /// 256 MiB, best of five: the profile's floor divides each kernel's bytes by it.
    pub fn copy_bandwidth(&self) -> Result<f64, CudaError> {
        let n = 256usize << 20;
        let src = self.zeros::<u8>(n)?;
        let mut dst = self.zeros::<u8>(n)?;
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let a = self
                .stream
                .record_event(flags)
                .map_err(drv("cuEventRecord"))?;
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(drv("cuMemcpyDtoD"))?;
            let b = self
                .stream
                .record_event(flags)
                .map_err(drv("cuEventRecord"))?;
            self.sync()?;
            let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))? as f64;
            best = best.min(ms);
        }
        Ok(2.0 * n as f64 / (best.max(1e-6) * 1e-3))
    }

    /// Runs `launch` between two events when profiling (the launch! macro's hook).
    pub fn timed(
        &self,
        name: &str,
        launch: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut p = self.profile.lock().unwrap_or_else(|p| p.into_inner());
        let Some(recs) = p.as_mut() else {
            drop(p);
            return launch();
        };
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let a = self
            .stream
            .record_event(flags)
            .map_err(drv("cuEventRecord"))?;
        launch()?;
        let b = self
            .stream
            .record_event(flags)
            .map_err(drv("cuEventRecord"))?;
        let bytes = self
            .next_bytes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        recs.push(Timed {
            name: name.to_string(),
            start: a,
            end: b,
            bytes,
        });
        Ok(())
    }

    /// The kernel `name` of module `module` (looked up once, then cached).
    /// Whether launches of kernel `name` are ablated ([`ablated_kernels`]).
    pub fn ablated(&self, name: &str) -> bool {
        let set = ablated_kernels();
        !set.is_empty() && set.iter().any(|s| s == name || s == "*")
    }

    /// An ablated launch of `name`: norm.cu's `noop` on one warp instead (recorded or issued
    /// as the real launch would be).
    pub fn launch_ablated(&self, name: &str) -> Result<(), CudaError> {
        let f = self.func("norm", "noop")?;
        if self.recording() {
            let _ = self.record(crate::record::Op::Launch {
                func: f,
                cfg: cfg(1, 32),
                args: Vec::new(),
            });
            return Ok(());
        }
        let mut b = self.stream().launch_builder(&f);
        self.timed(name, || {
            // SAFETY: noop takes no parameters.
            unsafe { b.launch(cfg(1, 32)) }
                .map(|_| ())
                .map_err(|e| CudaError::Launch {
                    kernel: name.to_string(),
                    what: e.to_string(),
                })
        })
    }

    pub fn func(&self, module: &str, name: &str) -> Result<CudaFunction, CudaError> {
        let mut f = self.funcs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(func) = f.get(name) {
            return Ok(func.clone());
        }
        let m = self.modules.get(module).ok_or_else(|| CudaError::Launch {
            kernel: name.into(),
            what: format!("module {module} is not loaded"),
        })?;
        let func = m.load_function(name).map_err(|e| CudaError::Driver {
            call: format!("cuModuleGetFunction({module}, {name})"),
            what: e.to_string(),
        })?;
        f.insert(name.to_string(), func.clone());
        Ok(func)
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(data).map_err(drv("cuMemcpyHtoD"))
    }

    /// A weight's bytes (a mapped file's pages) on the device. Past one staging buffer, through
    /// two page-locked buffers in turn: the host threads copy the next 32 MiB into one while
    /// the other's copy to the device runs, so the upload is bound by the parallel copy out of
    /// the page cache and the PCIe link rather than by the driver's single-threaded staging of
    /// pageable memory. The tail below a whole buffer goes the pageable way.
    /// `STRATA_CUDA_PINNED=0` uploads every weight the pageable way (for A/B).
    pub fn upload_weights(&self, bytes: &[u8]) -> Result<CudaSlice<u8>, CudaError> {
        const STAGE: usize = 32 << 20;
        if bytes.len() < STAGE || !switch_on("STRATA_CUDA_PINNED") {
            return self.upload(bytes);
        }
        use rayon::prelude::*;
        // SAFETY: every byte of `dst` is written below before anything reads it.
        let mut dst = unsafe { self.stream.alloc::<u8>(bytes.len()) }.map_err(drv("cuMemAlloc"))?;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if staging.is_none() {
            *staging = Some([self.alloc_pinned(STAGE)?, self.alloc_pinned(STAGE)?]);
        }
        let bufs = staging.as_mut().ok_or_else(|| CudaError::Driver {
            call: "staging".into(),
            what: "no staging buffers".into(),
        })?;
        let full = bytes.len() / STAGE;
        for c in 0..full {
            let buf = &mut bufs[c % 2];
            // Waits for this buffer's previous copy to the device.
            let host = buf.as_mut_slice().map_err(drv("cuEventSynchronize"))?;
            host.par_chunks_mut(2 << 20)
                .zip(bytes[c * STAGE..(c + 1) * STAGE].par_chunks(2 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
            let mut view = dst.slice_mut(c * STAGE..(c + 1) * STAGE);
            self.stream
                .memcpy_htod(&*buf, &mut view)
                .map_err(drv("cuMemcpyHtoDAsync"))?;
        }
        if full * STAGE < bytes.len() {
            let mut view = dst.slice_mut(full * STAGE..);
            self.stream
                .memcpy_htod(&bytes[full * STAGE..], &mut view)
                .map_err(drv("cuMemcpyHtoD"))?;
        }
        Ok(dst)
    }

    /// A zeroed buffer. In record mode the memset is issued at once (the buffer is new, so no
    /// recorded op can depend on it yet).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros(n.max(1)).map_err(drv("cuMemAlloc"))
    }

    /// A buffer whose contents are left as the allocator hands them out: for outputs a kernel
    /// writes entirely before anything reads them (one driver call instead of two).
    pub fn alloc_uninit<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: device memory is never read as T on the host before a kernel has written it
        // (the callers' contract); the allocation itself is sound for any length.
        unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(drv("cuMemAllocAsync"))
    }

    /// Page-locked host memory (write-combined: the host only writes it).
    pub fn alloc_pinned(&self, n: usize) -> Result<cudarc::driver::PinnedHostSlice<u8>, CudaError> {
        // SAFETY: the bytes are written before any copy reads them (the staging's contract).
        unsafe { self.ctx.alloc_pinned::<u8>(n.max(1)) }.map_err(drv("cuMemHostAlloc"))
    }

    /// `bytes` in page-locked host memory mapped into the device's address space, and a
    /// device view of it: kernels read it over the bus, no copy on the device. The view must
    /// never be freed as device memory (the caller forgets it, then drops the host memory).
    pub fn map_host(
        &self,
        bytes: &[u8],
    ) -> Result<(cudarc::driver::PinnedHostSlice<u8>, CudaSlice<u8>), CudaError> {
        use cudarc::driver::sys;
        use rayon::prelude::*;
        // SAFETY: every byte is written below before any kernel reads it.
        let mut host = unsafe {
            self.ctx.alloc_pinned_with_flags::<u8>(
                bytes.len().max(1),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_WRITECOMBINED,
            )
        }
        .map_err(drv("cuMemHostAlloc"))?;
        let dst = host.as_mut_slice().map_err(drv("cuEventSynchronize"))?;
        dst[..bytes.len()]
            .par_chunks_mut(2 << 20)
            .zip(bytes.par_chunks(2 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let hp = host.as_mut_ptr().map_err(drv("cuEventSynchronize"))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: hp is the start of a live DEVICEMAP allocation; dptr is a valid out-pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, hp as *mut std::ffi::c_void, 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        // SAFETY: dptr addresses `host`'s bytes, which outlive the view (the caller's contract).
        let view = unsafe {
            self.stream
                .upgrade_device_ptr::<u8>(dptr, bytes.len().max(1))
        };
        Ok((host, view))
    }

    /// An event recorded on the stream now (to wait for the work issued so far).
    pub fn event(&self) -> Result<CudaEvent, CudaError> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv("cuEventRecord"))
    }

    /// Captures the already-recorded `ops` into a graph (issuing them inside a stream capture);
    /// with the L2-ahead branch, the graph also holds the branch that prefetches the dense
    /// weights the ops read ([`Ahead`]).
    pub fn capture_ops(&self, ops: &[crate::record::Op]) -> Result<Graph, CudaError> {
        let Some(ah) = &self.ahead else {
            return self.capture(&mut || crate::record::issue(ops, &self.stream, self.pdl));
        };
        let items = {
            let w = ah.weights.lock().unwrap_or_else(|p| p.into_inner());
            ahead_items(ops, &w, ah.window)
        };
        if items.is_empty() {
            return self.capture(&mut || crate::record::issue(ops, &self.stream, self.pdl));
        }
        let list = self
            .stream
            .clone_htod(&items)
            .map_err(drv("cuMemcpyHtoD"))?;
        let f = self.func("norm", "l2_ahead")?;
        let cs = self.stream.cu_stream();
        let ctl = crate::record::addr(&ah.ctl, &self.stream);
        let mut args = [
            crate::record::addr(&list, &self.stream),
            (items.len() / 3) as u64,
            ctl,
        ];
        let mut g = self.capture(&mut || {
            // SAFETY: `ctl` is the branch's two live words; the kernel's parameters are
            // (const u64*, int, const u32*), each read from its 8-byte slot (the int from the
            // low bytes, little-endian); `list` lives as long as the graph (Graph::keep).
            unsafe {
                cudarc::driver::result::memset_d8_async(ctl, 0, 8, cs)
                    .map_err(drv("cuMemsetD8Async (L2 ahead)"))?;
                let e = self.event()?;
                ah.side
                    .wait(&e)
                    .map_err(drv("cuStreamWaitEvent (L2 ahead)"))?;
                let mut params: Vec<*mut std::ffi::c_void> = args
                    .iter_mut()
                    .map(|a| a as *mut u64 as *mut std::ffi::c_void)
                    .collect();
                cudarc::driver::result::launch_kernel(
                    f.cu_function(),
                    (ah.blocks, 1, 1),
                    (32, 1, 1),
                    0,
                    ah.side.cu_stream(),
                    &mut params,
                )
                .map_err(drv("cuLaunchKernel (l2_ahead)"))?;
            }
            crate::record::issue(ops, &self.stream, self.pdl)?;
            // SAFETY: as above; the done word is ctl[1] (its low byte set to 1).
            unsafe {
                cudarc::driver::result::memset_d8_async(ctl + 4, 1, 1, cs)
                    .map_err(drv("cuMemsetD8Async (L2 ahead)"))?;
            }
            let e = ah
                .side
                .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(drv("cuEventRecord (L2 ahead)"))?;
            self.stream
                .wait(&e)
                .map_err(drv("cuStreamWaitEvent (L2 ahead)"))
        })?;
        g.keep = Some(list);
        Ok(g)
    }

    /// Notes a dense weight's device bytes for the L2-ahead branch (a no-op without it, and
    /// for weights over 64 MiB).
    pub fn note_weight(&self, addr: u64, bytes: u64) {
        let Some(ah) = &self.ahead else { return };
        if bytes == 0 || bytes > AHEAD_MAX_WEIGHT {
            return;
        }
        let mut w = ah.weights.lock().unwrap_or_else(|p| p.into_inner());
        let i = w.partition_point(|&(s, _)| s < addr);
        w.insert(i, (addr, bytes));
    }

    pub fn write<T: DeviceRepr>(
        &self,
        dst: &mut CudaSlice<T>,
        data: &[T],
    ) -> Result<(), CudaError> {
        self.stream
            .memcpy_htod(data, dst)
            .map_err(drv("cuMemcpyHtoD"))
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(src).map_err(drv("cuMemcpyDtoH"))
    }

    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// Copies `src` to `dst` on the device (bandwidth measurement, fresh copies).
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        self.stream
            .memcpy_dtod(src, dst)
            .map_err(drv("cuMemcpyDtoD"))
    }

    /// Captures `body` (a few launches) into a graph.
    pub fn capture(
        &self,
        body: &mut dyn FnMut() -> Result<(), CudaError>,
    ) -> Result<Graph, CudaError> {
        self.sync()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("cuStreamBeginCapture"))?;
        let r = body();
        let g = self.stream.end_capture(CUgraphInstantiate_flags(0));
        r?;
        let g = g.map_err(drv("cuStreamEndCapture / cuGraphInstantiate"))?;
        g.map(|g| Graph { g, keep: None })
            .ok_or_else(|| CudaError::Driver {
                call: "cuStreamEndCapture".into(),
                what: "the capture recorded no work".into(),
            })
    }

    /// Runs `f` between two events and returns the elapsed device time in microseconds.
    pub fn time_us(&self, f: &mut dyn FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let a = self
            .stream
            .record_event(flags)
            .map_err(drv("cuEventRecord"))?;
        f()?;
        let b = self
            .stream
            .record_event(flags)
            .map_err(drv("cuEventRecord"))?;
        let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?;
        Ok(ms as f64 * 1000.0)
    }

    /// Checks for an error left by earlier asynchronous work (a faulting kernel).
    pub fn check(&self, what: &str) -> Result<(), CudaError> {
        self.ctx.check_err().map_err(drv(what))?;
        self.sync().map_err(|e| CudaError::Launch {
            kernel: what.into(),
            what: e.to_string(),
        })
    }
}

/// A captured, instantiated graph (and what its nodes read that it owns: the L2-ahead list).
pub struct Graph {
    g: cudarc::driver::CudaGraph,
    keep: Option<CudaSlice<u64>>,
}

// SAFETY: a CUDA graph handle may be used from any thread; the backend launches it from one
// thread at a time (its step lock).
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl Graph {
    pub fn launch(&self) -> Result<(), CudaError> {
        self.g.launch().map_err(drv("cuGraphLaunch"))
    }
}

/// The kernels named in `STRATA_CUDA_ABLATE` (comma-separated kernel names, `*` for every
/// kernel: the step's launch-and-dependency floor inside the graph): each launch of
/// one of them becomes an empty one-warp launch (norm.cu `noop`, which only waits for the
/// kernel before it). A measuring tool only: the model's results are wrong while it is set
/// (the step runs on stale buffers). `bench model` with it set measures a kernel's marginal
/// cost inside the recorded graph, where per-launch timers cannot see (the overlap of
/// programmatic dependent launches).
pub fn ablated_kernels() -> &'static [String] {
    static SET: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SET.get_or_init(|| {
        std::env::var("STRATA_CUDA_ABLATE")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// A launch configuration of `grid` blocks of `block` threads.
pub fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::{ahead_plan, l2_ahead_setting};
    use crate::record::Arg;

    #[test]
    fn the_l2_ahead_window_is_read_and_checked_by_name() {
        let get = |v: &'static str| move |_: &str| Some(v.to_string());
        assert_eq!(l2_ahead_setting(|_| None).unwrap(), None);
        assert_eq!(l2_ahead_setting(get("0")).unwrap(), None);
        assert_eq!(l2_ahead_setting(get(" 16 ")).unwrap(), Some(16 << 20));
        for bad in ["-1", "2000", "16M", "x"] {
            let e = l2_ahead_setting(get(bad)).unwrap_err().to_string();
            assert!(e.contains("STRATA_CUDA_L2_AHEAD") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_l2_ahead_plan_takes_each_weight_at_its_first_launch_within_the_window() {
        const M: u64 = 1 << 20;
        // Weights at 100, 200, 300, 400 (MiB addresses), 8, 8, 4 and 20 MiB.
        let w = [
            (100 * M, 8 * M),
            (200 * M, 8 * M),
            (300 * M, 4 * M),
            (400 * M, 20 * M),
        ];
        let launches: Vec<Vec<Arg>> = vec![
            vec![Arg::B8(100 * M), Arg::B4(7)],              // 0: weight 0
            vec![Arg::B8(5)],                                // 1: no weight
            vec![Arg::B8(200 * M + 4096), Arg::B8(100 * M)], // 2: inside weight 1; weight 0 again
            vec![Arg::B8(300 * M)],                          // 3: weight 2
            vec![Arg::B8(400 * M), Arg::B8(404 * M)],        // 4: weight 3 (twice)
            vec![Arg::B8(300 * M + 4 * M)],                  // 5: just past weight 2: none
        ];
        let plan = ahead_plan(launches.iter().map(|a| a.as_slice()), &w, 16 * M);
        let items: Vec<(u64, u64, u64)> = plan.chunks(3).map(|c| (c[0], c[1], c[2])).collect();
        assert_eq!(
            items,
            vec![
                // 8 MiB in flight: from the start.
                (100 * M, 8 * M, 0),
                // 16 MiB with weight 0: still within the window.
                (200 * M, 8 * M, 0),
                // 20 MiB: weight 0's launch (0) must have started first.
                (300 * M, 4 * M, 1),
                // 32 MiB: weights 0..2 consumed → after launch 3; capped at its own launch (4).
                (400 * M, 20 * M, 4),
            ]
        );
    }
}
