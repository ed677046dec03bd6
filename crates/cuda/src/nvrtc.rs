//! NVRTC: finding the library, compiling a module to a cubin for one architecture, and the
//! on-disk cache of compiled modules (keyed by a hash of the source, the options, the NVRTC
//! version and the architecture), so a process starts in milliseconds after the first run.
//!
//! cudarc panics when it cannot load a library, so the library is looked for first
//! ([`ensure_nvrtc`]) and absence becomes [`CudaError::NvrtcMissing`]. `STRATA_NVRTC_LIB` may
//! name the library file (e.g. from the `nvidia-cuda-nvrtc` wheel); it is loaded by path
//! before cudarc asks for it by name, and the loader then finds it by its soname.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::CudaError;

/// Options every module is compiled with. `--fmad=false`: no contraction of `a*b + c`, so the
/// kernels keep the CPU kernels' rounding (kernels call `fmaf` where they mean it).
pub const OPTIONS: &[&str] = &[
    "--fmad=false",
    "--std=c++17",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// [`OPTIONS`], plus `--generate-line-info` with `STRATA_CUDA_LINEINFO=1` (for ncu's source
/// view; the code is the same, the cubin and so its cache key are not).
fn options() -> Vec<String> {
    let mut o: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    if std::env::var("STRATA_CUDA_LINEINFO").is_ok_and(|v| v == "1") {
        o.push("--generate-line-info".into());
    }
    o
}

fn preload_from_env() -> Result<(), CudaError> {
    static PRELOADED: OnceLock<Result<(), String>> = OnceLock::new();
    PRELOADED
        .get_or_init(|| {
            let Some(path) = std::env::var_os("STRATA_NVRTC_LIB") else {
                return Ok(());
            };
            let path = PathBuf::from(path);
            // The builtins library sits next to libnvrtc; load it first so NVRTC finds it.
            if let Some(dir) = path.parent() {
                if let Ok(rd) = std::fs::read_dir(dir) {
                    for e in rd.flatten() {
                        let name = e.file_name().to_string_lossy().to_string();
                        if name.starts_with("libnvrtc-builtins.so") && !name.contains("alt") {
                            // SAFETY: loading a shared library runs its initializers; this is the
                            // NVRTC builtins library named by the user's STRATA_NVRTC_LIB folder.
                            if let Ok(lib) = unsafe { libloading::Library::new(e.path()) } {
                                std::mem::forget(lib);
                            }
                        }
                    }
                }
            }
            // SAFETY: as above, for the NVRTC library itself. It stays loaded for the process.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => {
                    std::mem::forget(lib);
                    Ok(())
                }
                Err(e) => Err(format!("STRATA_NVRTC_LIB={}: {e}", path.display())),
            }
        })
        .clone()
        .map_err(CudaError::NvrtcMissing)
}

/// Checks that NVRTC can be loaded (without letting cudarc panic).
pub fn ensure_nvrtc() -> Result<(), CudaError> {
    preload_from_env()?;
    // SAFETY: only tries to dlopen the candidate names; no symbol is called.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NvrtcMissing(
            "libnvrtc (CUDA 13) was not found: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel, \
             and put its lib folder on LD_LIBRARY_PATH or name the library in STRATA_NVRTC_LIB"
                .into(),
        ))
    }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), CudaError> {
    ensure_nvrtc()?;
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: the library is loaded (ensure_nvrtc); the out-pointers are valid for the call.
    unsafe { sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            module: "-".into(),
            what: format!("nvrtcVersion: {e}"),
        })?;
    Ok((a, b))
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn log_of(p: &Program) -> String {
    // SAFETY: p is a live program; the log buffer is sized by NVRTC.
    match unsafe { result::get_program_log(p.0) } {
        Ok(v) => {
            let bytes: Vec<u8> = v
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e})"),
    }
}

