//! CI compile check: every `.cu` module compiles with NVRTC for Hopper (sm_90, the H200). Needs
//! no GPU; skips with a message when libnvrtc cannot be found (point `STRATA_NVRTC_LIB` at
//! `libnvrtc.so.13`, e.g. from the `nvidia-cuda-nvrtc` wheel).

use strata_cuda::{nvrtc, sources};

#[test]
fn every_module_compiles() {
    if let Err(e) = nvrtc::ensure_nvrtc() {
        eprintln!("SKIPPED every_module_compiles: {e}");
        return;
    }
    let v = nvrtc::version().expect("nvrtc version");
    eprintln!("NVRTC {}.{}", v.0, v.1);
    let mut failures = Vec::new();
    for arch in [(9, 0)] {
        for m in sources::MODULES {
            let t = std::time::Instant::now();
            match nvrtc::compile_cubin(m.name, &m.source(), arch) {
                Ok(c) => eprintln!(
                    "{} sm_{}{}: {} bytes in {:.1?}",
                    m.file,
                    arch.0,
                    arch.1,
                    c.len(),
                    t.elapsed()
                ),
                Err(e) => failures.push(format!(
                    "{} ({}) sm_{}{}: {e}",
                    m.name, m.file, arch.0, arch.1
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// ptxas's resource report (registers, stack frame, spills) of every kernel for sm_90, printed
/// (`--nocapture`); fails if an optimized kernel spills or keeps a stack frame. Needs only
/// NVRTC (no GPU); skipped with a message without it. The tensor-core products (mmq.cu) are
/// held to the same.
#[test]
fn optimized_kernels_do_not_spill() {
    if let Err(e) = nvrtc::ensure_nvrtc() {
        eprintln!("SKIPPED optimized_kernels_do_not_spill: {e}");
        return;
    }
    let mut bad = Vec::new();
    for m in sources::MODULES {
        let log = nvrtc::compile_log(m.name, &m.source(), (9, 0), &["--ptxas-options=-v"])
            .expect("compile");
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
        || func == "xprep_multi"
        || func == "swiglu_xprep"
        || func.starts_with("mmq_")
        || func.starts_with("moe_mmq_")
        || func.starts_with("mmt_")
}
