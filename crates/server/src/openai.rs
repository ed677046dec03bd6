//! OpenAI's API: `/v1/chat/completions`, `/v1/completions` (both streaming as server-sent
//! events in OpenAI's exact chunk shapes), `/v1/models`, and llama-server's `/tokenize` and
//! `/detokenize`. Errors are OpenAI's shape, with the field at fault in `param`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::chat::{self, Conversation};
use crate::engine::TokenLogprob;
use crate::error::ApiError;
use crate::grammar::Grammar;
use crate::output::Piece;
use crate::run::{
    fields, new_id, unix_now, Driver, EndReason, GenSpec, SamplingFields, Stop, Update,
};
use crate::{AppState, Ready};

/// The fields of `/v1/chat/completions` and `/v1/completions` besides sampling.
#[derive(Debug, Default, Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    /// llama.cpp's name for max_tokens.
    n_predict: Option<i64>,
    stop: Option<Stop>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    top_logprobs: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatFields {
    messages: Vec<Value>,
    logprobs: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
    /// llama-server's switch: "none" leaves `<think>` in the content.
    reasoning_format: Option<String>,
    /// llama.cpp's reasoning budget: most tokens inside `<think>` (-1: no limit).
    reasoning_budget: Option<i64>,
    parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct CompletionFields {
    prompt: Value,
    logprobs: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
}

/// The body as JSON, refusing anything that is not an object.
pub fn body_json(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("", format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid("", "the body must be a JSON object"));
    }
    Ok(v)
}

impl Common {
    fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (name, v) = match (self.max_completion_tokens, self.max_tokens, self.n_predict) {
            (Some(v), _, _) => ("max_completion_tokens", v),
            (None, Some(v), _) => ("max_tokens", v),
            (None, None, Some(v)) => ("n_predict", v),
            (None, None, None) => return Ok(None),
        };
        match v {
            -1 if name == "n_predict" => Ok(None),
            v if v >= 1 => Ok(Some(v as usize)),
            v => Err(ApiError::invalid(
                name,
                format!("{v}; expected an integer of at least 1"),
            )),
        }
    }

    fn check(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    "n",
                    format!("{n}; only n = 1 is supported"),
                ));
            }
        }
        if let Some(k) = self.top_logprobs {
            if k > 20 {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("{k}; expected 0 to 20"),
                ));
            }
        }
        if self.stream_options.is_some() && self.stream != Some(true) {
            return Err(ApiError::invalid(
                "stream_options",
                "only allowed when stream is true",
            ));
        }
        Ok(())
    }

    fn stops(&self) -> Result<Vec<String>, ApiError> {
        let v = self.stop.clone().map(Stop::into_vec).unwrap_or_default();
        if v.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "a stop string is empty"));
        }
        Ok(v)
    }
}

/// One model is served whatever the request names (llama-server does the same).
fn model_id(s: &AppState, _asked: &Option<String>) -> String {
    s.cfg.model_id.clone()
}

pub async fn models(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = s.check_key(&headers) {
        return e.openai();
    }
    let meta = s
        .ready()
        .map(|r| json!({"arch": r.arch, "n_ctx": r.n_ctx, "n_vocab": r.n_vocab}));
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model_id,
            "object": "model",
            "created": unix_now(),
            "owned_by": "strata",
            "meta": meta,
        }]
    }))
    .into_response()
}

pub async fn chat_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match chat_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.openai(),
    }
}

