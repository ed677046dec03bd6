//! The server over real sockets, against the tiny qwen4exp fixture: response shapes, streaming
//! equal to non-streaming, errors naming their field, auth, context overflow, prefix reuse on a
//! second turn (checked against a cold server's answer), the bounded queue, cancellation and
//! shutdown.

mod common;

use common::{metric, post, request, start, start_with, tiny_model, wait_for_metric, Open};
use serde_json::{json, Value};
use strata_server::LoadSpec;
use strata_server::ServerConfig;

fn cfg() -> ServerConfig {
    ServerConfig {
        model_id: "tiny".into(),
        ..Default::default()
    }
}

/// Caches for a million positions (the CPU commits memory only as rows are written), for
/// generations that must outlast a test's other requests.
fn long_caches() -> LoadSpec {
    LoadSpec {
        threads: 2,
        ctx: Some(1 << 20),
        ..Default::default()
    }
}

/// The state budget of the servers with [`long_caches`]: enough for a million positions of the
/// tiny model however much memory the machine has free (the CPU commits rows as written).
const LONG_STATE_MEMORY: u64 = 64 << 30;

fn chat_body(content: &str, n: usize) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": n, "temperature": 0})
}

/// Concatenated `delta.content` of an OpenAI chat stream, and its finish reason.
fn chat_stream_text(data: &[String]) -> (String, String) {
    let mut text = String::new();
    let mut fr = String::new();
    for d in data {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(c) = v["choices"].get(0) {
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                fr = f.to_string();
            }
        }
    }
    (text, fr)
}

#[test]
fn health_models_tokenize_and_detokenize() {
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let h = request(a, "GET", "/health", &[], "");
    assert_eq!((h.status, h.json()), (200, json!({"status": "ok"})));
    let m = request(a, "GET", "/v1/models", &[], "").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "tiny");
    let t = post(a, "/tokenize", &json!({"content": "hello world"})).json();
    let ids = t["tokens"].as_array().unwrap().clone();
    assert!(!ids.is_empty());
    let d = post(a, "/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(d["content"], "hello world");
    let bad = post(a, "/detokenize", &json!({"tokens": [1, 99999]}));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "tokens[1]");
    let nf = request(a, "GET", "/v2/nothing", &[], "");
    assert_eq!(nf.status, 404);
    s.shutdown().unwrap();
}

#[test]
fn greedy_streams_equal_the_whole_responses() {
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let body = chat_body("Tell me a story", 24);
    let whole = post(a, "/v1/chat/completions", &body).json();
    assert_eq!(whole["object"], "chat.completion");
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let fr = whole["choices"][0]["finish_reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    assert_eq!(fr, "length");

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let st = post(a, "/v1/chat/completions", &sb);
    assert_eq!(st.status, 200);
    assert!(st
        .headers
        .to_ascii_lowercase()
        .contains("text/event-stream"));
    let data = st.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(first["object"], "chat.completion.chunk");
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(chat_stream_text(&data), (text.clone(), fr));

    // Legacy completions on the same prompt text.
    let cb = json!({"prompt": "Once upon", "max_tokens": 10, "temperature": 0});
    let c = post(a, "/v1/completions", &cb).json();
    assert_eq!(c["object"], "text_completion");
    let ctext = c["choices"][0]["text"].as_str().unwrap().to_string();
    let mut csb = cb.clone();
    csb["stream"] = json!(true);
    let cs = post(a, "/v1/completions", &csb).sse_data();
    let streamed: String = cs
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, ctext);

    // Anthropic: the same conversation, whole and streamed.
    let ab = json!({"model": "tiny", "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": "Tell me a story"}]});
    let m = post(a, "/v1/messages", &ab).json();
    assert_eq!(m["type"], "message");
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(
        m["content"][0]["text"].as_str().unwrap(),
        text,
        "same prompt, same greedy tokens"
    );
    let mut asb = ab.clone();
    asb["stream"] = json!(true);
    let ms = post(a, "/v1/messages", &asb);
    let events = ms.sse_events();
    assert_eq!(
        events,
        ["message_start", "ping", "content_block_start"]
            .iter()
            .map(|s| s.to_string())
            .chain(std::iter::repeat_n(
                "content_block_delta".to_string(),
                events.len() - 6
            ))
            .chain(
                ["content_block_stop", "message_delta", "message_stop"]
                    .iter()
                    .map(|s| s.to_string())
            )
            .collect::<Vec<_>>()
    );
    let mut atext = String::new();
    for d in ms.sse_data() {
        let v: Value = serde_json::from_str(&d).unwrap();
        if v["type"] == "content_block_delta" {
            atext.push_str(v["delta"]["text"].as_str().unwrap());
        }
        if v["type"] == "message_delta" {
            assert_eq!(v["delta"]["stop_reason"], "max_tokens");
            assert_eq!(v["usage"]["output_tokens"], 24);
        }
    }
    assert_eq!(atext, text);
    s.shutdown().unwrap();
}

