//! `--backend cpu|cuda|auto` and `--device N`: `auto` takes the CPU where no usable GPU exists
//! and says why with -v; `--backend cuda` without one is an error naming what is missing,
//! before any output and without a panic. (On a machine with a GPU the CUDA runs are checked by
//! crates/cuda/tests/model_gpu.rs; here the refusal is checked only where the driver is absent.)

mod common;

use common::{stderr, strata, tiny};

fn has_gpu() -> bool {
    strata_cuda::ensure_driver().is_ok()
}

#[test]
fn cuda_without_a_gpu_is_a_named_error_before_any_output() {
    if has_gpu() {
        eprintln!("SKIP: this machine has a CUDA driver; the refusal is for machines without one");
        return;
    }
    let m = tiny();
    let m = m.to_str().unwrap();
    for args in [
        vec!["run", "-m", m, "-p", "hi", "-n", "2", "--backend", "cuda"],
        vec![
            "bench",
            "model",
            "-m",
            m,
            "-p",
            "8",
            "-n",
            "2",
            "--backend",
            "cuda",
        ],
        vec![
            "logits",
            "-m",
            m,
            "--tokens",
            "1,2",
            "--out",
            "/tmp/strata-x.safetensors",
            "--backend",
            "cuda",
        ],
    ] {
        let o = strata(&args, None);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(o.stdout.is_empty(), "{args:?} wrote to stdout");
        assert!(
            e.contains("--backend cuda") && e.contains("driver") && !e.contains("panicked"),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn auto_takes_the_cpu_without_a_gpu_and_says_so() {
    if has_gpu() {
        eprintln!("SKIP: this machine has a CUDA driver (auto would take it)");
        return;
    }
    let m = tiny();
    let o = strata(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "3",
            "-v",
            "--temp",
            "0",
        ],
        None,
    );
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("backend: cpu") && e.contains("auto: no usable GPU"),
        "{e}"
    );
    let cpu = strata(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "3",
            "--temp",
            "0",
            "--backend",
            "cpu",
        ],
        None,
    );
    assert_eq!(
        o.stdout, cpu.stdout,
        "auto (CPU) and --backend cpu give the same text"
    );
}

#[test]
fn an_unknown_backend_is_refused_by_clap() {
    let o = strata(&["run", "-p", "x", "--backend", "metal"], None);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(e.contains("--backend") && e.contains("metal"), "{e}");
}

/// `--prefill exact|fast`: anything else is refused naming both; on the CPU (whose prefill is
/// always exact) `fast` changes nothing, so the greedy text is the same.
#[test]
fn the_prefill_mode_is_checked_and_the_cpus_text_does_not_depend_on_it() {
    let o = strata(&["run", "-p", "x", "--prefill", "quick"], None);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("--prefill") && e.contains("exact") && e.contains("fast"),
        "{e}"
    );
    let m = tiny();
    let m = m.to_str().unwrap();
    let run = |mode: &str| {
        strata(
            &[
                "run",
                "-m",
                m,
                "-p",
                "hello there",
                "-n",
                "6",
                "--temp",
                "0",
                "--backend",
                "cpu",
                "--prefill",
                mode,
            ],
            None,
        )
    };
    let (a, b) = (run("exact"), run("fast"));
    assert!(a.status.success() && b.status.success(), "{}", stderr(&b));
    assert!(!a.stdout.is_empty());
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn wgpu_gives_the_cpus_greedy_text_on_the_tiny_model() {
    let m = tiny();
    let m = m.to_str().unwrap();
    let args = |b: &'static str| {
        vec![
            "run",
            "-m",
            m,
            "-p",
            "hello",
            "-n",
            "8",
            "--temp",
            "0",
            "-v",
            "--backend",
            b,
        ]
    };
    let w = strata(&args("wgpu"), None);
    let e = stderr(&w);
    if !w.status.success() && e.contains("--backend wgpu") && e.to_lowercase().contains("adapter") {
        eprintln!("SKIP: no wgpu adapter here ({e})");
        return;
    }
    assert!(w.status.success(), "{e}");
    assert!(e.contains("on wgpu: "), "{e}");
    let c = strata(&args("cpu"), None);
    assert!(c.status.success(), "{}", stderr(&c));
    assert_eq!(w.stdout, c.stdout, "wgpu and cpu greedy text differ");
}

#[test]
fn wgpu_takes_a_context_whose_caches_exceed_the_binding_limit() {
    // 600,000 positions: the tiny model's K and V caches are 154 MB each, over lavapipe's
    // 128 MiB storage binding, so they are split into parts; the greedy text is the one of
    // the file's own (smaller) context.
    let m = tiny();
    let m = m.to_str().unwrap();
    let args = |ctx: Option<&'static str>| {
        let mut a = vec![
            "run",
            "-m",
            m,
            "-p",
            "hello",
            "-n",
            "8",
            "--temp",
            "0",
            "--backend",
            "wgpu",
        ];
        if let Some(c) = ctx {
            a.extend(["--ctx", c]);
        }
        a
    };
    let long = strata(&args(Some("600000")), None);
    let e = stderr(&long);
    if !long.status.success()
        && e.contains("--backend wgpu")
        && e.to_lowercase().contains("adapter")
    {
        eprintln!("SKIP: no wgpu adapter here ({e})");
        return;
    }
    assert!(long.status.success(), "{e}");
    let short = strata(&args(None), None);
    assert!(short.status.success(), "{}", stderr(&short));
    assert!(!long.stdout.is_empty());
    assert_eq!(
        long.stdout, short.stdout,
        "--ctx 600000 changed the greedy text"
    );
}
