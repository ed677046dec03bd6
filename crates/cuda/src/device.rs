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
pub const SWITCHES: [&str; 29] = [
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
    "STRATA_CUDA_PARTS",
    "STRATA_CUDA_PARTS_EARLY",
    "STRATA_CUDA_READBACK",
    "STRATA_CUDA_HC_UP_EARLY",
    "STRATA_CUDA_ATTN_DIRECT",
    "STRATA_CUDA_QSA_ALL",
    "STRATA_CUDA_ATTN_L2",
    "STRATA_CUDA_ATTN_FUSE",
    "STRATA_CUDA_ROWS4",
    "STRATA_CUDA_ROWS4_GDN",
];

/// The switches read once, when the device opens, a backend is made or a model loads (or a
/// module is compiled): an override later changes nothing, so [`set_switch`] refuses them.
pub const SWITCHES_AT_START: [&str; 7] = [
    "STRATA_CUDA_GRAPHS",
    "STRATA_CUDA_PDL",
    "STRATA_CUDA_PINNED",
    "STRATA_CUDA_PLE_HOST",
    "STRATA_CUDA_TRIGGER_FIRST",
    "STRATA_CUDA_FAST_PREFILL",
    "STRATA_CUDA_BATCH",
];

/// Per switch: 0 the environment's value, 1 off, 2 on ([`set_switch`]).
static OVERRIDES: [std::sync::atomic::AtomicU8; SWITCHES.len()] =
    [const { std::sync::atomic::AtomicU8::new(0) }; SWITCHES.len()];

/// The environment's value of every switch, read once (`None`: unset or empty).
fn env_switches() -> &'static [Option<bool>; SWITCHES.len()] {
    static E: std::sync::OnceLock<[Option<bool>; SWITCHES.len()]> = std::sync::OnceLock::new();
    E.get_or_init(|| {
        SWITCHES.map(|v| {
            std::env::var(v)
                .ok()
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .map(|x| x != "0")
        })
    })
}

fn switch_index(var: &str) -> Option<usize> {
    SWITCHES.iter().position(|s| *s == var)
}

fn switch_value(var: &str) -> Option<bool> {
    let i = switch_index(var)?;
    match OVERRIDES[i].load(std::sync::atomic::Ordering::Relaxed) {
        1 => Some(false),
        2 => Some(true),
        _ => env_switches()[i],
    }
}

/// Switch `var`'s setting where the environment or an override gives one (`None`: unset, or not
/// a switch), for callers whose default depends on more than the switch.
pub fn switch_given(var: &str) -> Option<bool> {
    switch_value(var)
}

/// Whether switch `var` (one of [`SWITCHES`]) is on: on unless set to `0` (the values were
/// checked by [`check_switches`] when the device opened), or as [`set_switch`] overrode it.
pub fn switch_on(var: &str) -> bool {
    switch_value(var).unwrap_or(true)
}

/// Whether an opt-in switch (one of [`SWITCHES`] that is off by default) is set to `1`, or
/// overridden on.
pub fn switch_set(var: &str) -> bool {
    switch_value(var).unwrap_or(false)
}

