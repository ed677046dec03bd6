//! `strata bench model` and `strata synth` end to end: the bench runs on the tiny fixture with
//! tiny sizes and its JSON has llama-bench's fields with consistent values; `--profile` and an
//! over-long depth are refused with a clear message before any output (`--profile` on the CPU;
//! on wgpu it counts dispatches per decode token); `synth --dry-run`
//! reports the README's totals and `synth` refuses to replace a file.

mod common;

use std::path::{Path, PathBuf};

use common::strata;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny/model-f32.gguf")
}

#[test]
fn bench_model_json_on_the_tiny_fixture() {
    let m = tiny();
    let out = strata(
        &[
            "bench",
            "model",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "8,16",
            "-n",
            "4",
            "-d",
            "0,8",
            "-r",
            "3",
            "-t",
            "1",
            "--json",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let rows = v.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["pp8", "pp16", "tg4", "pp8 @ d8", "pp16 @ d8", "tg4 @ d8"]
    );
    for r in rows {
        let (np, ng, d) = (
            r["n_prompt"].as_u64().unwrap(),
            r["n_gen"].as_u64().unwrap(),
            r["n_depth"].as_u64().unwrap(),
        );
        assert!((np > 0) != (ng > 0), "{r}");
        assert!(d == 0 || d == 8);
        assert_eq!(r["n_threads"], 1);
        assert!(r["model_n_params"].as_u64().unwrap() > 0);
        let ns: Vec<u64> = r["samples_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let ts: Vec<f64> = r["samples_ts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(ns.len(), 3);
        assert_eq!(r["samples_cpu_ns"].as_array().unwrap().len(), 3);
        // tokens/s of each repetition is its token count over its time, and the mean is theirs.
        let n = (np + ng) as f64;
        for (&t, &s) in ns.iter().zip(&ts) {
            assert!((s - n * 1e9 / t as f64).abs() <= 1e-6 * s, "{s} vs {t} ns");
        }
        let mean = ts.iter().sum::<f64>() / 3.0;
        assert!((r["avg_ts"].as_f64().unwrap() - mean).abs() <= 1e-9 * mean);
        assert!(r["stddev_ts"].as_f64().unwrap() >= 0.0);
        let best = ts.iter().copied().fold(0.0, f64::max);
        assert_eq!(r["best_ts"].as_f64().unwrap(), best);
    }
}

#[test]
fn bench_model_table_and_refusals() {
    let m = tiny();
    let m = m.to_str().unwrap();
    let out = strata(
        &["bench", "model", "-m", m, "-p", "4", "-n", "2", "-r", "1"],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with("| model | size | params | backend | threads | test | t/s |"));
    assert!(
        table.contains("| pp4 |") && table.contains("| tg2 |"),
        "{table}"
    );

    let out = strata(&["bench", "model", "-m", m, "--profile"], None);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--profile") && err.contains("CPU backend"),
        "{err}"
    );

    // An in-process A/B needs the CUDA backend's switches.
    let out = strata(
        &["bench", "model", "-m", m, "--ab", "STRATA_CUDA_QSA_PREP=0"],
        None,
    );
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--ab") && err.contains("CUDA backend"),
        "{err}"
    );
    // So do marginal costs; a list that names no kernel, or a name that is none, is refused
    // before anything loads; --ab and --ablate are one comparison or the other.
    for (args, want) in [
        (vec!["--ablate", "hc_down_bf16;*"], "CUDA backend"),
        (vec!["--ablate", " ; ,"], "no kernel named"),
        (vec!["--ablate", "hc_down_bf16;rm -rf"], "not a kernel name"),
        (
            vec!["--ab", "STRATA_CUDA_NOPE=0"],
            "not one of the STRATA_CUDA_* switches",
        ),
        (
            vec!["--ab", "STRATA_CUDA_QSA_PREP=0", "--ablate", "x"],
            "cannot be used with",
        ),
    ] {
        let mut a = vec!["bench", "model", "-m", m];
        a.extend(args.iter().copied());
        let out = strata(&a, None);
        assert!(!out.status.success(), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }

    // The tiny fixture's context is 4,096 positions.
    let out = strata(
        &[
            "bench", "model", "-m", m, "-p", "512", "-n", "0", "-d", "4000",
        ],
        None,
    );
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exceeds the model's context"), "{err}");
}

#[test]
fn synth_dry_run_reports_the_full_size_and_refuses_to_overwrite() {
    let out = strata(&["synth", "--dry-run"], None);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("trunk: 1224 tensors, 125.91 B params"),
        "{err}"
    );
    assert!(err.contains("(37.99 GB)"), "{err}");

    let dir = std::env::temp_dir().join(format!("strata-cli-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("m.gguf");
    std::fs::write(&p, b"x").unwrap();
    let out = strata(
        &[
            "synth",
            "--out",
            p.to_str().unwrap(),
            "--layers",
            "1",
            "--experts",
            "2",
            "--vocab",
            "1024",
        ],
        None,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(std::fs::read(&p).unwrap(), b"x");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_model_profile_on_wgpu_counts_dispatches_per_token() {
    // The dispatch count per decode token is the profile's first number; the per-kernel
    // dispatches add up to the same total. Skipped where no wgpu adapter exists.
    let m = tiny();
    let m = m.to_str().unwrap();
    let args = [
        "bench",
        "model",
        "-m",
        m,
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "--backend",
        "wgpu",
        "--profile",
    ];
    let out = strata(&args, None);
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success()
        && err.contains("--backend wgpu")
        && err.to_lowercase().contains("adapter")
    {
        eprintln!("SKIP: no wgpu adapter here ({err})");
        return;
    }
    assert!(out.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("profile (wgpu)"))
        .unwrap_or_else(|| panic!("no profile line: {err}"));
    let per_token: f64 = line
        .split("tokens): ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    // 8 profiled tokens (the profile runs at least 8); the table rows are per token.
    let rows: f64 = err
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| kernel") && !l.starts_with("| ---"))
        .filter_map(|l| l.split('|').nth(2)?.trim().parse::<f64>().ok())
        .sum();
    assert!(per_token > 50.0, "{line}");
    assert!(
        (rows - per_token).abs() < 0.5,
        "table {rows} vs {per_token}: {err}"
    );
    assert!(line.contains("1.0 submits per token"), "{line}");
}
