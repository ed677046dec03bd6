//! `STRATA_KERNELS=op=variant` changes what `strata run` executes on the CPU (issue "Boundary",
//! point 3): the CPU backend resolves its catalogue kernels (route, embed, xprep, rms_norm,
//! pick) when it is created, `-v` names the ones not in their default variant, and the
//! same-bits variants print exactly the default's text. (That each selected variant is the one
//! called is shown in-process by `crates/engine/tests/kernel_selection.rs`.) A bad selection
//! is an error naming it, before any output.

mod common;

use std::process::{Command, Output};

use common::tiny;

fn run(kernels: Option<&str>) -> Output {
    let m = tiny();
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args([
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hello there",
        "-n",
        "12",
        "--temp",
        "0",
        "-t",
        "1",
        "-v",
        "--backend",
        "cpu",
    ]);
    c.env_remove("STRATA_KERNELS");
    if let Some(k) = kernels {
        c.env("STRATA_KERNELS", k);
    }
    c.output().unwrap()
}

#[test]
fn a_kernel_selection_is_run_by_strata_run_with_the_same_text() {
    let base = run(None);
    assert!(
        base.status.success(),
        "{}",
        String::from_utf8_lossy(&base.stderr)
    );
    let e = String::from_utf8_lossy(&base.stderr);
    assert!(!e.contains("kernels "), "defaults are not listed: {e}");
    for (sel, listed) in [
        (
            "*=baseline",
            "kernels route=baseline, embed=baseline, xprep=baseline, rms_norm=baseline, pick=baseline",
        ),
        ("xprep=baseline,embed=baseline", "kernels embed=baseline, xprep=baseline"),
    ] {
        let o = run(Some(sel));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{sel}: {e}");
        assert!(e.contains(listed), "{sel}: {e}");
        assert_eq!(o.stdout, base.stdout, "{sel} changed the text");
    }
    // The GPU-order norm is taken (named), and still decodes.
    let o = run(Some("rms_norm=lanes"));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && e.contains("kernels rms_norm=lanes"),
        "{e}"
    );
}

#[test]
fn a_bad_kernel_selection_is_refused_before_any_output() {
    let o = run(Some("route=fast"));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty(), "wrote to stdout");
    assert!(
        e.contains("STRATA_KERNELS") && e.contains("fast") && !e.contains("panicked"),
        "{e}"
    );
}
