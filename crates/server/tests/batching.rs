//! Continuous batching in the server (issue 15): concurrent clients on `--parallel 8` each get
//! exactly the stream a lone client gets (the oracle: the same requests one at a time on a
//! fresh `--parallel 1` server), greedy and seeded, with one long prompt prefilled in chunks
//! while the others decode; the batch really ran several sequences per forward
//! (`batch_sequences_max`). Memory: with a state budget for one sequence a second request waits
//! (never two at once) and still gets its solo answer, and a request that could never fit gets
//! 429 naming what it needs. A cancelled stream frees its slot at the next step while the
//! batch goes on. With the MTP head, speculative streams (their verify windows rows of the
//! batch) and plain ones at once equal their solo runs, greedy and seeded, and a speculative
//! request whose long prompt arrives while they decode is prefilled in several chunks of the
//! batched steps beside their decode rows (counted) and equals its solo run. On the tiny
//! qwen4exp fixture, and on the default qwen2 model when it is cached (else a SKIP message).

mod common;

use std::path::PathBuf;

use common::{metric, post, start_with, tiny_model, wait_for_metric, Reply};
use serde_json::{json, Value};
use strata_server::memory::StateSize;
use strata_server::{LoadSpec, ModelHandle, ServerConfig};

fn spec() -> LoadSpec {
    LoadSpec {
        threads: 2,
        ctx: Some(4096),
        ..Default::default()
    }
}

fn cfg(parallel: usize) -> ServerConfig {
    ServerConfig {
        model_id: "m".into(),
        parallel,
        ..Default::default()
    }
}

/// The eight requests: different prompts (one long enough to take several prefill chunks),
/// greedy or each with its own seed.
fn bodies(seeded: bool) -> Vec<Value> {
    let mut prompts: Vec<String> = [
        "def fibonacci(n):",
        "The capital of France is",
        "SELECT name FROM users WHERE",
        "Once upon a time, in a village by the sea,",
        "import numpy as np\nx = np.",
        "fn main() {\n    let v =",
        "Q: What is 17 times 23?\nA:",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    prompts.push("the quick brown fox jumps over the lazy dog. ".repeat(60));
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut b = json!({"prompt": p, "max_tokens": 20, "stream": true});
            if seeded {
                b["temperature"] = json!(0.9);
                b["seed"] = json!(100 + i);
            } else {
                b["temperature"] = json!(0);
            }
            b
        })
        .collect()
}

/// A completion stream's text, checked to end with a finish reason.
fn text_of(r: &Reply) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    let mut text = String::new();
    let mut finished = false;
    for d in r.sse_data() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        let c = &v["choices"][0];
        text.push_str(c["text"].as_str().unwrap_or(""));
        finished |= c["finish_reason"].is_string();
    }
    assert!(finished, "no finish reason in {}", r.body);
    text
}

