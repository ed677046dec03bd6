//! CI compile check: every `.cu` module compiles with NVRTC for Hopper (sm_90, the H200). Needs
//! no GPU; skips with a message when libnvrtc cannot be found (point `STRATA_NVRTC_LIB` at
//! `libnvrtc.so.13`, e.g. from the `nvidia-cuda-nvrtc` wheel).

use strata_cuda::{nvrtc, sources};

/// Every module compiles for sm_90 (NVRTC, no GPU), and ptxas's resource report (registers,
/// stack frame, spills) of every kernel is printed (`--nocapture`); fails if a module does not
/// compile or an optimized kernel spills or keeps a stack frame. One compile a module, the
/// modules spread over the cores (CI's compile check is most of this binary's time). Skipped
/// with a message without NVRTC. The tensor-core products (mmq.cu) are held to the same.
/// `STRATA_NVRTC_ONLY=gemv_bf16,norm` compiles only the modules named (a kernel edit's quick
/// check; the test says which it left out).
#[test]
fn every_module_compiles_and_optimized_kernels_do_not_spill() {
    if let Err(e) = nvrtc::ensure_nvrtc() {
        eprintln!("SKIPPED every_module_compiles_and_optimized_kernels_do_not_spill: {e}");
        return;
    }
    let v = nvrtc::version().expect("nvrtc version");
    eprintln!("NVRTC {}.{}", v.0, v.1);
    let only: Option<Vec<String>> = std::env::var("STRATA_NVRTC_ONLY")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let picked: Vec<&sources::Module> = sources::MODULES
        .iter()
        .filter(|m| only.as_ref().is_none_or(|o| o.iter().any(|n| n == m.name)))
        .collect();
    if let Some(o) = &only {
        eprintln!(
            "STRATA_NVRTC_ONLY={}: {} of {} modules",
            o.join(","),
            picked.len(),
            sources::MODULES.len()
        );
        assert!(!picked.is_empty(), "STRATA_NVRTC_ONLY names no module");
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|sc| {
        for _ in 0..threads.min(picked.len()) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(m) = picked.get(i) else {
                    break;
                };
                let t = std::time::Instant::now();
                let r = nvrtc::compile_log(m.name, &m.source(), (9, 0), &["--ptxas-options=-v"]);
                // STRATA_NVRTC_DUMP=DIR: each module's cubin written there too (for nvdisasm
                // without a GPU: instruction counts of a kernel edit).
                if let Some(dir) = std::env::var_os("STRATA_NVRTC_DUMP") {
                    let _ = std::fs::write(
                        std::path::Path::new(&dir).join(format!("{}.cu", m.name)),
                        m.source(),
                    );
                    if let Ok(c) = nvrtc::compile_cubin(m.name, &m.source(), (9, 0)) {
                        let _ = std::fs::write(
                            std::path::Path::new(&dir).join(format!("{}.cubin", m.name)),
                            c,
                        );
                    }
                }
                let mut out = results.lock().unwrap_or_else(|p| p.into_inner());
                out.push((i, r.map(|log| (log, t.elapsed()))));
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|(i, _)| *i);
    let (mut failures, mut bad) = (Vec::new(), Vec::new());
    for (i, r) in results {
        let m = picked[i];
        let (log, took) = match r {
            Ok(x) => x,
            Err(e) => {
                failures.push(format!("{} ({}) sm_90: {e}", m.name, m.file));
                continue;
            }
        };
        eprintln!("{} ({}) sm_90: compiled in {took:.1?}", m.name, m.file);
        let mut func = String::new();
        for line in log.lines() {
            if let Some(i) = line.find("Compiling entry function '") {
                func = line[i + 26..]
                    .trim_end_matches(['\'', ' '])
                    .split('\'')
                    .next()
                    .unwrap_or("")
                    .to_string();
            }
            if line.contains("bytes stack frame") {
                eprintln!("{:>8} {func}: {}", m.name, line.trim());
                let spill =
                    !line.contains("0 bytes spill stores") || !line.contains("0 bytes spill loads");
                if live_optimized(&func) && (spill || !line.contains(" 0 bytes stack frame")) {
                    bad.push(format!("{func}: {}", line.trim()));
                }
            }
            if line.contains("Used ") && line.contains("registers") {
                eprintln!("{:>8} {func}: {}", m.name, line.trim());
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(
        bad.is_empty(),
        "optimized kernels with stack frames or spills:\n{}",
        bad.join("\n")
    );
}

/// The kernels that must not spill: the catalogue's optimized variants and the model's fused
/// and unit-parallel products (the live path of a decode step).
fn live_optimized(func: &str) -> bool {
    func.contains("_opt")
        || func.contains("units")
        || func.starts_with("hc_")
        || func.starts_with("moe_gate_up")
        || func.starts_with("moe_down_combine")
        || func == "moe_down_q2s"
        || func == "xprep_multi"
        || func == "swiglu_xprep"
        || func.starts_with("mmq_")
        || func.starts_with("mmqw_")
        || func.starts_with("moe_mmq")
        || func.starts_with("mmt_")
        || func.starts_with("attend_group_")
        || func.starts_with("gdn_scan_ring_128")
        || func.starts_with("conv1d_rows")
}
