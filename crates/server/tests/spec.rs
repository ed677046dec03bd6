//! MTP speculative decoding in the server, against the tiny qwen4exp fixture with its MTP head
//! (converted from the fixture's checkpoint): a speculative request's output is the plain
//! request's — greedy, seeded sampling, slop rewinds, a JSON schema (the grammar masks the
//! drafts too), log-probabilities, streaming — and a server without the head (an independent
//! run of plain decoding) agrees; the counters reach the usage extras and `/metrics`; a second
//! turn reuses the first; the window is checked.

mod common;

use common::{mtp_head, post, request, start, start_with, tiny_model};
use serde_json::{json, Value};
use strata_server::{LoadSpec, ServerConfig};

fn cfg() -> ServerConfig {
    ServerConfig {
        model_id: "tiny".into(),
        ..Default::default()
    }
}

fn with_head() -> LoadSpec {
    LoadSpec {
        threads: 2,
        mtp: Some(mtp_head()),
        ..Default::default()
    }
}

fn chat(content: &str, n: usize, extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": content}], "max_tokens": n,
                       "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn content(r: &Value) -> String {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The drafts made and accepted over all positions of a response's speculative counters.
fn spec_sums(r: &Value) -> (u64, u64) {
    let s = &r["usage"]["speculative"];
    let sum = |k: &str| {
        s[k].as_array()
            .unwrap_or_else(|| panic!("no usage.speculative.{k} in {r}"))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum()
    };
    (sum("drafted"), sum("accepted"))
}

const PROMPTS: [&str; 3] = [
    "Write a haiku about rivers.",
    "List three prime numbers.",
    "hello",
];

#[test]
fn speculative_requests_emit_what_plain_decoding_emits() {
    let s = start_with(tiny_model(), with_head(), cfg());
    let plain_server = start(tiny_model(), cfg());
    let (a, b) = (s.addr(), plain_server.addr());
    let mut drafted = 0;
    let mut accepted = 0;
    let cases = [
        json!({}),
        json!({"temperature": 0.9, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
        json!({"temperature": 0.7, "seed": 3, "repeat_penalty": 1.3}),
    ];
    for p in PROMPTS {
        for extra in &cases {
            let cold = post(b, "/v1/chat/completions", &chat(p, 40, extra.clone()));
            let mut e = extra.clone();
            e["spec"] = json!(1);
            let plain_same = post(a, "/v1/chat/completions", &chat(p, 40, e.clone()));
            assert_eq!(plain_same.status, 200, "{}", plain_same.body);
            e["spec"] = json!(4);
            let spec = post(a, "/v1/chat/completions", &chat(p, 40, e));
            assert_eq!(spec.status, 200, "{}", spec.body);
            let (cold, plain_same, spec) = (cold.json(), plain_same.json(), spec.json());
            assert_eq!(content(&spec), content(&plain_same), "{p:?} {extra}");
            assert_eq!(content(&spec), content(&cold), "{p:?} {extra}");
            assert_eq!(
                spec["usage"]["completion_tokens"],
                cold["usage"]["completion_tokens"]
            );
            assert_eq!(
                spec["choices"][0]["finish_reason"],
                cold["choices"][0]["finish_reason"]
            );
            assert!(
                plain_same["usage"].get("speculative").is_none(),
                "{plain_same}"
            );
            assert_eq!(spec["usage"]["speculative"]["window"], 4);
            let (d, acc) = spec_sums(&spec);
            drafted += d;
            accepted += acc;
        }
    }
    eprintln!("drafted {drafted}, accepted {accepted}");
    assert!(drafted > 0, "no drafts were made");
    // The counters reach /metrics, per position and in total.
    let m = request(a, "GET", "/metrics", &[], "").body;
    let total = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("strata:{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no strata:{name} in\n{m}"))
    };
    assert_eq!(total("spec_drafted_total"), drafted as f64);
    assert_eq!(total("spec_accepted_total"), accepted as f64);
    let first: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("strata:spec_drafted_position_total{position=\"1\"} "))
        .and_then(|v| v.trim().parse().ok())
        .expect("a per-position line");
    assert!(first > 0.0 && first <= drafted as f64);
    s.shutdown().unwrap();
    plain_server.shutdown().unwrap();
}

