//! `strata run` / `strata chat` with the sampler flags of sampling_args.rs: a phrase banned
//! with --slop-phrase is not written (default model; skipped with a message when it is not
//! cached), --verbose prints the whole chain as JSON in --samplers order, that JSON run back
//! through --sampler gives the same text, and bad flags fail with a message naming them.

use std::path::PathBuf;
use std::process::Output;

mod common;
use common::{default_model, strata};
const PROMPT: &str = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n\
                      <|im_start|>assistant\n";

fn ok(o: &Output) -> (String, String) {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "failed: {err}");
    (out, err)
}

#[test]
fn slop_phrase_bans_what_the_model_writes() {
    let Some(model) = default_model() else {
        return;
    };
    let m = model.to_str().unwrap();
    let base = [
        "run",
        "-m",
        m,
        "-p",
        PROMPT,
        "--no-echo",
        "-n",
        "40",
        "-t",
        "2",
        "--temp",
        "0",
    ];
    let (free, _) = ok(&strata(&base, None));
    assert!(free.contains("there was"), "{free}");
    let mut args = base.to_vec();
    args.extend(["--slop-phrase", "There was", "--slop-list", "none", "-v"]);
    let (banned, err) = ok(&strata(&args, None));
    assert!(!banned.to_lowercase().contains("there was"), "{banned}");
    assert_ne!(banned, free);
    // The first words, before the phrase, are the same.
    assert_eq!(&banned[..20], &free[..20]);
    // --verbose shows the chain; run back through --sampler it gives the same text.
    let json = err
        .lines()
        .find_map(|l| l.split_once("; sampler ").map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no sampler line in {err}"));
    assert!(json.contains(r#""ban":["There was"]"#), "{json}");
    let mut args = base.to_vec();
    args.extend(["--sampler", &json]);
    let (again, _) = ok(&strata(&args, None));
    assert_eq!(again, banned);
    // chat takes the same flags.
    let (reply, _) = ok(&strata(
        &[
            "chat",
            "-m",
            m,
            "-n",
            "30",
            "-t",
            "2",
            "--temp",
            "0",
            "--slop-phrase",
            "there was",
            "--slop-list",
            "none",
        ],
        Some("Write a short story about a lighthouse keeper.\n"),
    ));
    assert!(!reply.to_lowercase().contains("there was"), "{reply}");
}

#[test]
fn the_chain_follows_samplers_order_and_bad_flags_are_named() {
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/qwen4exp/tiny/model-f32.gguf");
    let t = tiny.to_str().unwrap();
    let base = [
        "run",
        "-m",
        t,
        "-p",
        "hello",
        "-n",
        "3",
        "--no-echo",
        "-v",
        "--seed",
        "1",
    ];
    let mut args = base.to_vec();
    args.extend([
        "--samplers",
        "temperature,top_k,slop,penalties",
        "--repeat-penalty",
        "1.2",
        "--slop-mode",
        "1",
    ]);
    let (_, err) = ok(&strata(&args, None));
    let line = err.lines().find(|l| l.contains("; sampler ")).unwrap();
    let order: Vec<usize> = ["temperature", "top_k", "slop", "penalties"]
        .iter()
        .map(|n| line.find(&format!(r#""type":"{n}""#)).unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{line}");
    // Stages at neutral settings are left out (DRY is off by default).
    assert!(!line.contains(r#""type":"dry""#), "{line}");
    for (bad, what) in [
        (vec!["--samplers", "top_k;nope"], "--samplers"),
        (vec!["--slop-mode", "3"], "--slop-mode 3"),
        (
            vec!["--slop-list", "/nonexistent/slop.txt"],
            "/nonexistent/slop.txt",
        ),
        (vec!["--repeat-penalty", "0"], "--repeat-penalty 0"),
        (
            vec!["--dry-multiplier", "1", "--dry-base", "0.5"],
            "--dry-base 0.5",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend(bad.iter().copied());
        let o = strata(&args, None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{bad:?} accepted");
        assert!(err.contains(what), "{bad:?}: {err}");
    }
}
