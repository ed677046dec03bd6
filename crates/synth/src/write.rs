//! The streaming writer: the header (metadata and tensor records) at offset 0, then every
//! tensor's bytes at its offset, written with positional writes from rayon's pool. Pool tensors
//! are tiled from one random pool per type (starting at a random block of it, wrapping), in
//! chunks, so memory stays at the pools' size whatever the file's; small tensors are generated
//! per tensor. The output is a function of the plan and the seed only.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rayon::prelude::*;
use strata_gguf::{GgmlType, GgufWriter};

use strata_quant::synth::SplitMix64;

use crate::blocks::{encode_small, random_pool, small_values};
use crate::plan::{Fill, Plan};
use crate::{Result, SynthError};

/// Where the file goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    /// A new regular file (an existing one is refused unless `overwrite`).
    File { overwrite: bool },
    /// Everything is generated and handed to `write_at` of an existing character device such
    /// as /dev/null (the generator's speed without a disk).
    Device,
}

#[derive(Clone, Debug)]
pub struct WriteOptions {
    pub seed: u64,
    /// Bytes of random blocks per type (at most; a type needing less gets less).
    pub pool_bytes: usize,
    /// Bytes per positional write.
    pub chunk_bytes: usize,
    pub sink: Sink,
}

impl Default for WriteOptions {
    fn default() -> WriteOptions {
        WriteOptions {
            seed: 1234,
            pool_bytes: 64 << 20,
            chunk_bytes: 8 << 20,
            sink: Sink::File { overwrite: false },
        }
    }
}

#[derive(Clone, Debug)]
pub struct WriteReport {
    pub file_len: u64,
    pub header_bytes: u64,
    pub data_bytes: u64,
    pub pool_bytes: u64,
    pub pool_seconds: f64,
    pub write_seconds: f64,
}

/// One positional write.
struct Job {
    offset: u64,
    tensor: usize,
    /// Where in the pool (pool tensors) — the chunk is `len` bytes from there, wrapping.
    pool_pos: usize,
    len: usize,
}

fn io<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(std::io::Error) -> SynthError + 'a {
    move |source| SynthError::Io {
        path: path.display().to_string(),
        action,
        source,
    }
}

/// Writes `plan` to `path`; `progress` is called with the data bytes written so far (from any
/// thread, after every chunk).
pub fn write(
    plan: &Plan,
    path: &Path,
    o: &WriteOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<WriteReport> {
    if o.pool_bytes == 0 || o.chunk_bytes == 0 {
        return Err(SynthError::Option {
            option: "--pool-mib",
            problem: "pool and chunk sizes must be greater than zero".into(),
        });
    }
    // Everything that can be refused is checked before the file is touched.
    let mut w = GgufWriter::new();
    for (k, v) in &plan.kvs {
        w.add_kv(k.clone(), v.clone());
    }
    for t in &plan.tensors {
        w.add_tensor_deferred(&t.name, &t.ne, t.ty)?;
    }
    let layout = w.layout()?;
    let file = open(path, o.sink, layout.file_len)?;
    file.write_all_at(&layout.header, 0)
        .map_err(io(path, "writing the header"))?;

    // Pools, one per type that has pool tensors, generated in parallel.
    let t0 = Instant::now();
    let mut need: Vec<(GgmlType, u64)> = Vec::new();
    for t in plan.tensors.iter().filter(|t| t.fill == Fill::Pool) {
        match need.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some(e) => e.1 += t.bytes(),
            None => need.push((t.ty, t.bytes())),
        }
    }
    let pools: Vec<(GgmlType, Vec<u8>)> = need
        .par_iter()
        .map(|&(ty, bytes)| {
            let bs = ty.type_size();
            let n = (bytes.min(o.pool_bytes as u64) as usize / bs).max(1);
            random_pool(ty, n, o.seed).map(|p| (ty, p))
        })
        .collect::<Result<_>>()?;
    let pool_of = |ty: GgmlType| -> &[u8] {
        pools
            .iter()
            .find(|p| p.0 == ty)
            .map(|p| p.1.as_slice())
            .unwrap_or(&[])
    };
    let pool_seconds = t0.elapsed().as_secs_f64();

    // Jobs: each pool tensor from a random block of its pool, in chunks; small tensors whole.
    let mut rng = SplitMix64(o.seed ^ 0x7A11_0FF5E7);
    let mut jobs = Vec::new();
    for (i, (t, &(off, len))) in plan.tensors.iter().zip(&layout.tensors).enumerate() {
        if t.fill != Fill::Pool {
            jobs.push(Job {
                offset: off,
                tensor: i,
                pool_pos: 0,
                len: len as usize,
            });
            continue;
        }
        let pool = pool_of(t.ty);
        let bs = t.ty.type_size();
        let mut pos = (rng.next_u64() % (pool.len() / bs) as u64) as usize * bs;
        let (mut at, mut left) = (off, len);
        while left > 0 {
            let n = (left as usize).min(o.chunk_bytes);
            jobs.push(Job {
                offset: at,
                tensor: i,
                pool_pos: pos,
                len: n,
            });
            at += n as u64;
            left -= n as u64;
            pos = (pos + n) % pool.len();
        }
    }

    let t1 = Instant::now();
    let done = AtomicU64::new(0);
    jobs.par_iter().try_for_each(|j| -> Result<()> {
        let t = &plan.tensors[j.tensor];
        if t.fill == Fill::Pool {
            let pool = pool_of(t.ty);
            // The chunk may wrap around the pool's end (several times for a small pool).
            let (mut at, mut pos, mut left) = (j.offset, j.pool_pos, j.len);
            while left > 0 {
                let n = left.min(pool.len() - pos);
                file.write_all_at(&pool[pos..pos + n], at)
                    .map_err(io(path, "writing tensor data"))?;
                at += n as u64;
                left -= n;
                pos = (pos + n) % pool.len();
            }
        } else {
            let seed = o.seed ^ (j.tensor as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let bytes = encode_small(t.ty, &small_values(t.fill, t.elements() as usize, seed))?;
            file.write_all_at(&bytes, j.offset)
                .map_err(io(path, "writing tensor data"))?;
        }
        progress(done.fetch_add(j.len as u64, Ordering::Relaxed) + j.len as u64);
        Ok(())
    })?;
    Ok(WriteReport {
        file_len: layout.file_len,
        header_bytes: layout.header.len() as u64,
        data_bytes: plan.data_bytes(),
        pool_bytes: pools.iter().map(|p| p.1.len() as u64).sum(),
        pool_seconds,
        write_seconds: t1.elapsed().as_secs_f64(),
    })
}

fn open(path: &Path, sink: Sink, len: u64) -> Result<File> {
    match sink {
        Sink::Device => {
            let meta = std::fs::metadata(path).map_err(io(path, "opening the sink"))?;
            if meta.is_file() {
                return Err(SynthError::Option {
                    option: "--out",
                    problem: format!("{} is a regular file, not a device sink", path.display()),
                });
            }
            OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(io(path, "opening the sink"))
        }
        Sink::File { overwrite } => {
            let mut oo = OpenOptions::new();
            oo.write(true);
            if overwrite {
                oo.create(true).truncate(true);
            } else {
                oo.create_new(true);
            }
            let f = oo.open(path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    SynthError::Option {
                        option: "--out",
                        problem: format!("{} exists; pass --force to replace it", path.display()),
                    }
                } else {
                    io(path, "creating the file")(e)
                }
            })?;
            // Gaps between tensors (alignment padding) read as zeros.
            f.set_len(len).map_err(io(path, "sizing the file"))?;
            Ok(f)
        }
    }
}
