//! One error type for every endpoint, written in the shape of the API the endpoint imitates:
//! OpenAI's `{"error": {"message", "type", "param", "code"}}` or Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`).
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        let message = message.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: if param.is_empty() {
                message
            } else {
                format!("{param}: {message}")
            },
            param: (!param.is_empty()).then_some(param),
            code: None,
        }
    }

    pub fn context_length(prompt: usize, n_ctx: usize, param: &str) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                param,
                format!(
                    "the prompt has {prompt} tokens; this server's context holds {n_ctx} \
                     positions (the prompt must leave room for at least one new token)"
                ),
            )
        }
    }

    pub fn auth(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
    }

    pub fn busy(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn openai_body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code.map(str::to_string).or_else(|| (self.status.as_u16() != 400).then(|| self.status.as_u16().to_string())),
        }})
    }

    pub fn openai(&self) -> Response {
        (self.status, axum::Json(self.openai_body())).into_response()
    }

    /// Anthropic's error types by status.
    pub fn anthropic_kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    pub fn anthropic_body(&self) -> serde_json::Value {
        json!({"type": "error", "error": {"type": self.anthropic_kind(), "message": self.message}})
    }

    pub fn anthropic(&self) -> Response {
        (self.status, axum::Json(self.anthropic_body())).into_response()
    }
}

/// Parses a JSON body into `T`, naming the field at fault (`messages[2].content: invalid
/// type ...`).
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid("", format!("the body is not valid JSON: {inner}"))
        } else {
            let path = if path == "." { String::new() } else { path };
            ApiError::invalid(path, strip_position(&inner.to_string()))
        }
    })
}

/// serde_json appends " at line L column C"; the field path says more.
fn strip_position(s: &str) -> String {
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s.to_string(),
    }
}
