//! Issue 17, "CLI safety", end to end on the binary: no command destroys its input or leaves a
//! partial file; a closed stdout ends every command quietly; every flag is checked against its
//! range (naming flag, value and range) before the first byte of output; errors say what is
//! wrong once and clearly; the context limit is always reported. The tiny qwen4exp fixture is
//! used where it suffices, the cached default model (skipped with a message when absent) where
//! a qwen2 file or a large tensor is needed.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::{default_model, fixtures, rewrite_gguf, scratch, stderr, strata, tiny};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of the tiny model that a test may lose (today's binary destroys it).
fn tiny_copy(dir: &Path) -> PathBuf {
    let p = dir.join("model.gguf");
    std::fs::copy(tiny(), &p).unwrap();
    p
}

fn assert_refused(args: &[&str], want: &[&str]) -> String {
    let out = strata(args, None);
    let err = stderr(&out);
    assert!(!out.status.success(), "strata {args:?} succeeded: {err}");
    assert!(
        out.stdout.is_empty(),
        "strata {args:?} wrote to stdout before refusing"
    );
    for w in want {
        assert!(err.contains(w), "strata {args:?}: {w:?} not in {err:?}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn folder_names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

// 1. Output onto input.

#[test]
fn inspect_dump_onto_its_input_or_a_link_to_it_is_refused() {
    let d = scratch("dump-onto-input");
    let m = tiny_copy(&d);
    let before = std::fs::read(&m).unwrap();
    std::os::unix::fs::symlink(&m, d.join("link.npy")).unwrap();
    std::fs::hard_link(&m, d.join("hard.npy")).unwrap();
    for out in [m.clone(), d.join("link.npy"), d.join("hard.npy")] {
        assert_refused(
            &[
                "inspect",
                s(&m),
                "--dump",
                "token_embd.weight",
                "--out",
                s(&out),
            ],
            &["destroy the input"],
        );
        assert_eq!(std::fs::read(&m).unwrap(), before, "the input changed");
    }
    // A real dump still works and leaves only its file.
    let ok = strata(
        &[
            "inspect",
            s(&m),
            "--dump",
            "token_embd.weight",
            "--out",
            s(&d.join("e.npy")),
        ],
        None,
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert_eq!(
        folder_names(&d),
        ["e.npy", "hard.npy", "link.npy", "model.gguf"]
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn logits_outputs_onto_the_model_or_onto_each_other_are_refused() {
    let d = scratch("logits-onto-input");
    let m = tiny_copy(&d);
    let before = std::fs::read(&m).unwrap();
    assert_refused(
        &["logits", "-m", s(&m), "--text", "hi", "--out", s(&m)],
        &["--out", "destroy the input"],
    );
    let x = d.join("x.safetensors");
    assert_refused(
        &[
            "logits",
            "-m",
            s(&m),
            "--text",
            "hi there",
            "--out",
            s(&x),
            "--mtp-out",
            s(&x),
        ],
        &["same file"],
    );
    assert_eq!(std::fs::read(&m).unwrap(), before);
    assert_eq!(folder_names(&d), ["model.gguf"]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn draft_vocab_output_onto_the_model_or_a_corpus_is_refused() {
    let d = scratch("dv-onto-input");
    let m = tiny_copy(&d);
    let corpus = d.join("corpus.txt");
    std::fs::write(&corpus, "the river keeps its own time\n").unwrap();
    for out in [&m, &corpus] {
        assert_refused(
            &[
                "draft-vocab",
                "build",
                "-m",
                s(&m),
                "--corpus",
                s(&corpus),
                "--size",
                "8",
                "-o",
                s(out),
            ],
            &["destroy the input"],
        );
    }
    assert_eq!(
        std::fs::read_to_string(&corpus).unwrap(),
        "the river keeps its own time\n"
    );
    assert_eq!(std::fs::read(&m).unwrap(), std::fs::read(tiny()).unwrap());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn convert_mtp_output_inside_the_checkpoint_never_replaces_a_checkpoint_file() {
    let d = scratch("convert-onto-input");
    let hf = d.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let src = fixtures().join("qwen4exp/tiny/hf");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), hf.join(e.file_name())).unwrap();
    }
    let before = std::fs::read(hf.join("model.safetensors")).unwrap();
    for name in ["model.safetensors", "config.json"] {
        assert_refused(
            &["convert-mtp", s(&hf), "-o", s(&hf.join(name))],
            &["destroy the input"],
        );
    }
    assert_eq!(std::fs::read(hf.join("model.safetensors")).unwrap(), before);
    // A new file inside the folder is fine, and no temporary stays beside it.
    let ok = strata(
        &["convert-mtp", s(&hf), "-o", s(&hf.join("mtp.gguf"))],
        None,
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert_eq!(
        folder_names(&hf),
        [
            "config.json",
            "model.safetensors",
            "mtp.gguf",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_interrupted_dump_leaves_no_partial_file_and_the_old_one_intact() {
    let Some(model) = default_model() else {
        return;
    };
    let d = scratch("dump-interrupt");
    let out = d.join("e.npy");
    std::fs::write(&out, b"old").unwrap();
    // token_embd of the 0.5B model is 545 MB as f32: the dump is still running when the
    // temporary appears.
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "inspect",
            s(&model),
            "--dump",
            "token_embd.weight",
            "--out",
            s(&out),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while !folder_names(&d).iter().any(|n| n.contains(".strata-tmp")) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the dump ended before writing a temporary"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGINT),
        "{status:?}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"old");
    assert_eq!(folder_names(&d), ["e.npy"]);
    std::fs::remove_dir_all(&d).unwrap();
}

// 4. Broken pipes.

/// Runs `strata` with stdout a pipe whose reader is already gone (`| true`): every write fails
/// with EPIPE.
fn with_closed_stdout(args: &[&str], env: &[(&str, &OsStr)]) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let err = stderr(&out);
    assert!(
        out.status.success(),
        "strata {args:?} | true: {:?}: {err}",
        out.status
    );
    assert!(
        !err.contains("panicked") && !err.contains("error"),
        "strata {args:?} | true: {err}"
    );
}

#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let t = tiny();
    with_closed_stdout(&["tokenize", "-m", s(&t), "-p", "hello"], &[]);
    with_closed_stdout(&["tokenize", "-m", s(&t), "-p", "hello", "--pieces"], &[]);
    with_closed_stdout(&["inspect", s(&t)], &[]);
    with_closed_stdout(&["inspect", s(&t), "--json"], &[]);
    with_closed_stdout(
        &["run", "-m", s(&t), "-p", "hi", "-n", "4", "--temp", "0"],
        &[],
    );
    with_closed_stdout(&["chat", "-m", s(&t), "-n", "4", "--temp", "0"], &[]);
    with_closed_stdout(
        &[
            "bench", "formats", "--types", "q4_0", "--sizes", "l1", "--min-ms", "1",
        ],
        &[],
    );
    with_closed_stdout(&["--help"], &[]);
}

#[test]
fn a_closed_stdout_ends_fetch_quietly() {
    let Some(model) = default_model() else {
        return;
    };
    let cache = scratch("fetch-pipe");
    std::fs::create_dir_all(cache.join("models")).unwrap();
    std::os::unix::fs::symlink(&model, cache.join("models").join(common::MODEL_FILE)).unwrap();
    with_closed_stdout(&["fetch"], &[("STRATA_CACHE", cache.as_os_str())]);
    std::fs::remove_dir_all(&cache).unwrap();
}

// 5–7. Ranges, negative values, everything checked before the first byte.

#[test]
fn out_of_range_values_are_refused_naming_flag_value_and_range() {
    let t = tiny();
    let base = ["run", "-m", s(&t), "-p", "The river"];
    for (extra, want) in [
        (
            &["--top-p", "2"][..],
            "--top-p 2: out of range; expected a number in (0, 1]",
        ),
        (&["--top-p", "nan"], "--top-p NaN: out of range"),
        (&["--min-p", "nan"], "--min-p NaN: out of range"),
        (
            &["--min-p", "5"],
            "--min-p 5: out of range; expected a number in [0, 1]",
        ),
        (
            &["--temp=-1"],
            "--temp -1: out of range; expected a number ≥ 0",
        ),
        (&["--temp", "-1"], "--temp -1: out of range"),
        (
            &["--repeat-penalty", "0"],
            "--repeat-penalty 0: out of range",
        ),
        (
            &["--presence-penalty", "nan"],
            "--presence-penalty NaN: out of range",
        ),
        (&["--dry-base", "0.5"], "--dry-base 0.5: out of range"),
        (
            &["--spec", "0"],
            "--spec 0: out of range; expected a verify window of 1 to 8",
        ),
        (&["--spec", "9"], "--spec 9: out of range"),
        (
            &["--spec-min-p", "2"],
            "--spec-min-p 2: out of range; expected a probability in [0, 1]",
        ),
        (&["--ctx", "0"], "--ctx 0: out of range"),
        (
            &[
                "--sampler",
                r#"{"stages":[{"type":"top_p","p":2}],"pick":{"type":"greedy"}}"#,
            ],
            "top_p 2; expected a number in (0, 1]",
        ),
        (
            &[
                "--sampler",
                r#"{"stages":[{"type":"temperature","t":-1}],"pick":{"type":"greedy"}}"#,
            ],
            "temperature -1; expected a finite number ≥ 0",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        assert_refused(&args, &[want]);
    }
}

#[test]
fn negative_numbers_are_taken_as_values() {
    let t = tiny();
    let out = strata(
        &[
            "run",
            "-m",
            s(&t),
            "-p",
            "The river",
            "-n",
            "3",
            "--temp",
            "0",
            "--presence-penalty",
            "-0.5",
            "--frequency-penalty",
            "-0.25",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .starts_with("The river"));
}

#[test]
fn an_over_long_prompt_is_refused_before_any_output() {
    let t = tiny();
    // "The river keeps its own time." is more than 8 tokens in the fixture's vocabulary.
    assert_refused(
        &[
            "run",
            "-m",
            s(&t),
            "-c",
            "8",
            "-p",
            "The river keeps its own time.",
            "--temp",
            "0",
        ],
        &["tokens; the context holds 8 positions, so a prompt may have at most 7"],
    );
}

#[test]
fn a_prompt_of_exactly_n_ctx_tokens_is_handled_alike_by_run_and_logits() {
    let Some(model) = default_model() else {
        return;
    };
    let file = strata_gguf::GgufFile::open(&model).unwrap();
    let tok = strata_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let n_ctx = 32768;
    // " a" is one token of the default model's vocabulary.
    let text = " a".repeat(n_ctx);
    assert_eq!(tok.encode(&text, true, true).unwrap().len(), n_ctx);
    let d = scratch("exact-ctx");
    let prompt = d.join("prompt.txt");
    std::fs::write(&prompt, &text).unwrap();
    let want = format!("the prompt has {n_ctx} tokens; the context holds {n_ctx} positions");
    assert_refused(
        &[
            "run",
            "-m",
            s(&model),
            "--file",
            s(&prompt),
            "-n",
            "1",
            "--temp",
            "0",
        ],
        &[&want],
    );
    let ids = vec!["220"; n_ctx].join(",");
    assert_refused(
        &[
            "logits",
            "-m",
            s(&model),
            "--tokens",
            &ids,
            "--out",
            s(&d.join("l.st")),
        ],
        &[&want],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

// 8. Threads.

#[test]
fn threads_beyond_the_cores_are_capped_with_a_warning() {
    let t = tiny();
    let cores = std::thread::available_parallelism().unwrap().get();
    let out = strata(
        &[
            "run",
            "-m",
            s(&t),
            "-p",
            "hi",
            "-n",
            "2",
            "--temp",
            "0",
            "-t",
            "1000",
            "-v",
        ],
        None,
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "warning: --threads 1000: this machine runs {cores} threads at once; using {cores}"
        )),
        "{err}"
    );
    assert!(err.contains(&format!("on cpu ({cores} threads")), "{err}");
}

// 9. Clear errors.

#[test]
fn a_folder_as_the_model_is_called_a_folder() {
    let dir = fixtures().join("qwen4exp/tiny");
    let err = assert_refused(
        &["run", "-m", s(&dir), "-p", "hi"],
        &["is a folder", "model-f32.gguf"],
    );
    assert!(!err.contains("os error"), "{err}");
}

#[test]
fn an_os_error_is_printed_once() {
    for args in [
        &["run", "-m", "/nonexistent/m.gguf", "-p", "hi"][..],
        &[
            "logits",
            "-m",
            "/nonexistent/m.gguf",
            "--text",
            "hi",
            "--out",
            "/tmp/x.st",
        ],
        &["tokenize", "-m", "/nonexistent/m.gguf", "-p", "hi"],
        &["inspect", "/nonexistent/m.gguf"],
    ] {
        let err = assert_refused(args, &["/nonexistent/m.gguf", "os error 2"]);
        assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    }
}

#[test]
fn speculation_on_qwen2_says_it_needs_qwen4exp() {
    let Some(model) = default_model() else {
        return;
    };
    assert_refused(
        &["run", "-m", s(&model), "--spec", "4", "-p", "hi"],
        &["MTP speculation needs a qwen4exp model"],
    );
}

#[test]
fn an_unsupported_architecture_lists_both_supported_ones() {
    let d = scratch("arch");
    let m = d.join("llama.gguf");
    rewrite_gguf(
        &tiny(),
        &m,
        &|k| (k == "general.architecture").then(|| strata_gguf::Value::String("llama".into())),
        &|_, _| None,
    );
    for args in [
        &[
            "logits",
            "-m",
            s(&m),
            "--text",
            "hi",
            "--out",
            s(&d.join("x.st")),
        ][..],
        &["run", "-m", s(&m), "-p", "hi"],
    ] {
        assert_refused(
            args,
            &["architecture 'llama' is not supported; expected qwen2 or qwen4exp"],
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bench_spec_windows_are_checked_and_the_help_default_parses() {
    assert_refused(
        &["bench", "spec", "--synthetic", "medium", "--windows", "0"],
        &["--windows 0: out of range"],
    );
    let help = strata(&["bench", "spec", "--help"], None);
    let help = String::from_utf8(help.stdout).unwrap();
    // The option's default: on its line, or below it when clap lays the help out long.
    let default = help
        .split_once("--windows")
        .map(|(_, rest)| rest.split("\n      -").next().unwrap_or(rest))
        .and_then(|l| l.split("[default: ").nth(1))
        .and_then(|r| r.split(']').next())
        .filter(|d| d.contains(','))
        .unwrap_or_else(|| panic!("no comma-separated default for --windows in {help}"));
    // The default as written is accepted (the run then stops at -n, checked after parsing).
    assert_refused(
        &[
            "bench",
            "spec",
            "--synthetic",
            "medium",
            "--windows",
            default,
            "-n",
            "1",
        ],
        &["-n 1: out of range"],
    );
}

#[test]
fn a_damaged_eos_id_or_norm_weight_is_refused_at_load() {
    let d = scratch("damaged");
    let eos = d.join("eos.gguf");
    rewrite_gguf(
        &tiny(),
        &eos,
        &|k| (k == "tokenizer.ggml.eos_token_id").then_some(strata_gguf::Value::U32(99_999)),
        &|_, _| None,
    );
    assert_refused(
        &["run", "-m", s(&eos), "-p", "hi", "-n", "2"],
        &["99999", "outside the vocabulary"],
    );
    let nan = d.join("nan.gguf");
    rewrite_gguf(&tiny(), &nan, &|_| None, &|name, bytes| {
        (name == "blk.1.hc_ffn_norm.weight").then(|| {
            let mut b = bytes.to_vec();
            b[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
            b
        })
    });
    for args in [
        &["run", "-m", s(&nan), "-p", "hi", "-n", "2"][..],
        &[
            "logits",
            "-m",
            s(&nan),
            "--text",
            "hi",
            "--out",
            s(&d.join("x.st")),
        ],
    ] {
        assert_refused(args, &["blk.1.hc_ffn_norm.weight", "NaN at element 3"]);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

// 10. The context limit.

#[test]
fn hitting_the_context_limit_is_said_without_verbose() {
    let t = tiny();
    let out = strata(
        &[
            "run",
            "-m",
            s(&t),
            "-c",
            "12",
            "-p",
            "The",
            "-n",
            "100",
            "--temp",
            "0",
        ],
        None,
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("generation stopped at the context limit (12 positions)"),
        "{err}"
    );
}

// The command table.

#[test]
fn the_readme_and_help_list_every_command() {
    let readme = std::fs::read_to_string(fixtures().join("../README.md")).unwrap();
    let help = String::from_utf8(strata(&["--help"], None).stdout).unwrap();
    let commands: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.len() >= 10, "{help}");
    assert!(
        !commands.contains(&"spec-run"),
        "spec-run is folded into run --mtp"
    );
    for c in &commands {
        assert!(
            readme.contains(&format!("`strata {c}")),
            "README's table lacks strata {c}"
        );
    }
    let bench = String::from_utf8(strata(&["bench", "--help"], None).stdout).unwrap();
    for sub in ["formats", "spec", "model"] {
        assert!(
            bench.contains(&format!("  {sub} ")),
            "bench --help lacks {sub}: {bench}"
        );
        assert!(
            readme.contains(&format!("`strata bench {sub}")),
            "README lacks bench {sub}"
        );
    }
    assert!(help.contains("bench spec"), "{help}");
}