#[test]
fn grammar_slop_logprobs_and_streams_stay_exact_under_speculation() {
    let s = start_with(tiny_model(), with_head(), cfg());
    let a = s.addr();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"},
                        "b": {"type": "string"}}, "required": ["a", "b"],
                        "additionalProperties": false});
    let rf = json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema}}});
    let mut runs = Vec::new();
    for w in [1, 2, 4, 8] {
        let mut e = rf.clone();
        e["spec"] = json!(w);
        let r = post(a, "/v1/chat/completions", &chat("give json", 60, e));
        assert_eq!(r.status, 200, "{}", r.body);
        runs.push(r.json());
    }
    let text = content(&runs[0]);
    for r in &runs[1..] {
        assert_eq!(content(r), text);
    }
    // Finished within the budget, it is the schema's object.
    if runs[0]["choices"][0]["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["a"].is_i64() && v["b"].is_string(), "{v}");
    }
    // Slop phrases force rewinds; log-probabilities come from the trunk's rows.
    let plain = post(
        a,
        "/v1/chat/completions",
        &chat(PROMPTS[0], 30, json!({"spec": 1})),
    );
    let words: Vec<String> = content(&plain.json())
        .split_whitespace()
        .take(3)
        .map(str::to_string)
        .collect();
    let extra = json!({"slop_phrases": words, "logprobs": true, "top_logprobs": 3});
    let mut e1 = extra.clone();
    e1["spec"] = json!(1);
    let mut e4 = extra.clone();
    e4["spec"] = json!(4);
    let r1 = post(a, "/v1/chat/completions", &chat(PROMPTS[0], 30, e1)).json();
    let r4 = post(a, "/v1/chat/completions", &chat(PROMPTS[0], 30, e4.clone())).json();
    assert_eq!(content(&r4), content(&r1));
    assert_eq!(r4["choices"][0]["logprobs"], r1["choices"][0]["logprobs"]);
    assert!(r1["choices"][0]["logprobs"]["content"]
        .as_array()
        .is_some_and(|v| !v.is_empty()));
    // A stream gives the same text.
    let mut es = e4;
    es["stream"] = json!(true);
    let st = post(a, "/v1/chat/completions", &chat(PROMPTS[0], 30, es));
    let mut streamed = String::new();
    for d in st.sse_data() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, content(&r4));
    s.shutdown().unwrap();
}

#[test]
fn a_speculative_second_turn_reuses_the_first() {
    let s = start_with(tiny_model(), with_head(), cfg());
    let cold = start_with(tiny_model(), with_head(), cfg());
    let first = json!({"messages": [{"role": "user", "content": PROMPTS[0]}],
                       "max_tokens": 12, "temperature": 0});
    let r1 = post(s.addr(), "/v1/chat/completions", &first).json();
    let reply = content(&r1);
    let second = json!({"messages": [{"role": "user", "content": PROMPTS[0]},
                                     {"role": "assistant", "content": reply},
                                     {"role": "user", "content": "and another"}],
                        "max_tokens": 12, "temperature": 0});
    let warm = post(s.addr(), "/v1/chat/completions", &second).json();
    let fresh = post(cold.addr(), "/v1/chat/completions", &second).json();
    assert_eq!(content(&warm), content(&fresh));
    let cached = |r: &Value| {
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    // The first turn and its reply are not run again: as much is reused as a plain server
    // (no head) reuses, from the checkpoint at the end of the first generation.
    let plain = start(tiny_model(), cfg());
    post(plain.addr(), "/v1/chat/completions", &first);
    let plain2 = post(plain.addr(), "/v1/chat/completions", &second).json();
    assert_eq!(content(&plain2), content(&warm));
    let n1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached(&plain2) > n1, "{plain2}");
    assert_eq!(cached(&warm), cached(&plain2), "{warm}");
    assert_eq!(cached(&fresh), 0);
    assert!(warm["usage"]["speculative"]["window"] == 4, "{warm}");
    s.shutdown().unwrap();
    cold.shutdown().unwrap();
    plain.shutdown().unwrap();
}