#[test]
fn stop_strings_and_logprobs() {
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let body = chat_body("abc", 16);
    let text = post(a, "/v1/chat/completions", &body).json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let stop: String = text.chars().skip(3).take(2).collect();
    assert!(!stop.is_empty(), "the fixture wrote too little: {text:?}");
    let want = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!([stop]);
        b["stream"] = json!(stream);
        let r = post(a, "/v1/chat/completions", &b);
        let (got, fr) = if stream {
            chat_stream_text(&r.sse_data())
        } else {
            let v = r.json();
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        };
        assert_eq!(
            (got.as_str(), fr.as_str()),
            (want, "stop"),
            "stream {stream}"
        );
    }

    let mut b = body.clone();
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(3);
    let v = post(a, "/v1/chat/completions", &b).json();
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        lps.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert!(!lps.is_empty());
    for e in lps {
        let lp = e["logprob"].as_f64().unwrap();
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["logprob"].as_f64().unwrap(), lp);
        assert!(lp <= 0.0);
        let mass: f64 = top
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap().exp())
            .sum();
        assert!(mass <= 1.0 + 1e-6);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    s.shutdown().unwrap();
}

#[test]
fn bad_requests_name_the_field() {
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let cases = [
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
            "temperature",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 2.0}),
            "top_p",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            "n",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "slop_mode": 7}),
            "slop_mode",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "slop_list": [{"phrase": "a", "penalty": "lots"}]}),
            "slop_list[0].penalty",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
            "response_format.json_schema.schema",
        ),
    ];
    for (body, param) in cases {
        let r = post(a, "/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["param"], param, "{body}: {}", r.body);
        assert!(e["error"]["message"].as_str().unwrap().starts_with(param));
    }
    let r = request(a, "POST", "/v1/chat/completions", &[], "{not json");
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    // Anthropic's shape.
    let r = post(
        a,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("max_tokens"));
    s.shutdown().unwrap();
}

#[test]
fn api_keys_are_checked_in_either_header() {
    let s = start(
        tiny_model(),
        ServerConfig {
            api_keys: vec!["sekrit".into()],
            ..cfg()
        },
    );
    let a = s.addr();
    let body = chat_body("hi", 2).to_string();
    let r = request(a, "POST", "/v1/chat/completions", &[], &body);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer nope")],
        &body,
    );
    assert_eq!(r.status, 401);
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let ab = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let r = request(a, "POST", "/v1/messages", &[("x-api-key", "nope")], &ab);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = request(a, "POST", "/v1/messages", &[("x-api-key", "sekrit")], &ab);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        request(a, "GET", "/health", &[], "").status,
        200,
        "health needs no key"
    );
    assert_eq!(request(a, "GET", "/metrics", &[], "").status, 401);
    s.shutdown().unwrap();
}

