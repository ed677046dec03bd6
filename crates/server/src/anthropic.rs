//! Anthropic's Messages API: `/v1/messages` (content blocks, tools, thinking; streaming as the
//! exact event sequence `message_start`, `content_block_start` / `content_block_delta` /
//! `content_block_stop`, `ping`, `message_delta`, `message_stop`) and
//! `/v1/messages/count_tokens`. Errors are Anthropic's shape; the key is accepted as
//! `x-api-key` or `Authorization: Bearer`.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::chat::Conversation;
use crate::error::ApiError;
use crate::grammar::Grammar;
use crate::openai::{body_json, sse};
use crate::output::Piece;
use crate::run::{fields, new_id, Driver, EndReason, GenSpec, SamplingFields, Update};
use crate::AppState;

#[derive(Debug, Deserialize)]
struct MessagesReq {
    model: Option<String>,
    max_tokens: Option<i64>,
    messages: Vec<Value>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    output_config: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
}

/// Text of a `content` that must be text: a string or text blocks.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(a) => {
            let mut s = String::new();
            for (j, b) in a.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        s.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::invalid(format!("{at}[{j}].text"), "expected a string")
                        })?)
                    }
                    Some(t) => {
                        return Err(ApiError::invalid(
                            format!("{at}[{j}].type"),
                            format!("{t:?}; only text blocks are supported here"),
                        ))
                    }
                    None => return Err(ApiError::invalid(format!("{at}[{j}].type"), "missing")),
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::invalid(
            at,
            "expected a string or an array of content blocks",
        )),
    }
}

/// The request as a template conversation.
fn conversation(req: &MessagesReq) -> Result<(Conversation, bool), ApiError> {
    let mut msgs = Vec::new();
    if let Some(sys) = &req.system {
        msgs.push(json!({"role": "system", "content": text_of(sys, "system")?}));
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "must hold at least one message",
        ));
    }
    for (i, m) in req.messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some(r) => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("{r:?}; expected user or assistant"),
                ))
            }
            None => return Err(ApiError::invalid(format!("{at}.role"), "missing")),
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let blocks: Vec<Value> = match content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(a) => a.clone(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    "expected a string or an array of content blocks",
                ))
            }
        };
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bat = format!("{at}.content[{j}]");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    text.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::invalid(format!("{bat}.text"), "expected a string")
                    })?)
                }
                Some("thinking") if role == "assistant" => {
                    reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
                }
                Some("redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => {
                    let name = b
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| ApiError::invalid(format!("{bat}.name"), "missing"))?;
                    calls.push(json!({
                        "id": b.get("id").cloned().unwrap_or(Value::Null),
                        "type": "function",
                        "function": {"name": name, "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                    }));
                }
                Some("tool_result") if role == "user" => {
                    let c = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => text_of(c, &format!("{bat}.content"))?,
                    };
                    results.push(json!({
                        "role": "tool",
                        "content": c,
                        "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null),
                    }));
                }
                Some(t) => {
                    return Err(ApiError::invalid(
                        format!("{bat}.type"),
                        format!("{t:?} blocks are not supported in a {role} message"),
                    ))
                }
                None => return Err(ApiError::invalid(format!("{bat}.type"), "missing")),
            }
        }
        msgs.extend(results);
        if role == "assistant" {
            let mut a = json!({"role": "assistant", "content": text});
            if !reasoning.is_empty() {
                a["reasoning_content"] = Value::String(reasoning);
            }
            if !calls.is_empty() {
                a["tool_calls"] = Value::Array(calls);
            }
            msgs.push(a);
        } else if !text.is_empty() || !msgs.last().is_some_and(|m| m["role"] == "tool") {
            msgs.push(json!({"role": "user", "content": text}));
        }
    }
    let mut tools = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let Some(name) = name else {
            return Err(ApiError::invalid(format!("tools[{i}].name"), "missing"));
        };
        tools.push(json!({"type": "function", "function": {
            "name": name,
            "description": t.get("description").cloned().unwrap_or(json!("")),
            "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
        }}));
    }
    let use_tools = match req
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
    {
        None | Some("auto") => true,
        Some("none") => false,
        Some("any") | Some("tool") => true,
        Some(t) => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("{t:?}; expected auto, any, tool or none"),
            ))
        }
    };
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    match req
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
    {
        None => {}
        Some("enabled" | "adaptive" | "between_tools") => {
            kwargs.insert("enable_thinking".into(), json!(true));
        }
        Some("disabled") => {
            kwargs.insert("enable_thinking".into(), json!(false));
        }
        Some(t) => {
            return Err(ApiError::invalid(
                "thinking.type",
                format!("{t:?}; expected enabled or disabled"),
            ))
        }
    }
    let tools = if use_tools { tools } else { Vec::new() };
    let has_tools = !tools.is_empty();
    Ok((
        Conversation {
            messages: msgs,
            tools,
            kwargs,
        },
        has_tools,
    ))
}

