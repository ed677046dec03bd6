//! The adapter, the device and its limits, buffers, compiled pipelines and launches.
//!
//! Adapter choice: `STRATA_WGPU_ADAPTER` (an index into the list, or a case-insensitive part
//! of the adapter's name) picks one; otherwise the first GPU, then the first CPU adapter
//! (lavapipe). Backends: Vulkan and Metal unless `WGPU_BACKEND` says otherwise. The device is
//! opened with the adapter's own limits, and every buffer and dispatch is checked against
//! them before wgpu sees it, so a too-large request is a clear error, never a panic or a
//! silently truncated binding. Validation errors are caught in error scopes and returned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::shaders;
use crate::WgpuError;

/// Words of the parameter block every kernel takes (word 31 is the `nc` zero).
pub const PARAM_WORDS: usize = 32;

/// The adapter and the device opened on it.
pub struct Wgpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Largest storage binding the kernels may use (the adapter's, or less when forced).
    pub max_binding: u64,
    /// Parameters as immediates (push constants: no buffer, no bind-group entry, no queue
    /// write per dispatch) where the adapter offers 128 bytes of them; else a uniform buffer
    /// per dispatch. `STRATA_WGPU_IMMEDIATES=0` forces the buffer. The kernels read the same
    /// words either way.
    pub immediates: bool,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// Pipeline compile times (module key, seconds), for the report's notes.
    pub compiles: Mutex<Vec<(String, f64)>>,
    errors: Arc<Mutex<Vec<String>>>,
    /// Bind groups reused across steps (only with immediates: no per-dispatch parameter
    /// buffer in the group), or `None` when off.
    bind_cache: Option<Mutex<BindCache>>,
    /// Launches that found their bind group in the cache (for tests and PERF notes).
    pub bind_hits: AtomicU64,
    /// Bytes written with `write_buffer` since the last submit: wgpu stages them in host memory
    /// until a submit, so a model's load (35 GiB for the full-size file) is flushed and waited
    /// for every [`STAGE_FLUSH`] bytes instead of staging it all at once.
    staged: AtomicU64,
    /// GPU timestamps between dispatches are possible (the adapter offers
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`; lavapipe and NVIDIA's Vulkan do).
    pub timestamps: bool,
    /// Host time spent building launches, recording + submitting them, and waiting.
    pub host: HostTimes,
    /// Timestamp readbacks of the submits since [`Wgpu::stamps_start`], or `None` (off).
    stamps: Mutex<Option<Vec<StampRead>>>,
}

/// Host nanoseconds by phase, summed since the device opened (differences give a run's).
#[derive(Default, Debug)]
pub struct HostTimes {
    /// In [`Wgpu::launch`]: pipeline lookup, parameter words, bind group (cached or made).
    pub launch_ns: AtomicU64,
    /// In [`Wgpu::submit`]: the compute pass recorded and the command buffer submitted.
    pub submit_ns: AtomicU64,
    /// In [`Wgpu::wait`] and [`Wgpu::download_bytes`]: blocked until the queue is idle.
    pub wait_ns: AtomicU64,
}

impl HostTimes {
    /// (launch, submit, wait) nanoseconds so far.
    pub fn get(&self) -> (u64, u64, u64) {
        (
            self.launch_ns.load(Ordering::Relaxed),
            self.submit_ns.load(Ordering::Relaxed),
            self.wait_ns.load(Ordering::Relaxed),
        )
    }
}

/// Adds the time since it was made to a counter when dropped (every return path counts).
struct Timer<'a>(&'a AtomicU64, Instant);

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.0
            .fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// One compute pass's timestamps on their way back: the launches' names and bytes, and the
/// buffer the `n + 1` stamps (before the first dispatch, after each) are copied into.
struct StampRead {
    names: Vec<String>,
    bytes: Vec<u64>,
    buf: wgpu::Buffer,
}

/// GPU time by kernel from timestamps written between dispatches (each interval is one
/// dispatch and the barrier before it; nothing is serialised beyond what the step does).
#[derive(Default, Debug, Clone)]
pub struct GpuProfile {
    /// `module::entry …` → (dispatches, GPU ns, bytes the launches name).
    pub by: HashMap<String, (u64, f64, u64)>,
    /// Sum over passes of last stamp − first stamp: the GPU's busy time.
    pub busy_ns: f64,
    /// Compute passes timed.
    pub passes: u64,
}

/// Dispatches per timed compute pass (a query set holds at most 4,096 stamps).
const STAMPS_PER_PASS: usize = 4000;

/// Staged upload bytes after which an upload submits and waits (see `Wgpu::staged`).
const STAGE_FLUSH: u64 = 256 << 20;

/// A storage buffer and the bytes it holds (rounded up to 4 on the device).
pub struct Buf {
    pub buf: wgpu::Buffer,
    pub bytes: u64,
    /// Stands for data held in other buffers (a store split under the binding limit): binding
    /// or downloading it is refused, so no kernel can read a part as if it were the whole.
    pub placeholder: bool,
    /// Kept for the backend's life (weights, stores, tables, pooled temporaries): a bind
    /// group of stable buffers only is cached (`Wgpu::bind_cache`); one with a per-step
    /// upload is made afresh, so the cache never keeps such a buffer alive.
    pub stable: bool,
}

/// Bind groups by (pipeline, buffers), for launches whose buffers are all stable.
type BindCache = HashMap<(wgpu::ComputePipeline, Vec<wgpu::Buffer>), wgpu::BindGroup>;

/// Entries after which the bind-group cache starts again (it holds stable buffers only, so
/// this bounds bookkeeping, not memory).
const BIND_CACHE_MAX: usize = 1 << 15;

/// One dispatch, bound and ready to record.
pub struct Launch {
    pipe: Arc<wgpu::ComputePipeline>,
    bind: wgpu::BindGroup,
    groups: (u32, u32, u32),
    /// `module::entry`, for profiles.
    pub name: String,
    /// The parameter words, set as immediates when the device uses them.
    words: [u32; PARAM_WORDS],
    /// Bytes the dispatch reads and writes, for profiles' GB/s: by default the bound
    /// buffers' sizes; the products set the weight bytes they read ([`Launch::bytes`]).
    pub bytes: u64,
    /// The uniform parameter buffer (without immediates), kept alive with the bind group.
    params: Option<wgpu::Buffer>,
}

impl Launch {
    fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipe);
        if self.params.is_none() {
            pass.set_immediates(0, bytemuck::cast_slice(&self.words));
        }
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_workgroups(self.groups.0, self.groups.1, self.groups.2);
    }
}

/// The adapters this process can see, one line each (for messages and `--list`).
pub fn list_adapters() -> Vec<String> {
    let inst = instance();
    let ads = pollster::block_on(inst.enumerate_adapters(backends()));
    ads.iter()
        .enumerate()
        .map(|(i, a)| {
            let inf = a.get_info();
            format!(
                "{i}: {} ({:?}, {:?}, driver {} {})",
                inf.name, inf.device_type, inf.backend, inf.driver, inf.driver_info
            )
        })
        .collect()
}

fn backends() -> wgpu::Backends {
    wgpu::Backends::from_env().unwrap_or(wgpu::Backends::VULKAN | wgpu::Backends::METAL)
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = backends();
    wgpu::Instance::new(desc)
}

impl Wgpu {
    /// Opens the adapter named by `STRATA_WGPU_ADAPTER`, else the first GPU, else a CPU one.
    pub fn new() -> Result<Wgpu, WgpuError> {
        let sel = std::env::var("STRATA_WGPU_ADAPTER").ok();
        Wgpu::open(sel.as_deref())
    }

    /// Opens the adapter `sel` (index or part of the name), or the default one.
    pub fn open(sel: Option<&str>) -> Result<Wgpu, WgpuError> {
        if wgpu::Instance::enabled_backend_features().is_empty() {
            return Err(WgpuError::NoAdapter(
                "this build has no wgpu backend for this platform".into(),
            ));
        }
        let inst = instance();
        let ads = pollster::block_on(inst.enumerate_adapters(backends()));
        if ads.is_empty() {
            return Err(WgpuError::NoAdapter(format!(
                "no {:?} adapter found (on Linux install a Vulkan driver, e.g. Debian's \
                 mesa-vulkan-drivers for lavapipe, and the Vulkan loader libvulkan1)",
                backends()
            )));
        }
        let names: Vec<String> = ads.iter().map(|a| a.get_info().name).collect();
        let pick = match sel.map(str::trim).filter(|s| !s.is_empty()) {
            Some(s) => {
                let by_index = s.parse::<usize>().ok().filter(|&i| i < ads.len());
                let by_name = || {
                    let l = s.to_lowercase();
                    names.iter().position(|n| n.to_lowercase().contains(&l))
                };
                by_index.or_else(by_name).ok_or_else(|| {
                    WgpuError::NoAdapter(format!(
                        "STRATA_WGPU_ADAPTER='{s}' matches none of: {}",
                        list_adapters().join("; ")
                    ))
                })?
            }
            None => {
                let gpu = ads.iter().position(|a| {
                    matches!(
                        a.get_info().device_type,
                        wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu
                    )
                });
                gpu.unwrap_or(0)
            }
        };
        let adapter = &ads[pick];
        let info = adapter.get_info();
        let limits = adapter.limits();
        let immediates = adapter.features().contains(wgpu::Features::IMMEDIATES)
            && limits.max_immediate_size >= (PARAM_WORDS * 4) as u32
            && std::env::var("STRATA_WGPU_IMMEDIATES").as_deref() != Ok("0");
        let mut features = if immediates {
            wgpu::Features::IMMEDIATES
        } else {
            wgpu::Features::empty()
        };
        // Timestamps between dispatches for `--profile` (GPU time per kernel without waiting
        // for each dispatch alone); written only while a profile runs.
        let stamp_features = wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        let timestamps = adapter.features().contains(stamp_features);
        if timestamps {
            features |= stamp_features;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("strata"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| WgpuError::Device(format!("{}: {e}", info.name)))?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        Ok(Wgpu {
            device,
            queue,
            info,
            limits,
            max_binding,
            immediates,
            pipelines: Mutex::new(HashMap::new()),
            compiles: Mutex::new(Vec::new()),
            errors,
            bind_cache: None,
            bind_hits: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            timestamps,
            host: HostTimes::default(),
            stamps: Mutex::new(None),
        })
    }

    /// Reuses bind groups whose pipeline and buffers are all the same as an earlier launch's
    /// (all of them [`Buf::stable`]); needs immediates (else every group holds its own
    /// parameter buffer).
    pub fn set_bind_cache(&mut self, on: bool) {
        self.bind_cache = (on && self.immediates).then(|| Mutex::new(HashMap::new()));
    }

    /// Whether bind groups are cached.
    pub fn bind_cache_on(&self) -> bool {
        self.bind_cache.is_some()
    }

    /// Forgets the cached bind groups (and so the buffers they hold).
    pub fn clear_bind_cache(&self) -> Result<(), WgpuError> {
        if let Some(c) = &self.bind_cache {
            c.lock().map_err(|_| WgpuError::Poisoned)?.clear();
        }
        Ok(())
    }

    /// Lowers the storage-binding limit the kernels respect (tests force small limits).
    pub fn force_binding_limit(&mut self, bytes: u64) {
        self.max_binding = self.max_binding.min(bytes);
    }

    /// A CPU adapter (lavapipe, or another software rasterizer).
    pub fn is_cpu(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// One line naming the adapter, its driver and the limits that shape the kernels.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?}, driver {} {}; storage binding {} MiB, subgroup {}..{}, parameters {})",
            self.info.name,
            self.info.device_type,
            self.info.backend,
            self.info.driver,
            self.info.driver_info,
            self.max_binding >> 20,
            self.info.subgroup_min_size,
            self.info.subgroup_max_size,
            if self.immediates {
                "as immediates"
            } else {
                "in a uniform buffer"
            }
        )
    }

    fn check_errors(&self, what: &str) -> Result<(), WgpuError> {
        let mut v = self.errors.lock().map_err(|_| WgpuError::Poisoned)?;
        if v.is_empty() {
            return Ok(());
        }
        let all = v.join("; ");
        v.clear();
        Err(WgpuError::Validation(format!("{what}: {all}")))
    }

    fn checked_size(&self, what: &str, bytes: u64) -> Result<u64, WgpuError> {
        let padded = bytes.max(4).div_ceil(4) * 4;
        if padded > self.max_binding {
            return Err(WgpuError::TooLarge {
                what: what.into(),
                bytes,
                limit: self.max_binding,
            });
        }
        Ok(padded)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload_bytes(&self, what: &str, data: &[u8]) -> Result<Buf, WgpuError> {
        let size = self.checked_size(what, data.len() as u64)?;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut padded = data.to_vec();
        padded.resize(size as usize, 0);
        self.queue.write_buffer(&buf, 0, &padded);
        if self.staged.fetch_add(size, Ordering::Relaxed) + size > STAGE_FLUSH {
            self.staged.store(0, Ordering::Relaxed);
            self.queue.submit(std::iter::empty::<wgpu::CommandBuffer>());
            self.wait()?;
        }
        Ok(Buf {
            buf,
            bytes: data.len() as u64,
            placeholder: false,
            stable: false,
        })
    }

    /// A zero-filled storage buffer of `bytes` (rounded up to 4), checked against the limit.
    pub fn alloc(&self, what: &str, bytes: u64) -> Result<Buf, WgpuError> {
        let size = self.checked_size(what, bytes)?;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Ok(Buf {
            buf,
            bytes,
            placeholder: false,
            stable: false,
        })
    }

    /// A 4-byte buffer standing for data split into other buffers (see [`Buf::placeholder`]).
    pub fn placeholder(&self, what: &str) -> Result<Buf, WgpuError> {
        let mut b = self.alloc(what, 4)?;
        b.placeholder = true;
        Ok(b)
    }

    pub fn upload<T: bytemuck::Pod>(&self, what: &str, data: &[T]) -> Result<Buf, WgpuError> {
        self.upload_bytes(what, bytemuck::cast_slice(data))
    }

    /// Overwrites a buffer's contents from the host.
    pub fn write<T: bytemuck::Pod>(&self, b: &Buf, data: &[T]) -> Result<(), WgpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() as u64 > b.bytes.max(4).div_ceil(4) * 4 || !bytes.len().is_multiple_of(4) {
            return Err(WgpuError::Launch {
                kernel: "write".into(),
                what: format!("{} bytes into a buffer of {}", bytes.len(), b.bytes),
            });
        }
        self.queue.write_buffer(&b.buf, 0, bytes);
        Ok(())
    }

    /// The buffer's bytes back on the host (waits for all submitted work).
    pub fn download_bytes(&self, b: &Buf) -> Result<Vec<u8>, WgpuError> {
        // A download is the host waiting for the GPU: counted whole (copy, map, wait).
        let _t = Timer(&self.host.wait_ns, Instant::now());
        if b.placeholder {
            return Err(WgpuError::Launch {
                kernel: "download".into(),
                what: "a split store read as one buffer".into(),
            });
        }
        let size = b.bytes.max(4).div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("download"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&b.buf, 0, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.poll_idle()?;
        rx.recv()
            .map_err(|e| WgpuError::Map(e.to_string()))?
            .map_err(|e| WgpuError::Map(e.to_string()))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| WgpuError::Map(e.to_string()))?;
        let out = view[..b.bytes as usize].to_vec();
        drop(view);
        staging.unmap();
        self.check_errors("download")?;
        Ok(out)
    }

    pub fn download<T: bytemuck::Pod>(&self, b: &Buf) -> Result<Vec<T>, WgpuError> {
        let bytes = self.download_bytes(b)?;
        let n = bytes.len() / std::mem::size_of::<T>();
        let mut v = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes[..n * size_of::<T>()]);
        Ok(v)
    }

    /// Blocks until the queue is idle.
    pub fn wait(&self) -> Result<(), WgpuError> {
        let _t = Timer(&self.host.wait_ns, Instant::now());
        self.poll_idle()
    }

    /// [`Wgpu::wait`] without counting the time (callers that count it themselves).
    fn poll_idle(&self) -> Result<(), WgpuError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Device(format!("poll: {e}")))?;
        Ok(())
    }

    /// The pipeline of `entry` in `module` specialized by `spec` (compiled once, cached).
    pub fn pipeline(
        &self,
        module: &str,
        entry: &str,
        spec: &[(&str, String)],
    ) -> Result<Arc<wgpu::ComputePipeline>, WgpuError> {
        // The cache is looked up before the source is assembled (tens of KiB of text: built
        // per dispatch it cost more host time than the dispatch's recording).
        let key = format!("{module}/{entry}/{spec:?}");
        if let Some(p) = self
            .pipelines
            .lock()
            .map_err(|_| WgpuError::Poisoned)?
            .get(&key)
        {
            return Ok(p.clone());
        }
        let src = shaders::source_for(module, spec, self.immediates)?;
        let t = Instant::now();
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let sm = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(module),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let layout = self.layout(module)?;
        let pl = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(module),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: if self.immediates {
                    (PARAM_WORDS * 4) as u32
                } else {
                    0
                },
            });
        let pipe = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pl),
                module: &sm,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(WgpuError::Shader {
                module: format!("{module}::{entry}"),
                msg: e.to_string(),
            });
        }
        self.check_errors(module)?;
        let p = Arc::new(pipe);
        self.compiles
            .lock()
            .map_err(|_| WgpuError::Poisoned)?
            .push((format!("{module}::{entry}"), t.elapsed().as_secs_f64()));
        self.pipelines
            .lock()
            .map_err(|_| WgpuError::Poisoned)?
            .insert(key, p.clone());
        Ok(p)
    }

    /// Binding 0 the parameter block, then the module's storage buffers (read-write in the
    /// layout; the shaders declare which they only read).
    fn layout(&self, module: &str) -> Result<wgpu::BindGroupLayout, WgpuError> {
        let n = shaders::storage_bindings(module)?;
        let mut entries = Vec::new();
        if !self.immediates {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        for i in 0..n {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: 1 + i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: false },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        Ok(self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(module),
                entries: &entries,
            }))
    }

    /// A dispatch of `entry` over `groups` workgroups with `params` and the buffers `bufs`
    /// (bindings 1..), checked against the device's limits.
    pub fn launch(
        &self,
        module: &str,
        entry: &str,
        spec: &[(&str, String)],
        params: &[u32],
        bufs: &[&Buf],
        groups: (u32, u32, u32),
    ) -> Result<Launch, WgpuError> {
        let _t = Timer(&self.host.launch_ns, Instant::now());
        let bytes = bufs.iter().map(|b| b.bytes).sum();
        let n = shaders::storage_bindings(module)?;
        if bufs.len() != n || params.len() >= PARAM_WORDS {
            return Err(WgpuError::Launch {
                kernel: format!("{module}::{entry}"),
                what: format!(
                    "{} buffers and {} parameters for {n} bindings",
                    bufs.len(),
                    params.len()
                ),
            });
        }
        if bufs.iter().any(|b| b.placeholder) {
            return Err(WgpuError::Launch {
                kernel: format!("{module}::{entry}"),
                what: "a store split under the binding limit was passed whole (this operation \
                       takes one buffer)"
                    .into(),
            });
        }
        let maxg = self.limits.max_compute_workgroups_per_dimension;
        if groups.0 == 0 || groups.0 > maxg || groups.1 > maxg || groups.2 > maxg {
            return Err(WgpuError::Launch {
                kernel: format!("{module}::{entry}"),
                what: format!("{groups:?} workgroups (the adapter allows 1..={maxg} a dimension)"),
            });
        }
        let pipe = self.pipeline(module, entry, spec)?;
        let mut words = [0u32; PARAM_WORDS];
        words[..params.len()].copy_from_slice(params);
        let mut entries = Vec::with_capacity(bufs.len() + 1);
        let params = if self.immediates {
            None
        } else {
            let pbuf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: (PARAM_WORDS * 4) as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            self.queue
                .write_buffer(&pbuf, 0, bytemuck::cast_slice(&words));
            Some(pbuf)
        };
        if let Some(pb) = &params {
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: pb.as_entire_binding(),
            });
        }
        for (i, b) in bufs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: 1 + i as u32,
                resource: b.buf.as_entire_binding(),
            });
        }
        let key = match &self.bind_cache {
            Some(c) if params.is_none() && bufs.iter().all(|b| b.stable) => {
                let key = (
                    (*pipe).clone(),
                    bufs.iter().map(|b| b.buf.clone()).collect(),
                );
                let hit = c
                    .lock()
                    .map_err(|_| WgpuError::Poisoned)?
                    .get(&key)
                    .cloned();
                if let Some(bind) = hit {
                    self.bind_hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(Launch {
                        pipe,
                        bind,
                        groups: (groups.0, groups.1.max(1), groups.2.max(1)),
                        name: format!("{module}::{entry}"),
                        words,
                        bytes,
                        params,
                    });
                }
                Some(key)
            }
            _ => None,
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(WgpuError::Launch {
                kernel: format!("{module}::{entry}"),
                what: e.to_string(),
            });
        }
        if let (Some(key), Some(c)) = (key, &self.bind_cache) {
            let mut c = c.lock().map_err(|_| WgpuError::Poisoned)?;
            if c.len() >= BIND_CACHE_MAX {
                c.clear();
            }
            c.insert(key, bind.clone());
        }
        Ok(Launch {
            pipe,
            bind,
            groups: (groups.0, groups.1.max(1), groups.2.max(1)),
            name: format!("{module}::{entry}"),
            words,
            bytes,
            params,
        })
    }

    /// Records `launches` in order in one compute pass and submits them, without waiting (the
    /// next download waits): one command stream per step of the model backend.
    pub fn submit(&self, launches: &[Launch]) -> Result<(), WgpuError> {
        if launches.is_empty() {
            return Ok(());
        }
        let _t = Timer(&self.host.submit_ns, Instant::now());
        let mut enc = self.device.create_command_encoder(&Default::default());
        let mut stamps = self.stamps.lock().map_err(|_| WgpuError::Poisoned)?;
        match stamps.as_mut() {
            Some(reads) if self.timestamps => {
                for part in launches.chunks(STAMPS_PER_PASS) {
                    reads.push(self.record_stamped(&mut enc, part));
                }
            }
            _ => {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for l in launches {
                    l.record(&mut pass);
                }
            }
        }
        drop(stamps);
        self.queue.submit([enc.finish()]);
        self.staged.store(0, Ordering::Relaxed);
        self.check_errors("dispatch")
    }

    /// One compute pass of `launches` with a timestamp before the first dispatch and after
    /// each, resolved and copied into a buffer [`Wgpu::stamps_stop`] reads.
    fn record_stamped(&self, enc: &mut wgpu::CommandEncoder, launches: &[Launch]) -> StampRead {
        let n = launches.len() as u32 + 1;
        let qs = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("stamps"),
            ty: wgpu::QueryType::Timestamp,
            count: n,
        });
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&qs, 0);
            for (i, l) in launches.iter().enumerate() {
                l.record(&mut pass);
                pass.write_timestamp(&qs, i as u32 + 1);
            }
        }
        let size = 8 * n as u64;
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stamps resolve"),
            size,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stamps read"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.resolve_query_set(&qs, 0..n, &resolve, 0);
        enc.copy_buffer_to_buffer(&resolve, 0, &buf, 0, size);
        StampRead {
            names: launches.iter().map(|l| l.name.clone()).collect(),
            bytes: launches.iter().map(|l| l.bytes).collect(),
            buf,
        }
    }

    /// Starts writing timestamps between the dispatches of every submit (false when the
    /// adapter has no timestamps inside passes).
    pub fn stamps_start(&self) -> Result<bool, WgpuError> {
        *self.stamps.lock().map_err(|_| WgpuError::Poisoned)? = Some(Vec::new());
        Ok(self.timestamps)
    }

    /// Stops the timestamps, waits for the queue and sums the intervals by kernel.
    pub fn stamps_stop(&self) -> Result<GpuProfile, WgpuError> {
        let reads = self
            .stamps
            .lock()
            .map_err(|_| WgpuError::Poisoned)?
            .take()
            .unwrap_or_default();
        let period = self.queue.get_timestamp_period() as f64;
        let mut prof = GpuProfile::default();
        for r in &reads {
            let (tx, rx) = std::sync::mpsc::channel();
            r.buf.map_async(wgpu::MapMode::Read, .., move |res| {
                let _ = tx.send(res);
            });
            self.wait()?;
            rx.recv()
                .map_err(|e| WgpuError::Map(e.to_string()))?
                .map_err(|e| WgpuError::Map(e.to_string()))?;
            let view = r
                .buf
                .get_mapped_range(..)
                .map_err(|e| WgpuError::Map(e.to_string()))?;
            let t: Vec<u64> = view
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect();
            drop(view);
            r.buf.unmap();
            // A counter that wrapped or a driver that wrote no stamp reads as a backwards
            // step: counted as 0 rather than as 2^64 ticks.
            let dt = |a: u64, b: u64| b.saturating_sub(a) as f64 * period;
            prof.passes += 1;
            prof.busy_ns += dt(t[0], t[t.len() - 1]);
            for (i, name) in r.names.iter().enumerate() {
                let e = prof.by.entry(name.clone()).or_insert((0, 0.0, 0));
                e.0 += 1;
                e.1 += dt(t[i], t[i + 1]);
                e.2 += r.bytes[i];
            }
        }
        self.check_errors("timestamps")?;
        Ok(prof)
    }

    /// Records `launches` in order, `repeat` times, in one compute pass; submits and waits.
    /// Returns the wall time in seconds from submit to completion.
    pub fn run(&self, launches: &[&Launch], repeat: usize) -> Result<f64, WgpuError> {
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for _ in 0..repeat.max(1) {
                for l in launches {
                    l.record(&mut pass);
                }
            }
        }
        let cmd = enc.finish();
        let t = Instant::now();
        self.queue.submit([cmd]);
        self.wait()?;
        let s = t.elapsed().as_secs_f64();
        self.check_errors("dispatch")?;
        Ok(s)
    }
}