/// Compiles `source` for `sm_{major}{minor}` and returns the cubin.
pub fn compile_cubin(name: &str, source: &str, arch: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    ensure_nvrtc()?;
    let err = |what: String| CudaError::Nvrtc {
        module: name.to_string(),
        what,
    };
    let src = CString::new(source).map_err(|_| err("source holds a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| err("bad module name".into()))?;
    let prog = Program(
        result::create_program(&src, Some(cname.as_c_str()))
            .map_err(|e| err(format!("create: {e}")))?,
    );
    let mut opts = options();
    opts.push(format!("--gpu-architecture=sm_{}{}", arch.0, arch.1));
    // SAFETY: prog is live; options are NUL-free strings that outlive the call.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        return Err(err(format!(
            "compile failed ({e}) with {opts:?}:\n{}",
            log_of(&prog)
        )));
    }
    let mut size = 0usize;
    // SAFETY: prog compiled; size is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| err(format!("cubin size: {e}")))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes as NVRTC asked.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(|e| err(format!("cubin: {e}")))?;
    if cubin.is_empty() {
        return Err(err("NVRTC returned an empty cubin".into()));
    }
    Ok(cubin)
}

/// The log NVRTC printed for a successful compile, with `extra` options (e.g.
/// `--ptxas-options=-v` for registers, stack frames and spills).
pub fn compile_log(
    name: &str,
    source: &str,
    arch: (i32, i32),
    extra: &[&str],
) -> Result<String, CudaError> {
    ensure_nvrtc()?;
    let err = |what: String| CudaError::Nvrtc {
        module: name.to_string(),
        what,
    };
    let src = CString::new(source).map_err(|_| err("source holds a NUL byte".into()))?;
    let prog =
        Program(result::create_program(&src, None).map_err(|e| err(format!("create: {e}")))?);
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture=sm_{}{}", arch.0, arch.1));
    opts.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: as in compile_cubin.
    let r = unsafe { result::compile_program(prog.0, &opts) };
    let log = log_of(&prog);
    r.map_err(|e| err(format!("compile failed ({e}):\n{log}")))?;
    Ok(log)
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache folder: `STRATA_CUDA_CACHE`, else `$XDG_CACHE_HOME/strata/cuda`, else
/// `$HOME/.cache/strata/cuda`, else the temp folder.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_CUDA_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Path::new(&p).join("strata").join("cuda");
    }
    if let Some(p) = std::env::var_os("HOME") {
        return Path::new(&p).join(".cache").join("strata").join("cuda");
    }
    std::env::temp_dir().join("strata-cuda")
}

/// Outcome of [`cached_cubin`]: the cubin and whether it came from the disk cache.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub from_cache: bool,
    pub path: PathBuf,
}

/// The cubin of `source` for `arch`, from the cache when present, else compiled and stored.
pub fn cached_cubin(name: &str, source: &str, arch: (i32, i32)) -> Result<Compiled, CudaError> {
    let (va, vb) = version()?;
    let opts = options().join(" ");
    let key = fnv1a64(&[
        source.as_bytes(),
        opts.as_bytes(),
        format!("nvrtc {va}.{vb} sm_{}{}", arch.0, arch.1).as_bytes(),
    ]);
    let dir = cache_dir();
    let path = dir.join(format!("{name}-sm{}{}-{key:016x}.cubin", arch.0, arch.1));
    if let Ok(cubin) = std::fs::read(&path) {
        // An ELF header is the least a cubin has; anything else is a broken file: rebuild.
        if cubin.len() > 4 && &cubin[..4] == b"\x7fELF" {
            return Ok(Compiled {
                cubin,
                from_cache: true,
                path,
            });
        }
    }
    let cubin = compile_cubin(name, source, arch)?;
    // A cache that cannot be written only costs the next start a compile.
    if std::fs::create_dir_all(&dir).is_ok() {
        // Unique per process and call: two threads compiling the same source must not share
        // (and rename away) one half-written file.
        static WRITES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".{name}-{key:016x}.{}-{call}.tmp",
            std::process::id()
        ));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(Compiled {
        cubin,
        from_cache: false,
        path,
    })
}
