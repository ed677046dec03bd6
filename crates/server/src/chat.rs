//! From a request's conversation to prompt tokens: messages in the form chat templates read
//! (Hugging Face's: `role`, `content` as a string, `tool_calls` with arguments as objects,
//! `reasoning_content`), the tools, the template's extra variables, and the token position of
//! the last user-message boundary (a prefix-cache checkpoint).

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::Ready;

/// A conversation ready to render.
#[derive(Debug, Default)]
pub struct Conversation {
    pub messages: Vec<Value>,
    /// Tools in OpenAI's form (`{"type": "function", "function": {...}}`).
    pub tools: Vec<Value>,
    pub kwargs: Map<String, Value>,
}

/// The rendered prompt.
pub struct Prompt {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Tokens up to the end of the last user message, when that is a prefix of `tokens`.
    pub user_boundary: Option<usize>,
    /// The generation prompt opened a `<think>` block.
    pub in_think: bool,
}

/// Qwen2.5's tool instructions, for templates that do not render `tools` themselves.
fn tools_system_text(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

impl Conversation {
    /// Renders with the model's template and tokenizes; a prompt that leaves no room in the
    /// context is a `context_length_exceeded` error naming `param`.
    pub fn prompt(&self, ready: &Ready, param: &str) -> Result<Prompt, ApiError> {
        let p = self.render(ready)?;
        check_context(ready, p.tokens.len(), param)?;
        Ok(p)
    }

    /// Renders and tokenizes, whatever the length.
    pub fn render(&self, ready: &Ready) -> Result<Prompt, ApiError> {
        let mut messages = self.messages.clone();
        let mut kwargs = self.kwargs.clone();
        if !self.tools.is_empty() {
            if ready.template.source().contains("tools") {
                kwargs.insert("tools".into(), Value::Array(self.tools.clone()));
            } else {
                let text = tools_system_text(&self.tools);
                match messages.first_mut() {
                    Some(m) if m["role"] == "system" => {
                        let c = m["content"].as_str().unwrap_or("").to_string();
                        m["content"] = Value::String(format!("{c}\n\n{text}"));
                    }
                    _ => messages.insert(0, json!({"role": "system", "content": text})),
                }
            }
        }
        let render = |msgs: &[Value], gen: bool| {
            ready
                .template
                .render_json(&Value::Array(msgs.to_vec()), gen, &kwargs)
                .map_err(|e| {
                    ApiError::invalid("messages", format!("the chat template failed: {e}"))
                })
        };
        let text = render(&messages, true)?;
        let tokens = encode(ready, &text)?;
        let user_boundary = match messages.iter().rposition(|m| m["role"] == "user") {
            Some(i) => render(&messages[..=i], false)
                .ok()
                .and_then(|t| encode(ready, &t).ok())
                .filter(|b| !b.is_empty() && b.len() < tokens.len() && tokens.starts_with(b))
                .map(|b| b.len()),
            _ => None,
        };
        let in_think = text.trim_end_matches('\n').ends_with("<think>");
        Ok(Prompt {
            text,
            tokens,
            user_boundary,
            in_think,
        })
    }
}

pub fn encode(ready: &Ready, text: &str) -> Result<Vec<u32>, ApiError> {
    ready
        .tok
        .encode(text, true, true)
        .map_err(|e| ApiError::invalid("messages", format!("tokenizing the prompt: {e}")))
}

pub fn check_context(ready: &Ready, n: usize, param: &str) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::invalid(param, "the prompt has no tokens"));
    }
    if n >= ready.n_ctx {
        return Err(ApiError::context_length(n, ready.n_ctx, param));
    }
    Ok(())
}

/// Text of an OpenAI `content`: a string, null, or an array of `{"type": "text", "text"}` parts.
pub fn openai_content(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => match p.get("text").and_then(Value::as_str) {
                        Some(t) => s.push_str(t),
                        None => {
                            return Err(ApiError::invalid(
                                format!("{at}[{j}].text"),
                                "expected a string",
                            ))
                        }
                    },
                    Some(other) => {
                        return Err(ApiError::invalid(
                            format!("{at}[{j}].type"),
                            format!(
                                "content parts of type {other:?} are not supported; only \"text\""
                            ),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{at}[{j}].type"),
                            "missing; expected \"text\"",
                        ))
                    }
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::invalid(
            at,
            "expected a string or an array of content parts",
        )),
    }
}

/// An OpenAI `messages` array in template form.
pub fn openai_messages(msgs: &[Value]) -> Result<Vec<Value>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(at, "expected an object"));
        };
        let role = match obj.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some("developer") => "system",
            Some(r) => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("{r:?}; expected system, developer, user, assistant or tool"),
                ))
            }
            None => return Err(ApiError::invalid(format!("{at}.role"), "missing")),
        };
        let content = openai_content(
            obj.get("content").unwrap_or(&Value::Null),
            &format!("{at}.content"),
        )?;
        let mut msg = json!({"role": role, "content": content});
        if role == "assistant" {
            if let Some(r) = obj
                .get("reasoning_content")
                .or_else(|| obj.get("reasoning"))
                .and_then(Value::as_str)
            {
                msg["reasoning_content"] = Value::String(r.into());
            }
            if let Some(calls) = obj.get("tool_calls").filter(|v| !v.is_null()) {
                let Some(calls) = calls.as_array() else {
                    return Err(ApiError::invalid(
                        format!("{at}.tool_calls"),
                        "expected an array",
                    ));
                };
                let mut tc = Vec::new();
                for (j, c) in calls.iter().enumerate() {
                    let f = c.get("function");
                    let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                    let Some(name) = name else {
                        return Err(ApiError::invalid(
                            format!("{at}.tool_calls[{j}].function.name"),
                            "missing",
                        ));
                    };
                    let args = f
                        .and_then(|f| f.get("arguments"))
                        .cloned()
                        .unwrap_or(json!({}));
                    // Templates write `arguments | tojson`: give them the object.
                    let args = match args {
                        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
                        a => a,
                    };
                    tc.push(json!({
                        "id": c.get("id").cloned().unwrap_or(Value::Null),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }));
                }
                msg["tool_calls"] = Value::Array(tc);
            }
        }
        if role == "tool" {
            if let Some(id) = obj.get("tool_call_id") {
                msg["tool_call_id"] = id.clone();
            }
        }
        if let Some(n) = obj.get("name").and_then(Value::as_str) {
            msg["name"] = Value::String(n.into());
        }
        out.push(msg);
    }
    Ok(out)
}

/// OpenAI `tools`: each `{"type": "function", "function": {"name", ...}}`.
pub fn openai_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                format!("tools[{i}].type"),
                "expected \"function\"",
            ));
        }
        if t.pointer("/function/name")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                "missing",
            ));
        }
    }
    Ok(tools.to_vec())
}

/// The function names of OpenAI-form tools.
pub fn tool_names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
        .map(String::from)
        .collect()
}