async fn chat_inner(s: AppState, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    s.check_key(&headers)?;
    let v = body_json(&body)?;
    let common: Common = fields(&v)?;
    let sf: SamplingFields = fields(&v)?;
    let cf: ChatFields = fields(&v)?;
    common.check()?;
    let params = sf.params()?;
    let max_tokens = common.max_tokens()?;
    let stops = common.stops()?;
    let mut grammar: Option<(Grammar, &'static str)> = match &cf.response_format {
        None => None,
        Some(rf) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some((Grammar::json_object(), "response_format")),
            Some("json_schema") => match rf.pointer("/json_schema/schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => Some((
                    Grammar::json_schema(schema.clone()),
                    "response_format.json_schema.schema",
                )),
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        "missing; expected a JSON schema object",
                    ))
                }
            },
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "expected \"text\", \"json_object\" or \"json_schema\"",
                ))
            }
        },
    };
    let tools = chat::openai_tools(cf.tools.as_deref().unwrap_or(&[]))?;
    let forced = |ts: &[Value]| -> Result<Option<(Grammar, &'static str)>, ApiError> {
        if ts.is_empty() {
            return Err(ApiError::invalid(
                "tool_choice",
                "forces a tool call but no tools are given",
            ));
        }
        Ok(Some((Grammar::tool_call(ts), "tools")))
    };
    let (use_tools, force) = match &cf.tool_choice {
        None => (true, None),
        Some(Value::String(c)) if c == "auto" => (true, None),
        Some(Value::String(c)) if c == "none" => (false, None),
        Some(Value::String(c)) if c == "required" => (true, forced(&tools)?),
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let Some(name) = name else {
                return Err(ApiError::invalid("tool_choice.function.name", "missing"));
            };
            let chosen: Vec<Value> = tools
                .iter()
                .filter(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
                .cloned()
                .collect();
            if chosen.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("{name:?} is not one of the request's tools"),
                ));
            }
            (true, forced(&chosen)?)
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("{other}; expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ))
        }
    };
    if force.is_some() {
        if grammar.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call and response_format cannot both constrain the reply",
            ));
        }
        grammar = force;
    }
    let _ = cf.parallel_tool_calls;
    let logprobs = cf.logprobs.unwrap_or(false);
    if common.top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid("top_logprobs", "needs logprobs: true"));
    }
    let messages = chat::openai_messages(&cf.messages)?;
    let ready = s.need_ready()?;
    let conv = Conversation {
        messages,
        tools: if use_tools { tools.clone() } else { Vec::new() },
        kwargs: cf.chat_template_kwargs.clone().unwrap_or_default(),
    };
    let prompt = conv.prompt(ready, "messages")?;
    let spec = GenSpec {
        params,
        max_tokens,
        stops,
        top_logprobs: logprobs.then(|| common.top_logprobs.unwrap_or(0) as usize),
        reasoning: cf.reasoning_format.as_deref() != Some("none"),
        tools: use_tools && !tools.is_empty(),
        tool_names: chat::tool_names(&tools),
        in_think: prompt.in_think,
        user_boundary: prompt.user_boundary,
        grammar,
        reasoning_budget: match cf.reasoning_budget {
            None | Some(-1) => None,
            Some(b) if b >= 0 => Some(b as usize),
            Some(b) => {
                return Err(ApiError::invalid(
                    "reasoning_budget",
                    format!("{b}; expected -1 (no limit) or a count of tokens"),
                ))
            }
        },
        window: sf.spec,
    };
    let driver = Driver::start(&s, ready, prompt.tokens, spec).await?;
    let ctx = Ctx {
        id: new_id("chatcmpl-"),
        model: model_id(&s, &common.model),
        created: unix_now(),
        tok: Arc::clone(&ready.tok),
        logprobs,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if common.stream == Some(true) {
        Ok(stream_chat(ctx, driver))
    } else {
        Ok(collect_chat(ctx, driver).await?)
    }
}

/// What every chunk or response repeats.
struct Ctx {
    id: String,
    model: String,
    created: u64,
    tok: Arc<strata_tokenizer::Tokenizer>,
    logprobs: bool,
    include_usage: bool,
}

fn usage(d: &Driver) -> Value {
    let mut u = json!({
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
    });
    // Our extra: a speculative generation's drafts and acceptances per draft position.
    if let Some(sp) = &d.spec {
        u["speculative"] = json!(sp);
    }
    u
}

fn finish_reason(r: &EndReason, calls: bool) -> &'static str {
    match r {
        EndReason::Length => "length",
        _ if calls => "tool_calls",
        _ => "stop",
    }
}