/// `tool_choice` `any` (one of the tools) or `tool` (the named one) as a grammar.
fn forced_tools(
    req: &MessagesReq,
    tools: &[Value],
) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let Some(choice) = &req.tool_choice else {
        return Ok(None);
    };
    let chosen: Vec<Value> = match choice.get("type").and_then(Value::as_str) {
        Some("any") => tools.to_vec(),
        Some("tool") => {
            let Some(name) = choice.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid("tool_choice.name", "missing"));
            };
            let v: Vec<Value> = tools
                .iter()
                .filter(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
                .cloned()
                .collect();
            if v.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    format!("{name:?} is not one of the request's tools"),
                ));
            }
            v
        }
        _ => return Ok(None),
    };
    if chosen.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "forces a tool call but no tools are given",
        ));
    }
    Ok(Some((Grammar::tool_call(&chosen), "tools")))
}

/// `thinking.budget_tokens` (with `enabled`): the most tokens inside `<think>`.
fn thinking_budget(req: &MessagesReq) -> Result<Option<usize>, ApiError> {
    match req.thinking.as_ref().and_then(|t| t.get("budget_tokens")) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n as usize)),
            None => Err(ApiError::invalid(
                "thinking.budget_tokens",
                format!("{v}; expected a count of tokens"),
            )),
        },
    }
}

pub async fn count_tokens(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        s.check_key(&headers)?;
        let v = body_json(&body)?;
        let req: MessagesReq = fields(&v)?;
        let (conv, _) = conversation(&req)?;
        let ready = s.need_ready()?;
        // Counting is not generating: a conversation over the context is counted, not refused.
        let n = conv.render(ready)?.tokens.len();
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.anthropic())
}

pub async fn messages(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    match messages_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.anthropic(),
    }
}

struct Ctx {
    id: String,
    model: String,
}

fn stop_reason(r: &EndReason, calls: bool) -> (&'static str, Value) {
    match r {
        EndReason::Length => ("max_tokens", Value::Null),
        EndReason::Stop(s) => ("stop_sequence", json!(s)),
        _ if calls => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

fn usage(d: &Driver) -> Value {
    let mut u = json!({
        "input_tokens": d.prompt_tokens - d.cached_tokens,
        "output_tokens": d.completion_tokens,
        "cache_read_input_tokens": d.cached_tokens,
        "cache_creation_input_tokens": 0,
    });
    // Our extra: a speculative generation's drafts and acceptances per draft position.
    if let Some(sp) = &d.spec {
        u["speculative"] = json!(sp);
    }
    u
}

async fn messages_inner(
    s: AppState,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    s.check_key(&headers)?;
    let v = body_json(&body)?;
    let req: MessagesReq = fields(&v)?;
    let sf: SamplingFields = fields(&v)?;
    let params = sf.params()?;
    let max_tokens = match req.max_tokens {
        None => return Err(ApiError::invalid("max_tokens", "required")),
        Some(n) if n >= 1 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("{n}; expected an integer of at least 1"),
            ))
        }
    };
    let stops = req.stop_sequences.clone().unwrap_or_default();
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop_sequences",
            "a stop sequence is empty",
        ));
    }
    let mut grammar: Option<(Grammar, &'static str)> =
        match req.output_config.as_ref().and_then(|o| o.get("format")) {
            None | Some(Value::Null) => None,
            Some(f) => match (f.get("type").and_then(Value::as_str), f.get("schema")) {
                (Some("json_schema"), Some(schema)) if schema.is_object() => Some((
                    Grammar::json_schema(schema.clone()),
                    "output_config.format.schema",
                )),
                _ => {
                    return Err(ApiError::invalid(
                        "output_config.format",
                        "expected {\"type\": \"json_schema\", \"schema\": {...}}",
                    ))
                }
            },
        };
    let (conv, has_tools) = conversation(&req)?;
    if let Some(force) = forced_tools(&req, &conv.tools)? {
        if grammar.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call and output_config.format cannot both constrain the reply",
            ));
        }
        grammar = Some(force);
    }
    let ready = s.need_ready()?;
    let prompt = conv.prompt(ready, "messages")?;
    let tool_names = crate::chat::tool_names(&conv.tools);
    let spec = GenSpec {
        params,
        max_tokens: Some(max_tokens),
        stops,
        top_logprobs: None,
        reasoning: true,
        tools: has_tools,
        tool_names,
        in_think: prompt.in_think,
        user_boundary: prompt.user_boundary,
        grammar,
        reasoning_budget: thinking_budget(&req)?,
        window: sf.spec,
    };
    let d = Driver::start(&s, ready, prompt.tokens, spec).await?;
    let ctx = Ctx {
        id: new_id("msg_"),
        model: req.model.clone().unwrap_or_else(|| s.cfg.model_id.clone()),
    };
    if req.stream == Some(true) {
        Ok(stream(ctx, d))
    } else {
        collect(ctx, d).await
    }
}