#[test]
fn the_window_is_checked() {
    let s = start_with(tiny_model(), with_head(), cfg());
    let r = post(
        s.addr(),
        "/v1/chat/completions",
        &chat("x", 4, json!({"spec": 9})),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "spec");
    s.shutdown().unwrap();
    let plain = start(tiny_model(), cfg());
    let r = post(
        plain.addr(),
        "/v1/chat/completions",
        &chat("x", 4, json!({"spec": 2})),
    );
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["param"], "spec");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("MTP head"),
        "{e}"
    );
    let anth = post(
        plain.addr(),
        "/v1/messages",
        &json!({"model": "tiny", "max_tokens": 4, "spec": 0,
                "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(anth.status, 400);
    assert!(anth.body.contains("spec"), "{}", anth.body);
    plain.shutdown().unwrap();
}

/// What the draft oracle proposes: the plain reply's tokens from `start` (the prompt's length)
/// on, every `wrong`-th position (0: none) replaced by another token.
struct Script {
    start: usize,
    tokens: Vec<u32>,
    wrong: usize,
}

static SCRIPT: std::sync::Mutex<Option<Script>> = std::sync::Mutex::new(None);

fn oracle(position: usize, proposed: u32) -> Option<u32> {
    let g = SCRIPT.lock().unwrap();
    let Some(s) = g.as_ref() else {
        return Some(proposed);
    };
    let Some(&t) = position.checked_sub(s.start).and_then(|i| s.tokens.get(i)) else {
        return Some(proposed);
    };
    Some(if s.wrong > 0 && position.is_multiple_of(s.wrong) {
        t ^ 1
    } else {
        t
    })
}

#[test]
fn forced_acceptance_patterns_stay_exact() {
    let s = start_with(
        tiny_model(),
        with_head(),
        ServerConfig {
            draft_oracle: Some(strata_server::engine::DraftOracle(std::sync::Arc::new(
                oracle,
            ))),
            ..cfg()
        },
    );
    let a = s.addr();
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"},
                        "n": {"type": "integer"}}, "required": ["name", "n"],
                        "additionalProperties": false});
    let cases = [
        (PROMPTS[0], json!({})),
        (
            PROMPTS[1],
            json!({"temperature": 0.9, "seed": 11, "top_k": 0, "top_p": 1.0,
                            "min_p": 0.0, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "give json",
            json!({"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}}}),
        ),
        (PROMPTS[2], json!({"repeat_penalty": 1.2, "logprobs": true})),
    ];
    let mut accepted_all = 0;
    let mut rejected_some = false;
    for (prompt, extra) in cases {
        let mut e = extra.clone();
        e["spec"] = json!(1);
        *SCRIPT.lock().unwrap() = None;
        let plain = post(a, "/v1/chat/completions", &chat(prompt, 32, e.clone())).json();
        let text = content(&plain);
        let toks = post(
            a,
            "/tokenize",
            &json!({"content": text, "add_special": false, "parse_special": false}),
        )
        .json();
        let tokens: Vec<u32> = toks["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let start = plain["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        for wrong in [0, 3] {
            for w in [2, 4, 8] {
                *SCRIPT.lock().unwrap() = Some(Script {
                    start,
                    tokens: tokens.clone(),
                    wrong,
                });
                e["spec"] = json!(w);
                let r = post(a, "/v1/chat/completions", &chat(prompt, 32, e.clone()));
                assert_eq!(r.status, 200, "{}", r.body);
                let r = r.json();
                let what = format!("{prompt:?} {extra} window {w}, wrong every {wrong}");
                assert_eq!(content(&r), text, "{what}");
                assert_eq!(
                    r["choices"][0]["logprobs"], plain["choices"][0]["logprobs"],
                    "{what}"
                );
                assert_eq!(
                    r["usage"]["completion_tokens"], plain["usage"]["completion_tokens"],
                    "{what}"
                );
                let (d, acc) = spec_sums(&r);
                if wrong == 0 {
                    accepted_all += acc;
                } else if acc < d {
                    rejected_some = true;
                }
            }
        }
    }
    *SCRIPT.lock().unwrap() = None;
    eprintln!("accepted with the plain reply as drafts: {accepted_all}");
    assert!(
        accepted_all > 20,
        "drafts were hardly accepted: {accepted_all}"
    );
    assert!(rejected_some, "no wrong draft was refused");
    s.shutdown().unwrap();
}

/// The engine's own loops as the oracle for the server's (plain and speculative) output: the
/// tokens of `generate` / the guarded loop for the same prompt ids and sampler, decoded.
#[test]
fn the_server_emits_what_the_engines_loops_emit() {
    use strata_engine::generate::{GenOptions, Qwen4expSession};
    use strata_engine::sampler::Sampler;
    use strata_server::engine::SamplingParams;

    let file = tiny_model();
    let tok = strata_tokenizer::Tokenizer::from_gguf(&strata_gguf::GgufFile::open(&file).unwrap())
        .unwrap();
    let model = strata_engine::qwen4exp::Model::load(
        &file,
        strata_engine::CpuBackend::new(2).unwrap(),
        &strata_engine::qwen4exp::LoadOptions::default(),
    )
    .unwrap();
    let s = start_with(tiny_model(), with_head(), cfg());
    let prompt: Vec<u32> = tok.encode("Once upon a time", true, false).unwrap();
    let is_eog = |t: u32| tok.is_eog(t);
    let cases = [
        (
            json!({"temperature": 0}),
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 0.8, "seed": 5}),
            SamplingParams {
                temperature: 0.8,
                seed: Some(5),
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 0, "slop_phrases": ["the"]}),
            SamplingParams {
                temperature: 0.0,
                slop_phrases: vec!["the".into()],
                ..Default::default()
            },
        ),
    ];
    for (fields, params) in cases {
        let mut sampler: Sampler = params.build(&tok).unwrap();
        let mut session = Qwen4expSession::new(&model).unwrap();
        let opts = GenOptions {
            max_tokens: 24,
            ..GenOptions::default()
        };
        let want = strata_engine::sampler::guard::generate(
            &mut session,
            &prompt,
            &mut sampler,
            &is_eog,
            &opts,
            &mut |_| true,
        )
        .unwrap()
        .generation
        .tokens;
        let want_text =
            String::from_utf8_lossy(&tok.decode_bytes(&want, false).unwrap()).into_owned();
        for w in [1, 4] {
            let mut body = fields.clone();
            body["prompt"] = json!(prompt);
            body["max_tokens"] = json!(24);
            body["spec"] = json!(w);
            let r = post(s.addr(), "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let r = r.json();
            assert_eq!(
                r["usage"]["completion_tokens"],
                want.len(),
                "{fields} window {w}: {r}"
            );
            let text = r["choices"][0]["text"].as_str().unwrap();
            // The random model writes bytes that are not UTF-8: both sides replace them alike.
            assert_eq!(text, want_text, "{fields} window {w}");
        }
    }
    s.shutdown().unwrap();
}
