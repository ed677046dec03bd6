//! Recorded steps: while a step body runs in record mode, its kernel launches, device copies,
//! memsets and input uploads are kept as [`Op`]s instead of being issued. At the end of the
//! step (or of each part of it) the backend either replays a CUDA graph captured earlier from
//! the same op list (its [`signature`]: kernels, launch shapes, every pointer and scalar
//! argument, compared whole) or captures one now by issuing the ops inside a stream capture.
//! The inputs' values change from step to step
//! without changing the ops: they are written into pinned host staging that the graph's copy
//! nodes read when it runs.

use std::ffi::c_void;

use cudarc::driver::{
    result, sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, LaunchConfig,
};

use crate::device::drv;
use crate::CudaError;

/// One scalar or pointer kernel argument, as the kernel's parameter bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    B4(u32),
    B8(u64),
}

/// A device operation of a recorded step.
pub enum Op {
    Launch {
        func: CudaFunction,
        cfg: LaunchConfig,
        args: Vec<Arg>,
    },
    CopyDtoD {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Zero {
        dst: u64,
        bytes: usize,
    },
    /// From pinned host staging (stable address; its contents are the step's inputs).
    CopyHtoD {
        dst: u64,
        src: *const u8,
        bytes: usize,
    },
}

// SAFETY: the host pointer of CopyHtoD points into pinned staging owned by the backend, which
// outlives the ops; it is only read by the copy.
unsafe impl Send for Op {}
unsafe impl Sync for Op {}

/// A kernel argument's parameter bytes (pointers of device buffers, values of scalars).
pub trait KArg {
    fn karg(&self, stream: &CudaStream) -> Arg;
}

macro_rules! scalar {
    ($t:ty, $v:ident => $e:expr) => {
        impl KArg for &$t {
            fn karg(&self, _: &CudaStream) -> Arg {
                let $v = **self;
                $e
            }
        }
    };
}
scalar!(i32, v => Arg::B4(v as u32));
scalar!(u32, v => Arg::B4(v));
scalar!(f32, v => Arg::B4(v.to_bits()));
scalar!(u64, v => Arg::B8(v));
scalar!(f64, v => Arg::B8(v.to_bits()));

impl<T> KArg for &CudaSlice<T> {
    fn karg(&self, s: &CudaStream) -> Arg {
        Arg::B8(self.device_ptr(s).0)
    }
}
impl<T> KArg for &mut CudaSlice<T> {
    fn karg(&self, s: &CudaStream) -> Arg {
        Arg::B8((**self).device_ptr(s).0)
    }
}
impl<T> KArg for &CudaView<'_, T> {
    fn karg(&self, s: &CudaStream) -> Arg {
        Arg::B8(self.device_ptr(s).0)
    }
}
impl<T> KArg for &mut CudaViewMut<'_, T> {
    fn karg(&self, s: &CudaStream) -> Arg {
        Arg::B8((**self).device_ptr(s).0)
    }
}

/// The device address of a slice (for recorded copies).
pub fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

pub fn addr_mut<T>(s: &mut CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr_mut(stream).0
}

/// What identifies a recorded op list, exactly: its ops as words (kernels, launch shapes, every
/// pointer and scalar argument; copies and memsets with their addresses and sizes). Two lists
/// replay the same graph only when their signatures are equal word for word — no hash, so no
/// collision can replay a wrong graph. Made in one pass with no hashing (a decode step's ~1,000
/// ops in ~15 µs; session 11 measured SipHash fingerprints at ~220 µs a step on the host's
/// critical path).
pub fn signature(ops: &[Op]) -> Vec<u64> {
    let mut w = Vec::with_capacity(ops.len() * 20 + 1);
    w.push(ops.len() as u64);
    for op in ops {
        match op {
            Op::Launch { func, cfg, args } => {
                w.push(0);
                w.push(func.cu_function() as usize as u64);
                let (g, b) = (cfg.grid_dim, cfg.block_dim);
                w.push(u64::from(g.0) | u64::from(g.1) << 32);
                w.push(u64::from(g.2) | u64::from(b.0) << 32);
                w.push(u64::from(b.1) | u64::from(b.2) << 32);
                w.push(u64::from(cfg.shared_mem_bytes) | (args.len() as u64) << 32);
                for a in args {
                    // A 4-byte argument carries a tag bit above its value, so it never equals
                    // an 8-byte one.
                    w.push(match *a {
                        Arg::B4(v) => u64::from(v) | 1 << 32,
                        Arg::B8(v) => v,
                    });
                }
                // The argument kinds, a bit each (a B8 of value 2^32 + v is not a B4 of v).
                let mut kinds = 0u64;
                for (i, a) in args.iter().enumerate().take(64) {
                    kinds |= u64::from(matches!(a, Arg::B8(_))) << i;
                }
                w.push(kinds);
            }
            Op::CopyDtoD { dst, src, bytes } => w.extend([1, *dst, *src, *bytes as u64]),
            Op::Zero { dst, bytes } => w.extend([2, *dst, *bytes as u64]),
            Op::CopyHtoD { dst, src, bytes } => {
                w.extend([3, *dst, *src as usize as u64, *bytes as u64])
            }
        }
    }
    w
}