fn log_request(d: &Driver, finish: &str, stream: bool) {
    tracing::info!(
        target: "strata::request",
        endpoint = "messages",
        stream,
        prompt_tokens = d.prompt_tokens,
        cached_tokens = d.cached_tokens,
        completion_tokens = d.completion_tokens,
        finish,
        malformed_tool_calls = d.malformed_calls(),
        spec_window = d.spec.as_ref().map_or(1, |s| s.window),
        spec_drafted = d.spec.as_ref().map_or(0, |s| s.drafted.iter().sum::<u64>()),
        spec_accepted = d.spec.as_ref().map_or(0, |s| s.accepted.iter().sum::<u64>()),
        spec_accepted_by_position = ?d.spec.as_ref().map(|s| &s.accepted),
        ms = d.t0.elapsed().as_millis() as u64,
        "request done"
    );
}

async fn collect(ctx: Ctx, mut d: Driver) -> Result<Response, ApiError> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut end = EndReason::Eog;
    let mut calls = false;
    // The arguments of the call being read.
    let mut args = String::new();
    while let Some(u) = d.next().await {
        match u {
            Update::Pieces { pieces, .. } => {
                for p in pieces {
                    match p {
                        Piece::Content(t) => match blocks.last_mut() {
                            Some(b) if b["type"] == "text" => {
                                let s = format!("{}{t}", b["text"].as_str().unwrap_or(""));
                                b["text"] = json!(s);
                            }
                            _ => blocks.push(json!({"type": "text", "text": t})),
                        },
                        Piece::Reasoning(t) => match blocks.last_mut() {
                            Some(b) if b["type"] == "thinking" => {
                                let s = format!("{}{t}", b["thinking"].as_str().unwrap_or(""));
                                b["thinking"] = json!(s);
                            }
                            _ => blocks
                                .push(json!({"type": "thinking", "thinking": t, "signature": ""})),
                        },
                        Piece::ToolStart { name } => {
                            calls = true;
                            args.clear();
                            blocks.push(json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}}));
                        }
                        Piece::ToolArgs(a) => args.push_str(&a),
                        Piece::ToolEnd => {
                            if let Some(b) = blocks.last_mut() {
                                b["input"] = serde_json::from_str(&args).unwrap_or(json!({}));
                            }
                        }
                        // Whole calls arrive expanded (Driver).
                        Piece::ToolCall { .. } => {}
                    }
                }
            }
            Update::End(r) => end = r,
            Update::Error(e) => {
                log_request(&d, "error", false);
                return Err(ApiError::internal(e));
            }
        }
    }
    if blocks.is_empty() {
        blocks.push(json!({"type": "text", "text": ""}));
    }
    let (sr, ss) = stop_reason(&end, calls);
    log_request(&d, sr, false);
    Ok(Json(json!({
        "id": ctx.id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": blocks,
        "stop_reason": sr,
        "stop_sequence": ss,
        "usage": usage(&d),
    }))
    .into_response())
}

