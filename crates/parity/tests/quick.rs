//! The harness's CPU suites in quick mode (what CI runs): every baseline/optimized pair must
//! be bitwise equal on fresh random inputs, and the reports must render. Without a GPU the
//! CUDA backend must fail cleanly (an error naming the missing library, no panic).

use strata_parity::{run, BackendKind, Options, ParityError, Suite};

#[test]
fn cpu_suites_quick_all_pass() {
    let opts = Options::new(BackendKind::Cpu, true, false);
    for suite in Suite::ALL {
        let t = std::time::Instant::now();
        let rep = run(suite, &opts).unwrap_or_else(|e| panic!("{}: {e}", suite.name()));
        eprintln!(
            "{}: {} rows in {:.2?}",
            suite.name(),
            rep.rows.len(),
            t.elapsed()
        );
        assert!(!rep.rows.is_empty(), "{} produced no rows", suite.name());
        for r in &rep.rows {
            assert!(
                !r.failed,
                "{} {} {}: {}",
                suite.name(),
                r.kernel,
                r.shape,
                r.parity
            );
            assert!(r.base_us.is_finite() && r.cand_us.is_finite() && r.base_us >= 0.0);
        }
        let md = rep.markdown();
        assert!(md.contains(
            "| Kernel | Shape | Baseline (us) | Candidate (us) | Ratio | Delta | Parity |"
        ));
        assert_eq!(md.matches("BITWISE PASS").count(), rep.rows.len());
        let js = rep.json();
        assert_eq!(js["rows"].as_array().map(|a| a.len()), Some(rep.rows.len()));
        assert_eq!(js["failed"], serde_json::Value::Bool(false));
    }
}

#[test]
fn mtp_suite_covers_the_catalogue() {
    let opts = Options::new(BackendKind::Cpu, true, false);
    let rep = run(Suite::MtpAb, &opts).unwrap();
    for k in [
        "rms_xprep",
        "combine_gnorm",
        "xprep",
        "embed",
        "slop_pen",
        "pick",
    ] {
        assert!(
            rep.rows.iter().any(|r| r.kernel == k),
            "mtp-ab has no {k} row"
        );
    }
    assert_eq!(rep.rows.iter().filter(|r| r.kernel == "embed").count(), 13);
    assert_eq!(
        rep.rows.iter().filter(|r| r.kernel == "slop_pen").count(),
        6
    );
}

#[test]
fn cuda_backend_reports_absence_cleanly() {
    let mut opts = Options::new(BackendKind::Cuda, true, false);
    opts.reps = 3;
    match run(Suite::Sample, &opts) {
        Ok(rep) => {
            // A machine with a GPU: the suite must pass.
            assert!(!rep.failed(), "{}", rep.markdown());
        }
        Err(ParityError::Cuda(e)) => {
            let msg = e.to_string();
            eprintln!("no CUDA here (expected on CI): {msg}");
            assert!(
                msg.contains("not available") || msg.contains("not found"),
                "{msg}"
            );
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}
