//! `strata selftest`: the parity suites on one backend, summed up as lines to paste back.

mod common;

use common::{stderr, strata};

#[test]
fn selftest_on_the_cpu_runs_every_suite_and_passes() {
    let o = strata(&["selftest", "--backend", "cpu"], None);
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(o.status.success(), "{out}{}", stderr(&o));
    assert!(out.starts_with("strata selftest "), "{out}");
    assert!(out.contains("cpu backend: "), "{out}");
    for suite in ["mtp-ab", "router-ab", "sample", "gemv"] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("suite {suite} ")))
            .unwrap_or_else(|| panic!("no line for {suite}: {out}"));
        // "N rows, N bitwise equal ..., 0 failed; digest <16 hex>"
        let n: Vec<usize> = line
            .split_whitespace()
            .filter_map(|w| w.trim_end_matches(',').parse().ok())
            .collect();
        assert!(
            n.len() >= 3 && n[0] > 0 && n[0] == n[1] && n[2] == 0,
            "{line}"
        );
        let digest = line.rsplit(' ').next().unwrap();
        assert!(
            digest.len() == 16 && digest.chars().all(|c| c.is_ascii_hexdigit()),
            "{line}"
        );
    }
    assert!(
        out.trim_end()
            .lines()
            .last()
            .unwrap()
            .starts_with("VERDICT: PASS"),
        "{out}"
    );
}

#[test]
fn selftest_with_an_unknown_backend_is_a_named_error() {
    let o = strata(&["selftest", "--backend", "metal"], None);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty());
    let e = stderr(&o);
    assert!(
        e.contains("unknown backend 'metal'") && e.contains("wgpu"),
        "{e}"
    );
}