fn ev(name: &str, v: Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

fn stream(ctx: Ctx, mut d: Driver) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let start = json!({"type": "message_start", "message": {
            "id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": d.prompt_tokens - d.cached_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": d.cached_tokens, "cache_creation_input_tokens": 0},
        }});
        if tx.send(ev("message_start", start)).await.is_err() {
            return;
        }
        if tx.send(ev("ping", json!({"type": "ping"}))).await.is_err() {
            return;
        }
        // The open block: its index and type.
        let mut open: Option<(usize, &'static str)> = None;
        let mut next_index = 0usize;
        let mut calls = false;
        let mut events: Vec<SseEvent> = Vec::new();
        let close = |open: &mut Option<(usize, &'static str)>, events: &mut Vec<SseEvent>| {
            if let Some((i, kind)) = open.take() {
                if kind == "thinking" {
                    events.push(ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i,
                        "delta": {"type": "signature_delta", "signature": ""}}),
                    ));
                }
                events.push(ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                ));
            }
        };
        loop {
            let Some(u) = d.next().await else { break };
            match u {
                Update::Pieces { pieces, .. } => {
                    for p in pieces {
                        let (kind, delta) = match &p {
                            Piece::Content(t) => ("text", json!({"type": "text_delta", "text": t})),
                            Piece::Reasoning(t) => {
                                ("thinking", json!({"type": "thinking_delta", "thinking": t}))
                            }
                            Piece::ToolArgs(a) => (
                                "tool_use",
                                json!({"type": "input_json_delta", "partial_json": a}),
                            ),
                            Piece::ToolStart { name } => {
                                calls = true;
                                close(&mut open, &mut events);
                                let block = json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}});
                                events.push(ev(
                                    "content_block_start",
                                    json!({"type": "content_block_start",
                                    "index": next_index, "content_block": block}),
                                ));
                                open = Some((next_index, "tool_use"));
                                next_index += 1;
                                continue;
                            }
                            Piece::ToolEnd => {
                                close(&mut open, &mut events);
                                continue;
                            }
                            // Whole calls arrive expanded (Driver).
                            Piece::ToolCall { .. } => continue,
                        };
                        if open.map(|o| o.1) != Some(kind) {
                            close(&mut open, &mut events);
                            let block = match kind {
                                "text" => json!({"type": "text", "text": ""}),
                                _ => json!({"type": "thinking", "thinking": "", "signature": ""}),
                            };
                            events.push(ev(
                                "content_block_start",
                                json!({"type": "content_block_start",
                                "index": next_index, "content_block": block}),
                            ));
                            open = Some((next_index, kind));
                            next_index += 1;
                        }
                        let i = open.map_or(0, |o| o.0);
                        events.push(ev(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": i, "delta": delta}),
                        ));
                    }
                    for e in events.drain(..) {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                }
                Update::End(r) => {
                    if next_index == 0 {
                        events.push(ev(
                            "content_block_start",
                            json!({"type": "content_block_start",
                            "index": 0, "content_block": {"type": "text", "text": ""}}),
                        ));
                        open = Some((0, "text"));
                    }
                    close(&mut open, &mut events);
                    let (sr, ss) = stop_reason(&r, calls);
                    events.push(ev(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": sr, "stop_sequence": ss}, "usage": usage(&d)}),
                    ));
                    events.push(ev("message_stop", json!({"type": "message_stop"})));
                    for e in events.drain(..) {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                    log_request(&d, sr, true);
                    return;
                }
                Update::Error(e) => {
                    let err = ApiError::internal(e);
                    let body = if err.message.contains("shutting down") {
                        json!({"type": "error", "error": {"type": "overloaded_error", "message": err.message}})
                    } else {
                        err.anthropic_body()
                    };
                    let _ = tx.send(ev("error", body)).await;
                    log_request(&d, "error", true);
                    return;
                }
            }
        }
    });
    sse(rx)
}