fn concurrent_streams_equal_solo(model: PathBuf) {
    for seeded in [false, true] {
        let bodies = bodies(seeded);
        let solo = start_with(model.clone(), spec(), cfg(1));
        let want: Vec<String> = bodies
            .iter()
            .map(|b| text_of(&post(solo.addr(), "/v1/completions", b)))
            .collect();
        drop(solo);
        let s = start_with(model.clone(), spec(), cfg(8));
        let addr = s.addr();
        let got: Vec<String> = std::thread::scope(|sc| {
            let hs: Vec<_> = bodies
                .iter()
                .map(|b| sc.spawn(move || text_of(&post(addr, "/v1/completions", b))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                w, g,
                "seeded {seeded}: stream {i} differs from its solo run"
            );
        }
        assert!(
            want.iter().any(|w| w != &want[0]),
            "the streams are all the same: {want:?}"
        );
        let most = metric(addr, "batch_sequences_max");
        assert!(most > 1.0, "no step ran more than one sequence ({most})");
    }
}

#[test]
fn concurrent_streams_equal_their_solo_runs_tiny() {
    concurrent_streams_equal_solo(tiny_model());
}

#[test]
fn concurrent_streams_equal_their_solo_runs_default_model() {
    let Some(p) = common::default_model() else {
        eprintln!("SKIP: the default model is not cached (run `strata fetch`)");
        return;
    };
    concurrent_streams_equal_solo(p);
}

#[test]
fn state_memory_is_enforced_wait_or_429() {
    let (model, _) = ModelHandle::load(&tiny_model(), &spec()).unwrap();
    let size = StateSize::of(&model);
    assert!(size.per_position > 0, "{size:?}");
    drop(model);
    // Room for one sequence of 120 positions (the context is 256).
    let cfg = ServerConfig {
        n_ctx: Some(256),
        state_memory: Some(size.at(120)),
        ..cfg(2)
    };
    let s = start_with(tiny_model(), spec(), cfg);
    let addr = s.addr();
    // 70 generated tokens beside a short prompt fit; two of them do not fit together.
    let body = |p: &str| json!({"prompt": p, "max_tokens": 70, "temperature": 0});
    let alone: Vec<Value> = ["one two three", "four five six"]
        .iter()
        .map(|p| post(addr, "/v1/completions", &body(p)).json())
        .collect();
    let both: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = ["one two three", "four five six"]
            .iter()
            .map(|p| sc.spawn(move || post(addr, "/v1/completions", &body(p)).json()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, b) in alone.iter().zip(&both) {
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    }
    assert_eq!(
        metric(addr, "batch_sequences_max"),
        1.0,
        "two sequences ran at once beyond the state memory"
    );
    // 200 positions can never fit: refused before it runs.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "one two three", "max_tokens": 190, "temperature": 0}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("positions"), "{}", r.body);
    assert!(r.body.contains("state memory"), "{}", r.body);
}

#[test]
fn a_cancelled_stream_frees_its_slot_while_the_batch_goes_on() {
    use common::Open;
    let s = start_with(
        tiny_model(),
        LoadSpec {
            threads: 2,
            ctx: Some(1 << 17),
            ..Default::default()
        },
        ServerConfig {
            n_ctx: Some(1 << 17),
            queue: 4,
            // A stated budget: admission must not depend on the memory free at start.
            state_memory: Some(16 << 30),
            ..cfg(2)
        },
    );
    let a = s.addr();
    let long =
        |p: &str| json!({"prompt": p, "max_tokens": 100_000, "temperature": 0, "stream": true});
    // A and B hold both slots; C waits in the queue.
    let mut first = Open::new(a, "/v1/completions", &long("a b"));
    first.until("data:");
    let mut second = Open::new(a, "/v1/completions", &long("c d"));
    second.until("data:");
    let mut third = Open::new(a, "/v1/completions", &long("e f"));
    wait_for_metric(a, "requests_deferred", 1.0);
    // A leaves: its slot goes to C, and B keeps streaming beside it.
    drop(first);
    third.until("data:");
    assert!(metric(a, "requests_cancelled_total") >= 1.0);
    // B and C run now, stepped together.
    assert_eq!(metric(a, "requests_processing"), 2.0);
    assert_eq!(metric(a, "requests_deferred"), 0.0);
    assert!(!second.until("data:").contains("[DONE]"));
    assert_eq!(metric(a, "batch_sequences_max"), 2.0);
    drop(second);
    drop(third);
    s.shutdown().unwrap();
}

/// With an MTP head: speculative requests (window 4, their verify windows rows of the batch)
/// and plain ones (window 1) at once each get the stream they get alone, greedy and seeded;
/// windows really ran in batched passes beside other sequences' rows (`batch_windows_total`).
/// Then, while those stream (decode steps slowed so they last), a speculative request with a
/// long prompt arrives: its prompt runs in several chunks of the batched step beside their
/// decode rows (`batch_spec_prompts_total` grows by at least three while it runs; it never
/// does on the lone server) and its stream too equals its solo run.
#[test]
fn speculative_and_batched_streams_together_equal_their_solo_runs() {
    use common::Open;
    let head = LoadSpec {
        mtp: Some(common::mtp_head()),
        ..spec()
    };
    for seeded in [false, true] {
        let bodies: Vec<Value> = bodies(seeded)
            .into_iter()
            .enumerate()
            .map(|(i, mut b)| {
                b["spec"] = json!(if i % 2 == 0 { 4 } else { 1 });
                b
            })
            .collect();
        let mut late = json!({
            "prompt": "A speculative stream reads its long prompt in chunks beside the others. "
                .repeat(40),
            "max_tokens": 20, "stream": true, "spec": 4,
        });
        if seeded {
            late["temperature"] = json!(0.9);
            late["seed"] = json!(300);
        } else {
            late["temperature"] = json!(0);
        }
        let solo = start_with(tiny_model(), head.clone(), cfg(1));
        let want: Vec<String> = bodies
            .iter()
            .map(|b| text_of(&post(solo.addr(), "/v1/completions", b)))
            .collect();
        let want_late = text_of(&post(solo.addr(), "/v1/completions", &late));
        let n_late = post(
            solo.addr(),
            "/tokenize",
            &json!({"content": late["prompt"]}),
        )
        .json()["tokens"]
            .as_array()
            .map_or(0, Vec::len);
        assert!(
            n_late > 512,
            "the late prompt has {n_late} tokens: fewer than two chunks"
        );
        for name in ["batch_windows_total", "batch_spec_prompts_total"] {
            assert_eq!(
                metric(solo.addr(), name),
                0.0,
                "{name}: a lone sequence shared a pass"
            );
        }
        drop(solo);
        let s = start_with(
            tiny_model(),
            head.clone(),
            ServerConfig {
                test_token_delay: Some(std::time::Duration::from_millis(25)),
                ..cfg(9)
            },
        );
        let addr = s.addr();
        let mut open: Vec<Open> = bodies
            .iter()
            .map(|b| Open::new(addr, "/v1/completions", b))
            .collect();
        // Every stream has its first token: all of them are decoding now.
        let heads: Vec<String> = open.iter_mut().map(|o| o.until("data:")).collect();
        let before = metric(addr, "batch_spec_prompts_total");
        let got_late = text_of(&post(addr, "/v1/completions", &late));
        let beside = metric(addr, "batch_spec_prompts_total") - before;
        let got: Vec<String> = open
            .iter_mut()
            .zip(heads)
            .map(|(o, h)| {
                assert!(h.starts_with("HTTP/1.1 200"), "{h}");
                let body = h + &o.rest();
                text_of(&Reply {
                    status: 200,
                    headers: String::new(),
                    body,
                })
            })
            .collect();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                w, g,
                "seeded {seeded}: stream {i} (spec {}) differs",
                bodies[i]["spec"]
            );
        }
        assert_eq!(
            want_late, got_late,
            "seeded {seeded}: the late speculative stream differs from its solo run"
        );
        assert!(
            beside >= 3.0,
            "seeded {seeded}: the late speculative prompt ({n_late} tokens) shared {beside} \
             passes with decode rows; several chunks expected"
        );
        assert!(
            metric(addr, "spec_passes_total") > 0.0,
            "no speculative pass ran"
        );
        assert!(
            metric(addr, "batch_windows_total") > 0.0,
            "seeded {seeded}: no verify window ran in a batch beside other sequences"
        );
        assert!(
            metric(addr, "batch_sequences_max") > 1.0,
            "the streams never shared a step"
        );
    }
}
