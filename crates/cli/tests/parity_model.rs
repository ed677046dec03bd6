//! `strata parity prompt | verify | ops -m MODEL`: the determinism contract on a whole model, through
//! the binary (issue "CUDA model", point 5: the suites run on every backend; here the CPU and,
//! where an adapter is found, wgpu/lavapipe). On the CPU prefill equals single steps and a
//! verify window equals single steps bit for bit, so every row must say BITWISE PASS; the ops
//! suite's rows (the overridable operations against their default compositions) likewise; a
//! bad suite argument is refused before any output.

mod common;

use std::process::{Command, Output};

use common::tiny;

fn parity(args: &[&str]) -> Output {
    let m = tiny();
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("parity")
        .args(args)
        .args(["-m", m.to_str().unwrap(), "--quick"])
        .output()
        .unwrap()
}

fn rows(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(str::to_string)
        .collect()
}

#[test]
fn prompt_suite_on_the_cpu_is_bitwise() {
    let out = parity(&["prompt", "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status);
    let r = rows(&out);
    assert_eq!(r.len(), 2, "one-call and chunked prefill rows: {r:?}");
    assert!(r[0].contains("prefill (one call) vs single steps") && r[0].contains("24 tokens"));
    assert!(r[1].contains("chunked prefill"));
    assert!(r.iter().all(|l| l.contains("BITWISE PASS")), "{r:?}");
}

#[test]
fn verify_suite_on_the_cpu_is_bitwise_for_windows_of_one_to_eight() {
    let out = parity(&["verify", "--backend", "cpu", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 8);
    for (w, r) in rows.iter().enumerate() {
        assert_eq!(r["shape"], format!("{} rows after 11", w + 1));
        assert_eq!(r["parity"], "BITWISE PASS", "{r}");
        assert_eq!(r["failed"], false);
    }
    assert_eq!(v["failed"], false);
}

#[test]
fn model_suites_refuse_bad_arguments_before_output() {
    let out = parity(&["prompt", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend 'tpu'"));
    let out = parity(&["verify", "--backend", "cpu", "--cold"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    // -m belongs to the model suites only.
    let out = parity(&["gemv", "--backend", "cpu"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("-m is for the prompt, verify and ops suites"));
}

#[test]
fn ops_suite_lists_the_overrides_against_their_default_compositions() {
    let out = parity(&["ops", "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status);
    let r = rows(&out);
    // Five operations × 1, 3 and 8 rows on the tiny qwen4exp file.
    assert_eq!(r.len(), 15, "{r:?}");
    for (op, n) in [
        ("hc_combine_mix vs hc_combine + hc_mix", 3),
        ("moe_block vs moe_block_composed", 3),
        (
            "rms_norm_prepared + matmul_prepared vs rms_norm + matmul",
            3,
        ),
        ("moe_experts_prepared vs matmul + moe_experts", 3),
        ("reshape_prepared", 3),
    ] {
        assert_eq!(
            r.iter().filter(|l| l.contains(op)).count(),
            n,
            "{op}: {r:?}"
        );
    }
    for rows in ["1 rows", "3 rows", "8 rows"] {
        assert_eq!(r.iter().filter(|l| l.contains(rows)).count(), 5, "{rows}");
    }
    assert!(r.iter().all(|l| l.contains("BITWISE PASS")), "{r:?}");
    // The CPU's rows say that its family overrides are the defaults.
    assert!(String::from_utf8_lossy(&out.stdout).contains("are the defaults themselves"));
}