#[test]
fn a_prompt_over_the_context_is_refused_not_truncated() {
    let s = start(
        tiny_model(),
        ServerConfig {
            n_ctx: Some(64),
            ..cfg()
        },
    );
    let a = s.addr();
    let long = "many words ".repeat(40);
    let r = post(a, "/v1/chat/completions", &chat_body(&long, 4));
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert_eq!(e["error"]["param"], "messages");
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4}),
    );
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 4, "messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    // Counting is not generating: the long conversation is counted, not refused.
    let r = post(
        a,
        "/v1/messages/count_tokens",
        &json!({"messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["input_tokens"].as_u64().unwrap() > 64);
    // A prompt that fits generates until the context is full, then says "length" (some
    // prompts meet an end-of-generation token first: at least one of these does not).
    let mut full = 0;
    for p in ["a", "b", "hello", "The", "x y z", "1 2 3", "abc", "Once"] {
        let r = post(
            a,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 1000, "temperature": 0}),
        )
        .json();
        let used = r["usage"]["prompt_tokens"].as_u64().unwrap()
            + r["usage"]["completion_tokens"].as_u64().unwrap();
        match r["choices"][0]["finish_reason"].as_str().unwrap() {
            "length" => {
                assert_eq!(used, 64, "{p:?}");
                full += 1;
            }
            "stop" => assert!(used < 64, "{p:?}"),
            other => panic!("{p:?}: finish_reason {other}"),
        }
    }
    assert!(full > 0, "no prompt reached the end of the context");
    s.shutdown().unwrap();
}

#[test]
fn a_second_turn_reuses_the_first_and_answers_as_a_cold_server_would() {
    let turn1 = json!({"messages": [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Name three colours please"}],
                       "max_tokens": 12, "temperature": 0});
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let r1 = post(a, "/v1/chat/completions", &turn1).json();
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut turn2 = turn1.clone();
    turn2["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": "And three more"}),
    ]);
    let ran_before = metric(a, "prompt_tokens_total");
    let r2 = post(a, "/v1/chat/completions", &turn2).json();
    let p2 = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // At least the whole first prompt but its last token came from the cache ...
    assert!(cached >= p1 - 1, "cached {cached} of turn one's {p1}");
    // ... and only the rest ran.
    assert_eq!(
        metric(a, "prompt_tokens_total") - ran_before,
        (p2 - cached) as f64
    );
    assert!(metric(a, "prefix_cache_hits_total") >= 1.0);
    let text2 = r2["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    s.shutdown().unwrap();

    // The oracle: a server that never saw turn one answers turn two with the same tokens.
    let cold = start(tiny_model(), cfg());
    let r = post(cold.addr(), "/v1/chat/completions", &turn2).json();
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        r["choices"][0]["message"]["content"].as_str().unwrap(),
        text2
    );
    cold.shutdown().unwrap();
}

