//! The wgpu suites in quick mode on whatever adapter is here (lavapipe on CI): every
//! baseline/optimized pair bitwise equal, every kernel within its stated agreement with the
//! CPU reference. With no adapter the test says so and passes (scripts/test installs
//! lavapipe where it can).

use strata_parity::{open, run_on, BackendKind, Options, ParityError, Suite};

fn backend() -> Option<Box<dyn strata_parity::backend::KernelBackend>> {
    let opts = Options::new(BackendKind::Wgpu, true, false);
    match open(&opts) {
        Ok(b) => Some(b),
        Err(ParityError::Wgpu(strata_wgpu::WgpuError::NoAdapter(m))) => {
            eprintln!("SKIPPED: no wgpu adapter here ({m})");
            None
        }
        Err(e) => panic!("opening the wgpu backend failed: {e}"),
    }
}

#[test]
fn wgpu_suites_quick_all_pass() {
    let Some(be) = backend() else { return };
    let mut opts = Options::new(BackendKind::Wgpu, true, false);
    opts.reps = 3;
    let mut failures = Vec::new();
    for suite in Suite::ALL {
        let t = std::time::Instant::now();
        let rep =
            run_on(be.as_ref(), suite, &opts).unwrap_or_else(|e| panic!("{}: {e}", suite.name()));
        eprintln!(
            "{} in {:.2?}\n{}",
            suite.name(),
            t.elapsed(),
            rep.markdown()
        );
        assert!(!rep.rows.is_empty());
        for r in rep.rows.iter().filter(|r| r.failed) {
            failures.push(format!(
                "{} {} {}: {} / {}",
                suite.name(),
                r.kernel,
                r.shape,
                r.parity,
                r.vs_cpu
            ));
        }
        for r in &rep.rows {
            assert_ne!(r.vs_cpu, "-", "every wgpu row is compared with the CPU");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