fn piece_text(tok: &strata_tokenizer::Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok
        .token_to_piece(id, false)
        .map(|p| p.to_vec())
        .unwrap_or_default();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// OpenAI chat `logprobs.content` entries.
fn chat_logprobs(tok: &strata_tokenizer::Tokenizer, lps: &[(u32, TokenLogprob)]) -> Vec<Value> {
    lps.iter()
        .map(|(id, l)| {
            let (t, b) = piece_text(tok, *id);
            let top: Vec<Value> = l
                .top
                .iter()
                .map(|(i, x)| {
                    let (t, b) = piece_text(tok, *i);
                    json!({"token": t, "logprob": x, "bytes": b})
                })
                .collect();
            json!({"token": t, "logprob": l.logprob, "bytes": b, "top_logprobs": top})
        })
        .collect()
}

fn log_request(endpoint: &str, d: &Driver, finish: &str, stream: bool) {
    tracing::info!(
        target: "strata::request",
        endpoint,
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

async fn collect_chat(ctx: Ctx, mut d: Driver) -> Result<Response, ApiError> {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut lps: Vec<(u32, TokenLogprob)> = Vec::new();
    let mut end = EndReason::Eog;
    while let Some(u) = d.next().await {
        match u {
            Update::Pieces { pieces, logprobs } => {
                lps.extend(logprobs);
                for p in pieces {
                    match p {
                        Piece::Content(t) => content.push_str(&t),
                        Piece::Reasoning(t) => reasoning.push_str(&t),
                        Piece::ToolStart { name } => calls.push(json!({
                            "id": new_id("call_"),
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        })),
                        Piece::ToolArgs(a) => {
                            if let Some(c) = calls.last_mut() {
                                let s = format!(
                                    "{}{a}",
                                    c["function"]["arguments"].as_str().unwrap_or("")
                                );
                                c["function"]["arguments"] = json!(s);
                            }
                        }
                        // Whole calls arrive expanded (Driver); an end closes nothing here.
                        Piece::ToolEnd | Piece::ToolCall { .. } => {}
                    }
                }
            }
            Update::End(r) => end = r,
            Update::Error(e) => {
                log_request("chat", &d, "error", false);
                return Err(ApiError::internal(e));
            }
        }
    }
    let fr = finish_reason(&end, !calls.is_empty());
    let mut msg = json!({"role": "assistant", "content": content});
    if content.is_empty() && !calls.is_empty() {
        msg["content"] = Value::Null;
    }
    if !reasoning.is_empty() {
        msg["reasoning_content"] = Value::String(reasoning);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    let logprobs = if ctx.logprobs {
        json!({"content": chat_logprobs(&ctx.tok, &lps)})
    } else {
        Value::Null
    };
    log_request("chat", &d, fr, false);
    Ok(Json(json!({
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": fr}],
        "usage": usage(&d),
        "timings": crate::web::timings(&d),
    }))
    .into_response())
}

/// An SSE response fed by a task; dropping the response (the client left) ends the task, whose
/// driver then closes the job's channel, which cancels the generation.
pub fn sse(rx: mpsc::Receiver<SseEvent>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream).into_response()
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_chat(ctx: Ctx, mut d: Driver) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let chunk = |delta: Value, lp: Value, fr: Value| {
            let mut c = json!({
                "id": ctx.id,
                "object": "chat.completion.chunk",
                "created": ctx.created,
                "model": ctx.model,
                "system_fingerprint": "strata",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": fr}],
            });
            if ctx.include_usage {
                c["usage"] = Value::Null;
            }
            c
        };
        let lp_value = |lps: &[(u32, TokenLogprob)]| {
            if ctx.logprobs {
                json!({"content": chat_logprobs(&ctx.tok, lps)})
            } else {
                Value::Null
            }
        };
        if tx
            .send(data(&chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            )))
            .await
            .is_err()
        {
            return;
        }
        let mut n_calls = 0usize;
        let mut pending: Vec<(u32, TokenLogprob)> = Vec::new();
        loop {
            let Some(u) = d.next().await else { break };
            match u {
                Update::Pieces { pieces, logprobs } => {
                    pending.extend(logprobs);
                    for p in pieces {
                        let mut out = Vec::new();
                        match p {
                            Piece::Content(t) => {
                                let lp = lp_value(&pending);
                                pending.clear();
                                out.push(chunk(json!({"content": t}), lp, Value::Null));
                            }
                            Piece::Reasoning(t) => out.push(chunk(
                                json!({"reasoning_content": t}),
                                Value::Null,
                                Value::Null,
                            )),
                            Piece::ToolStart { name } => {
                                let head = json!({"tool_calls": [{
                                    "index": n_calls, "id": new_id("call_"), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]});
                                out.push(chunk(head, Value::Null, Value::Null));
                            }
                            Piece::ToolArgs(a) => {
                                let args = json!({"tool_calls": [{
                                    "index": n_calls, "function": {"arguments": a}}]});
                                out.push(chunk(args, Value::Null, Value::Null));
                            }
                            Piece::ToolEnd => n_calls += 1,
                            // Whole calls arrive expanded (Driver).
                            Piece::ToolCall { .. } => {}
                        }
                        for c in out {
                            if tx.send(data(&c)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                Update::End(r) => {
                    let fr = finish_reason(&r, n_calls > 0);
                    let lp = if pending.is_empty() {
                        Value::Null
                    } else {
                        lp_value(&pending)
                    };
                    let _ = tx.send(data(&chunk(json!({}), lp, json!(fr)))).await;
                    if ctx.include_usage {
                        let u = json!({
                            "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
                            "model": ctx.model, "system_fingerprint": "strata", "choices": [], "usage": usage(&d),
                            "timings": crate::web::timings(&d),
                        });
                        let _ = tx.send(data(&u)).await;
                    }
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    log_request("chat", &d, fr, true);
                    return;
                }
                Update::Error(e) => {
                    let _ = tx.send(data(&ApiError::internal(e).openai_body())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    log_request("chat", &d, "error", true);
                    return;
                }
            }
        }
    });
    sse(rx)
}

/// `prompt`: a string, an array with one string, or an array of token ids.
fn completion_prompt(ready: &Ready, v: &Value) -> Result<Vec<u32>, ApiError> {
    let toks = match v {
        Value::String(s) => {
            chat::encode(ready, s).map_err(|e| ApiError::invalid("prompt", e.message))?
        }
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            chat::encode(ready, a[0].as_str().unwrap_or(""))
                .map_err(|e| ApiError::invalid("prompt", e.message))?
        }
        Value::Array(a) if a.iter().all(Value::is_number) => {
            let mut t = Vec::with_capacity(a.len());
            for (i, x) in a.iter().enumerate() {
                match x.as_u64() {
                    Some(id) if (id as usize) < ready.n_vocab => t.push(id as u32),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("prompt[{i}]"),
                            format!("{x}; expected a token id below {}", ready.n_vocab),
                        ))
                    }
                }
            }
            t
        }
        Value::Array(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "only one prompt per request (n = 1): a string, [string] or token ids",
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "expected a string or an array of token ids",
            ))
        }
    };
    chat::check_context(ready, toks.len(), "prompt")?;
    Ok(toks)
}

