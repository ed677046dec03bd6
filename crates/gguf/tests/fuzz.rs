//! Mutation fuzzing of the reader (and of the writer on everything the reader accepts). The
//! short run is part of the normal tests; the long run is `#[ignore]`d:
//!   STRATA_FUZZ_INPUTS=1000000 cargo test --release -p strata-gguf --test fuzz -- --ignored
//! A counting allocator bounds every single allocation by a multiple of the input size, so a
//! count or length taken from the file without a check fails the run instead of passing quietly.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use strata_gguf::fuzzing::{check, mutate, seeds, Rng};
use strata_gguf::{GgufFile, GgufWriter};

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only records the largest request.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with layout `l`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The seeds: the synthetic ones plus the real tiny model's metadata and tensor table (with
/// its tensors shrunk so each mutated input stays small).
fn all_seeds() -> Vec<Vec<u8>> {
    let mut s = seeds();
    let tiny =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny/model-bf16.gguf");
    match GgufFile::open(&tiny) {
        Ok(f) => {
            let mut w = GgufWriter::new();
            for (k, v) in f.metadata() {
                w.add_kv(k.clone(), v.clone());
            }
            for t in f.tensors().iter().take(6) {
                let ty = f.tensor_type(t).expect("fixture types are known");
                let n = ty.block_size() as u64;
                w.add_tensor(&t.name, &[n], ty, &vec![7u8; ty.type_size()])
                    .expect("one block");
            }
            s.push(w.to_bytes().expect("valid seed"));
        }
        Err(e) => eprintln!("fuzz: not seeding from the tiny model: {e}"),
    }
    s
}

/// Runs `n` mutated inputs; returns (inputs, accepted, slowest input).
fn run(n: usize, seed: u64) -> (usize, usize, Duration) {
    let seeds = all_seeds();
    for s in &seeds {
        assert!(
            GgufFile::from_bytes(s.clone(), "seed").is_ok(),
            "every seed must be valid"
        );
    }
    let mut rng = Rng::new(seed);
    let mut accepted = 0;
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let a = &seeds[rng.below(seeds.len())];
        let b = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, a, b);
        LARGEST.store(0, Ordering::Relaxed);
        let t = Instant::now();
        let r = std::panic::catch_unwind(|| check(&input));
        let dt = t.elapsed();
        if r.is_err() {
            let path = std::env::temp_dir().join(format!("gguf-fuzz-crash-{seed}-{i}.bin"));
            let _ = std::fs::write(&path, &input);
            panic!(
                "input {i} (seed {seed}) panicked; saved to {}",
                path.display()
            );
        }
        // Parsed structures may take a few times the file size (a String per 8-byte string
        // record, hash tables); a rewrite may pad each tensor by one alignment.
        let bound = 64 * input.len() + (1 << 20);
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            largest <= bound,
            "input {i} (seed {seed}): allocation of {largest} bytes for a {}-byte input",
            input.len()
        );
        slowest = slowest.max(dt);
        accepted += GgufFile::from_bytes(input, "x").is_ok() as usize;
    }
    (n, accepted, slowest)
}

#[test]
fn short_fuzz_run_has_no_panic_hang_or_huge_allocation() {
    let (n, accepted, slowest) = run(20_000, 1);
    eprintln!("fuzz: {n} inputs, {accepted} accepted, slowest {slowest:?}");
    // The mutator must reach both sides: mostly refusals, some accepted files.
    assert!(
        accepted > 100 && accepted < n / 2,
        "accepted {accepted} of {n}"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "slowest input took {slowest:?}"
    );
}

#[test]
#[ignore = "long run (1M inputs); see docs/ROBUSTNESS.md"]
fn long_fuzz_run() {
    let n = std::env::var("STRATA_FUZZ_INPUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let seed = std::env::var("STRATA_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let t = Instant::now();
    let (n, accepted, slowest) = run(n, seed);
    eprintln!(
        "fuzz: {n} inputs (seed {seed}), {accepted} accepted, slowest {slowest:?}, total {:?}",
        t.elapsed()
    );
}
