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
                Err(e) => failures.push(format!("{} sm_{}{}: {e}", m.file, arch.0, arch.1)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