/// Issues the ops on `stream` in order (eagerly, or inside a stream capture). With `pdl`, a
/// kernel that follows a kernel is launched with programmatic stream serialization: it may
/// start while the one before it runs, and waits for it in its `grid_dep_sync()` (every kernel
/// calls it first, kernels/common.cuh), so the launch latency hides behind the previous
/// kernel instead of adding to it. A kernel after a copy or a memset waits for it as usual.
pub fn issue(ops: &[Op], stream: &CudaStream, pdl: bool) -> Result<(), CudaError> {
    let cs = stream.cu_stream();
    let mut slots: Vec<u64> = Vec::new();
    let mut after_kernel = false;
    for op in ops {
        match op {
            Op::Launch { func, cfg, args } => {
                slots.clear();
                slots.extend(args.iter().map(|a| match *a {
                    Arg::B4(v) => v as u64,
                    Arg::B8(v) => v,
                }));
                // Each parameter points at its slot; a 4-byte parameter reads the slot's low
                // bytes (little-endian).
                let mut params: Vec<*mut c_void> = slots
                    .iter_mut()
                    .map(|s| s as *mut u64 as *mut c_void)
                    .collect();
                // SAFETY: the args were recorded from a launch of this function with the same
                // parameter list; every pointer argument is a live arena, state or scratch
                // buffer (the backend keeps them until the step's ops have run).
                if pdl && after_kernel {
                    unsafe { launch_dependent(func, cfg, cs, &mut params) }
                        .map_err(drv("cuLaunchKernelEx (recorded, programmatic)"))?;
                } else {
                    unsafe {
                        result::launch_kernel(
                            func.cu_function(),
                            cfg.grid_dim,
                            cfg.block_dim,
                            cfg.shared_mem_bytes,
                            cs,
                            &mut params,
                        )
                    }
                    .map_err(drv("cuLaunchKernel (recorded)"))?;
                }
            }
            // SAFETY (the three copies): addresses and sizes were taken from live buffers when
            // the op was recorded; the backend keeps them alive until the ops have run.
            Op::CopyDtoD { dst, src, bytes } => {
                unsafe { result::memcpy_dtod_async(*dst, *src, *bytes, cs) }
                    .map_err(drv("cuMemcpyDtoDAsync (recorded)"))?
            }
            Op::Zero { dst, bytes } => unsafe { result::memset_d8_async(*dst, 0, *bytes, cs) }
                .map_err(drv("cuMemsetD8Async (recorded)"))?,
            Op::CopyHtoD { dst, src, bytes } => {
                let host = unsafe { std::slice::from_raw_parts(*src, *bytes) };
                unsafe { result::memcpy_htod_async(*dst, host, cs) }
                    .map_err(drv("cuMemcpyHtoDAsync (recorded)"))?
            }
        }
        after_kernel = matches!(op, Op::Launch { .. });
    }
    Ok(())
}

/// `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`.
///
/// # Safety
/// As `cuLaunchKernel`: `params` matches the kernel's parameter list and every pointer in it is
/// live until the launch has run.
unsafe fn launch_dependent(
    func: &CudaFunction,
    cfg: &LaunchConfig,
    cs: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), cudarc::driver::DriverError> {
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        // SAFETY: a plain-data union; zero is a valid value of every member.
        value: unsafe { std::mem::zeroed() },
    };
    attr.value.programmaticStreamSerializationAllowed = 1;
    let conf = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: cs,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract; `conf` and `attr` outlive the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &conf,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

#[cfg(test)]
mod tests {
    use super::{signature, Op};

    /// Equal op lists have equal signatures; a change in any address, size or kind, or in the
    /// order, gives another (copies and memsets here: a launch needs a device function).
    #[test]
    fn signatures_tell_op_lists_apart_exactly() {
        let staging = [0u8; 64];
        let list = |dst: u64, bytes: usize, z: u64| {
            vec![
                Op::CopyHtoD {
                    dst,
                    src: staging.as_ptr(),
                    bytes,
                },
                Op::Zero { dst: z, bytes: 256 },
                Op::CopyDtoD {
                    dst: 4096,
                    src: dst,
                    bytes,
                },
            ]
        };
        let a = signature(&list(1 << 20, 32, 8192));
        assert_eq!(a, signature(&list(1 << 20, 32, 8192)));
        for other in [
            signature(&list((1 << 20) + 256, 32, 8192)),
            signature(&list(1 << 20, 48, 8192)),
            signature(&list(1 << 20, 32, 8448)),
        ] {
            assert_ne!(a, other);
        }
        let mut rev = list(1 << 20, 32, 8192);
        rev.reverse();
        assert_ne!(a, signature(&rev));
        assert_ne!(a, signature(&list(1 << 20, 32, 8192)[..2]));
    }
}