/// Overrides switch `var` for this process from now on (None: back to the environment's
/// value), for an A/B inside one process (`strata bench model --ab`) and for tests. The
/// switches of [`SWITCHES_AT_START`] and names that are no switch are refused by name.
pub fn set_switch(var: &str, on: Option<bool>) -> Result<(), CudaError> {
    let Some(i) = switch_index(var) else {
        return Err(CudaError::Switch {
            name: var.to_string(),
            why: "not one of the STRATA_CUDA_* switches (docs/CUDA.md, Switches)",
        });
    };
    if SWITCHES_AT_START.contains(&var) {
        return Err(CudaError::Switch {
            name: var.to_string(),
            why: "read once, when the device opens or the model loads: set it in the \
                  environment instead",
        });
    }
    let v = match on {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    OVERRIDES[i].store(v, std::sync::atomic::Ordering::Relaxed);
    Ok(())
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
    /// Page-locked (cacheable) host memory that downloads land in ([`Gpu::download_f32`]),
    /// grown to the largest download so far up to [`READBACK_MAX`].
    readback: Mutex<Option<HostMem>>,
    copy_out_ns: std::sync::atomic::AtomicU64,
}

/// Downloads of at most this many bytes go through the page-locked read-back buffer.
pub const READBACK_MAX: usize = 64 << 20;

/// Page-locked, cacheable host memory (`cuMemHostAlloc` without write-combining: the host
/// reads it), freed when dropped.
struct HostMem {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain host memory; the Gpu uses it under its mutex only.
unsafe impl Send for HostMem {}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
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
        Ok(Gpu {
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
            readback: Mutex::new(None),
            copy_out_ns: std::sync::atomic::AtomicU64::new(0),
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

    /// How many ops the recording holds (0 when not recording).
    pub fn recorded(&self) -> usize {
        self.rec
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, Vec::len)
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
        any_ablated() && ablated_kernels().iter().any(|s| s == name || s == "*")
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

    /// An event with timing recorded on the stream now (the device's clock at that point of
    /// the stream, for [`cudarc::driver::CudaEvent::elapsed_ms`]).
    pub fn timed_event(&self) -> Result<CudaEvent, CudaError> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))
    }

    /// Captures the already-recorded `ops` into a graph (issuing them inside a stream capture).
    pub fn capture_ops(&self, ops: &[crate::record::Op]) -> Result<Graph, CudaError> {
        self.capture(&mut || crate::record::issue(ops, &self.stream, self.pdl))
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

    /// `n` values of `src` from `start` on, in a new Vec: copied into the page-locked read-back
    /// buffer (the driver's fast path; a pageable destination is staged by the driver in
    /// pieces), the stream waited for, then copied out. Downloads over [`READBACK_MAX`] and
    /// `STRATA_CUDA_READBACK=0` go straight to the Vec. The same bytes either way.
    pub fn download_f32(&self, src: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>, CudaError> {
        let bytes = 4 * n;
        if n == 0 {
            return Ok(Vec::new());
        }
        if bytes > READBACK_MAX || !switch_on("STRATA_CUDA_READBACK") {
            return self
                .stream
                .clone_dtoh(&src.slice(0..n))
                .map_err(drv("cuMemcpyDtoH"));
        }
        let mut rb = self.readback.lock().unwrap_or_else(|p| p.into_inner());
        if rb.as_ref().is_none_or(|m| m.bytes < bytes) {
            *rb = None;
            // Rounded up to a MiB so that slightly larger downloads reuse it.
            let want = bytes.div_ceil(1 << 20) << 20;
            self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            // SAFETY: a plain allocation of `want` bytes (flags 0: cacheable, not mapped).
            let ptr = unsafe { cudarc::driver::result::malloc_host(want, 0) }
                .map_err(drv("cuMemHostAlloc (read-back)"))?;
            *rb = Some(HostMem {
                ptr: ptr as *mut u8,
                bytes: want,
            });
        }
        let m = rb.as_ref().expect("made above");
        let src_ptr = crate::record::addr(src, &self.stream);
        // SAFETY: the buffer holds `bytes` (checked above) and nothing else uses it while the
        // lock is held; the copy is waited for before it is read.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(m.ptr as *mut f32, n);
            cudarc::driver::result::memcpy_dtoh_async(dst, src_ptr, self.stream.cu_stream())
                .map_err(drv("cuMemcpyDtoHAsync (read-back)"))?;
        }
        self.sync()?;
        let t = std::time::Instant::now();
        // SAFETY: `n` f32 were written by the copy just waited for.
        let host = unsafe { std::slice::from_raw_parts(m.ptr as *const f32, n) };
        let v = host.to_vec();
        self.copy_out_ns.fetch_add(
            t.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(v)
    }

    /// Host time spent copying downloads out of the read-back buffer, in total (the rest of a
    /// download is the device's copy and its wait).
    pub fn copy_out_ns(&self) -> u64 {
        self.copy_out_ns.load(std::sync::atomic::Ordering::Relaxed)
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
        g.map(|g| Graph { g }).ok_or_else(|| CudaError::Driver {
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

/// A captured, instantiated graph.
pub struct Graph {
    g: cudarc::driver::CudaGraph,
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
/// kernel: the step's launch-and-dependency floor inside the graph), or as [`set_ablated`]
/// overrode them: each launch of one of them becomes an empty one-warp launch (norm.cu `noop`,
/// which only waits for the kernel before it). A measuring tool only: the model's results are
/// wrong while it is set (the step runs on stale buffers). `bench model` with it set (or
/// `--ablate`, in one process) measures a kernel's marginal cost inside the recorded graph,
/// where per-launch timers cannot see (the overlap of programmatic dependent launches).
pub fn ablated_kernels() -> Vec<String> {
    let o = ABLATE_OVERRIDE.read().unwrap_or_else(|p| p.into_inner());
    match &*o {
        Some(v) => v.clone(),
        None => env_ablated().to_vec(),
    }
}

fn env_ablated() -> &'static [String] {
    static SET: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SET.get_or_init(|| {
        std::env::var("STRATA_CUDA_ABLATE")
            .map(|v| ablate_list(&v))
            .unwrap_or_default()
    })
}

/// A comma-separated list of kernel names (`*`: every kernel), trimmed, empties dropped.
pub fn ablate_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// `None` until [`set_ablated`] overrides the environment's list.
static ABLATE_OVERRIDE: std::sync::RwLock<Option<Vec<String>>> = std::sync::RwLock::new(None);
/// Whether any kernel is ablated now (checked on every launch before the list is read).
static ABLATE_ANY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Overrides [`ablated_kernels`] for this process from now on (None: back to
/// `STRATA_CUDA_ABLATE`), for `strata bench model --ablate`, which times each list's decode
/// against the unablated step in one process. Steps recorded after it see the new list (an
/// ablated op list is another signature, so it gets graphs of its own).
pub fn set_ablated(kernels: Option<Vec<String>>) {
    let any = match &kernels {
        Some(v) => !v.is_empty(),
        None => !env_ablated().is_empty(),
    };
    *ABLATE_OVERRIDE.write().unwrap_or_else(|p| p.into_inner()) = kernels;
    ABLATE_ANY.store(u8::from(any), std::sync::atomic::Ordering::Relaxed);
}

fn any_ablated() -> bool {
    match ABLATE_ANY.load(std::sync::atomic::Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let any = !env_ablated().is_empty();
            ABLATE_ANY.store(u8::from(any), std::sync::atomic::Ordering::Relaxed);
            any
        }
    }
}

/// A launch configuration of `grid` blocks of `block` threads.
pub fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}