#[test]
fn parallel_sequences_keep_their_own_state() {
    let s = start(
        tiny_model(),
        ServerConfig {
            parallel: 2,
            ..cfg()
        },
    );
    let a = s.addr();
    let alone: Vec<String> = ["first prompt", "another one"]
        .iter()
        .map(|p| {
            post(a, "/v1/chat/completions", &chat_body(p, 40)).json()["choices"][0]["message"]
                ["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    // Both at once, interleaved step by step by the worker.
    let handles: Vec<_> = ["first prompt", "another one"]
        .iter()
        .map(|p| {
            let mut b = chat_body(p, 40);
            b["stream"] = json!(true);
            std::thread::spawn(move || {
                chat_stream_text(&post(a, "/v1/chat/completions", &b).sse_data()).0
            })
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(together, alone);
    s.shutdown().unwrap();
}

#[test]
fn a_full_queue_answers_429_and_a_client_that_leaves_cancels() {
    let s = start_with(
        tiny_model(),
        long_caches(),
        ServerConfig {
            parallel: 1,
            queue: 1,
            n_ctx: Some(1 << 20),
            // A stated budget: the default (the memory available at start) would make the
            // million-token request's admission depend on how loaded the machine is.
            state_memory: Some(LONG_STATE_MEMORY),
            ..cfg()
        },
    );
    let a = s.addr();
    // A holds the only slot for a long time (a million-token budget), B waits in the queue.
    let long = json!({"prompt": "x", "max_tokens": 1_000_000, "temperature": 0, "stream": true});
    let mut first = Open::new(a, "/v1/completions", &long);
    first.until("data:");
    let mut second = Open::new(a, "/v1/completions", &long);
    // B is queued once the gauge says so.
    wait_for_metric(a, "requests_deferred", 1.0);
    let third = post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
    );
    assert_eq!(third.status, 429, "{}", third.body);
    assert_eq!(third.json()["error"]["type"], "rate_limit_error");
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    // A leaves: its generation stops and B gets the slot.
    drop(first);
    second.until("data:");
    assert!(metric(a, "requests_cancelled_total") >= 1.0);
    drop(second);
    s.shutdown().unwrap();
}

#[test]
fn shutdown_ends_an_open_stream_with_an_error_event() {
    let s = start_with(
        tiny_model(),
        long_caches(),
        ServerConfig {
            n_ctx: Some(1 << 20),
            state_memory: Some(LONG_STATE_MEMORY),
            ..cfg()
        },
    );
    let a = s.addr();
    let body = json!({"max_tokens": 1_000_000, "temperature": 0, "stream": true,
                      "messages": [{"role": "user", "content": "x"}]});
    let mut open = Open::new(a, "/v1/messages", &body);
    open.until("content_block_delta");
    let stopper = std::thread::spawn(move || s.shutdown());
    let rest = open.rest();
    assert!(
        rest.contains("event: error"),
        "{}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(rest.contains("shutting down"));
    assert!(!rest.contains("message_stop"));
    stopper.join().unwrap().unwrap();
}

#[test]
fn json_schema_and_forced_tool_calls_are_followed_even_by_a_random_model() {
    let s = start(tiny_model(), cfg());
    let a = s.addr();
    let schema = json!({"type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "blue"]}},
        "required": ["ok", "colour"], "additionalProperties": false});
    for stream in [false, true] {
        let body = json!({"messages": [{"role": "user", "content": "json please"}], "max_tokens": 60,
            "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        let r = post(a, "/v1/chat/completions", &body);
        let (text, fr) = if stream {
            chat_stream_text(&r.sse_data())
        } else {
            let v = r.json();
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{v}"))
                    .to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        };
        assert_eq!(fr, "stop", "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v["ok"].is_boolean(), "{v}");
        assert!(v["colour"] == "red" || v["colour"] == "blue", "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2);
    }
    // Anthropic's output_config.format.
    let m = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 60, "temperature": 0,
        "messages": [{"role": "user", "content": "json"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
    )
    .json();
    let v: Value = serde_json::from_str(m["content"][0]["text"].as_str().unwrap()).unwrap();
    assert!(v["ok"].is_boolean());
    // json_object: any object.
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "obj"}],
        "max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"}}),
    )
    .json();
    if r["choices"][0]["finish_reason"] == "stop" {
        let t = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(serde_json::from_str::<Value>(t).unwrap().is_object(), "{t}");
    }

    // A forced tool call: the named function with arguments of its schema.
    let tools = json!([
        {"type": "function", "function": {"name": "paint", "parameters": {"type": "object",
            "properties": {"colour": {"enum": ["red", "blue"]}, "wet": {"type": "boolean"}},
            "required": ["colour", "wet"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]);
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "paint"}}),
    ] {
        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "paint it"}],
            "max_tokens": 80, "temperature": 0, "tools": tools, "tool_choice": choice}),
        )
        .json();
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        let call = &c["message"]["tool_calls"][0]["function"];
        if choice.is_object() {
            assert_eq!(call["name"], "paint");
        }
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        if call["name"] == "paint" {
            assert!(args["wet"].is_boolean(), "{args}");
        } else {
            assert!(args.is_object());
        }
    }
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "paint"}],
        "tools": [{"name": "paint", "input_schema": tools[0]["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "paint"}}),
    )
    .json();
    assert_eq!(r["stop_reason"], "tool_use", "{r}");
    assert_eq!(r["content"][0]["type"], "tool_use");
    assert!(r["content"][0]["input"]["wet"].is_boolean());
    // A name that is not a tool, and a schema that does not compile, are 400s naming the field.
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
        "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    );
    assert_eq!(r.json()["error"]["param"], "tool_choice.function.name");
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.json()["error"]["param"],
        "response_format.json_schema.schema"
    );
    s.shutdown().unwrap();
}