pub async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    match completions_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.openai(),
    }
}

async fn completions_inner(
    s: AppState,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    s.check_key(&headers)?;
    let v = body_json(&body)?;
    let common: Common = fields(&v)?;
    let sf: SamplingFields = fields(&v)?;
    let cf: CompletionFields = fields(&v)?;
    common.check()?;
    let params = sf.params()?;
    let max_tokens = common.max_tokens()?.or(Some(16));
    let stops = common.stops()?;
    if cf.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if cf.suffix.is_some() {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    if let Some(k) = cf.logprobs {
        if k > 5 {
            return Err(ApiError::invalid(
                "logprobs",
                format!("{k}; expected 0 to 5"),
            ));
        }
    }
    let ready = s.need_ready()?;
    let prompt = completion_prompt(ready, &cf.prompt)?;
    let spec = GenSpec {
        params,
        max_tokens,
        stops,
        top_logprobs: cf.logprobs.map(|k| k as usize),
        reasoning: false,
        tools: false,
        tool_names: Vec::new(),
        in_think: false,
        user_boundary: None,
        grammar: None,
        reasoning_budget: None,
        window: sf.spec,
    };
    let d = Driver::start(&s, ready, prompt, spec).await?;
    let ctx = Ctx {
        id: new_id("cmpl-"),
        model: model_id(&s, &common.model),
        created: unix_now(),
        tok: Arc::clone(&ready.tok),
        logprobs: cf.logprobs.is_some(),
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if common.stream == Some(true) {
        Ok(stream_completion(ctx, d))
    } else {
        collect_completion(ctx, d).await
    }
}

/// The legacy completions `logprobs` object.
fn completion_logprobs(
    tok: &strata_tokenizer::Tokenizer,
    lps: &[(u32, TokenLogprob)],
    offset0: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    let mut off = offset0;
    for (id, l) in lps {
        let (t, _) = piece_text(tok, *id);
        offsets.push(off);
        off += t.len();
        tokens.push(t);
        token_logprobs.push(l.logprob);
        let m: Map<String, Value> = l
            .top
            .iter()
            .map(|(i, x)| (piece_text(tok, *i).0, json!(x)))
            .collect();
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

fn piece_str(p: Piece) -> String {
    match p {
        Piece::Content(t) | Piece::Reasoning(t) => t,
        // Completions parse no tools (GenSpec::tools is false there).
        Piece::ToolCall { .. } | Piece::ToolStart { .. } | Piece::ToolArgs(_) | Piece::ToolEnd => {
            String::new()
        }
    }
}

async fn collect_completion(ctx: Ctx, mut d: Driver) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut end = EndReason::Eog;
    while let Some(u) = d.next().await {
        match u {
            Update::Pieces { pieces, logprobs } => {
                lps.extend(logprobs);
                for p in pieces {
                    text.push_str(&piece_str(p));
                }
            }
            Update::End(r) => end = r,
            Update::Error(e) => {
                log_request("completions", &d, "error", false);
                return Err(ApiError::internal(e));
            }
        }
    }
    let fr = finish_reason(&end, false);
    log_request("completions", &d, fr, false);
    let lp = if ctx.logprobs {
        completion_logprobs(&ctx.tok, &lps, 0)
    } else {
        Value::Null
    };
    Ok(Json(json!({
        "id": ctx.id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": fr}],
        "usage": usage(&d),
    }))
    .into_response())
}

fn stream_completion(ctx: Ctx, mut d: Driver) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let chunk = |text: &str, lp: Value, fr: Value| {
            let mut c = json!({
                "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                "system_fingerprint": "strata",
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": fr}],
            });
            if ctx.include_usage {
                c["usage"] = Value::Null;
            }
            c
        };
        let mut offset = 0usize;
        while let Some(u) = d.next().await {
            match u {
                Update::Pieces { pieces, logprobs } => {
                    let text: String = pieces.into_iter().map(piece_str).collect();
                    if text.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    let lp = if ctx.logprobs {
                        completion_logprobs(&ctx.tok, &logprobs, offset)
                    } else {
                        Value::Null
                    };
                    offset += text.len();
                    if tx.send(data(&chunk(&text, lp, Value::Null))).await.is_err() {
                        return;
                    }
                }
                Update::End(r) => {
                    let fr = finish_reason(&r, false);
                    let _ = tx.send(data(&chunk("", Value::Null, json!(fr)))).await;
                    if ctx.include_usage {
                        let u = json!({
                            "id": ctx.id, "object": "text_completion", "created": ctx.created,
                            "model": ctx.model, "system_fingerprint": "strata", "choices": [], "usage": usage(&d),
                        });
                        let _ = tx.send(data(&u)).await;
                    }
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    log_request("completions", &d, fr, true);
                    return;
                }
                Update::Error(e) => {
                    let _ = tx.send(data(&ApiError::internal(e).openai_body())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    log_request("completions", &d, "error", true);
                    return;
                }
            }
        }
    });
    sse(rx)
}

#[derive(Deserialize)]
struct TokenizeReq {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

pub async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        s.check_key(&headers)?;
        let v = body_json(&body)?;
        let req: TokenizeReq = fields(&v)?;
        let ready = s.need_ready()?;
        let toks = ready
            .tok
            .encode(&req.content, req.add_special, req.parse_special)
            .map_err(|e| ApiError::invalid("content", format!("{e}")))?;
        let tokens: Vec<Value> = if req.with_pieces {
            toks.iter()
                .map(|&id| {
                    let b = ready
                        .tok
                        .token_to_piece(id, true)
                        .map(|p| p.to_vec())
                        .unwrap_or_default();
                    let piece = match String::from_utf8(b) {
                        Ok(s) => json!(s),
                        Err(e) => json!(e.into_bytes()),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect()
        } else {
            toks.iter().map(|&t| json!(t)).collect()
        };
        Ok::<_, ApiError>(Json(json!({"tokens": tokens})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.openai())
}

#[derive(Deserialize)]
struct DetokenizeReq {
    tokens: Vec<i64>,
}

pub async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        s.check_key(&headers)?;
        let v = body_json(&body)?;
        let req: DetokenizeReq = fields(&v)?;
        let ready = s.need_ready()?;
        let mut ids = Vec::with_capacity(req.tokens.len());
        for (i, &t) in req.tokens.iter().enumerate() {
            if t < 0 || t as usize >= ready.n_vocab {
                return Err(ApiError::invalid(
                    format!("tokens[{i}]"),
                    format!("{t}; expected a token id below {}", ready.n_vocab),
                ));
            }
            ids.push(t as u32);
        }
        let text = ready
            .tok
            .decode(&ids, true)
            .map_err(|e| ApiError::invalid("tokens", format!("{e}")))?;
        Ok(Json(json!({"content": text})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.openai())
}