#[test]
fn health_is_503_while_loading_and_a_failed_load_stops_the_server() {
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let model = tiny_model();
    let loader = Box::new(move || {
        // Holds the load until the test has seen the 503.
        let _ = wait.recv();
        strata_server::ModelHandle::load(&model, &strata_server::LoadSpec::default())
    });
    let s = strata_server::Server::start(ServerConfig { port: 0, ..cfg() }, loader).unwrap();
    let a = s.addr();
    let h = request(a, "GET", "/health", &[], "");
    assert_eq!(h.status, 503);
    assert_eq!(h.json()["error"]["message"], "Loading model");
    let r = post(a, "/v1/chat/completions", &chat_body("hi", 2));
    assert_eq!(r.status, 503, "{}", r.body);
    go.send(()).unwrap();
    s.wait_ready(std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(request(a, "GET", "/health", &[], "").status, 200);
    s.shutdown().unwrap();

    let missing = std::path::PathBuf::from("/nonexistent/model.gguf");
    let loader = Box::new(move || {
        strata_server::ModelHandle::load(&missing, &strata_server::LoadSpec::default())
    });
    let s = strata_server::Server::start(ServerConfig { port: 0, ..cfg() }, loader).unwrap();
    let e = s.wait().unwrap_err();
    assert!(
        format!("{e:#}").contains("/nonexistent/model.gguf"),
        "{e:#}"
    );
}

#[test]
fn a_reasoning_budget_closes_the_think_block() {
    // A template whose generation prompt opens a think block, as Qwen3-style templates do.
    let template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}";
    let s = start(
        tiny_model(),
        ServerConfig {
            chat_template: Some(template.into()),
            ..cfg()
        },
    );
    let a = s.addr();
    let body = |extra: Value| {
        let mut b = chat_body("think about it", 5);
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // Unbounded, five tokens: all of them are reasoning (nothing closed the block).
    let free = post(a, "/v1/chat/completions", &body(json!({}))).json();
    let r5 = free["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    // A budget of five: the same five tokens, then "\n</think>\n\n" is written and the answer follows.
    let capped = post(
        a,
        "/v1/chat/completions",
        &body(json!({"max_tokens": 30, "reasoning_budget": 5})),
    )
    .json();
    let m = &capped["choices"][0]["message"];
    assert_eq!(m["reasoning_content"].as_str().unwrap(), format!("{r5}\n"));
    assert!(!m["content"].as_str().unwrap().is_empty(), "{capped}");
    // Budget 0: no reasoning at all.
    let none = post(
        a,
        "/v1/chat/completions",
        &body(json!({"max_tokens": 10, "reasoning_budget": 0})),
    )
    .json();
    let m = &none["choices"][0]["message"];
    assert!(
        m.get("reasoning_content")
            .is_none_or(|r| r == "\n" || r == ""),
        "{none}"
    );
    assert!(!m["content"].as_str().unwrap().is_empty());
    // Anthropic: thinking.budget_tokens, the reasoning as a thinking block.
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 30, "temperature": 0,
        "messages": [{"role": "user", "content": "think about it"}],
        "thinking": {"type": "enabled", "budget_tokens": 5}}),
    )
    .json();
    assert_eq!(r["content"][0]["type"], "thinking", "{r}");
    assert_eq!(
        r["content"][0]["thinking"].as_str().unwrap(),
        format!("{r5}\n")
    );
    assert_eq!(r["content"][1]["type"], "text");
    // A JSON schema with reasoning: the model reasons freely (the same five tokens as without a
    // grammar), the budget closes the block, and the answer follows the schema.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": false});
    for budget in [5, 0] {
        let r = post(
            a,
            "/v1/chat/completions",
            &body(json!({"max_tokens": 60, "reasoning_budget": budget,
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "n", "schema": schema}}})),
        )
        .json();
        let m = &r["choices"][0]["message"];
        if budget == 5 {
            assert_eq!(
                m["reasoning_content"].as_str().unwrap(),
                format!("{r5}\n"),
                "{r}"
            );
        }
        let text = m["content"].as_str().unwrap();
        assert!(text.starts_with("{\"n\": "), "{r}");
        if r["choices"][0]["finish_reason"] == "stop" {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {r}"));
            // An integer (llguidance allows `-0`, which serde reads as a float).
            assert!(v["n"].as_f64().is_some_and(|x| x.fract() == 0.0), "{r}");
            assert!(!text.contains(['.', 'e', 'E']), "{r}");
        }
    }
    s.shutdown().unwrap();
}
