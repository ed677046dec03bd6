//! Chat templates: `tokenizer.chat_template` (Jinja) rendered the way Hugging Face's
//! `apply_chat_template` renders it — `trim_blocks` and `lstrip_blocks` on, loop controls,
//! `raise_exception`, a `tojson` that writes what Python's `json.dumps` writes, `strftime_now`,
//! Python string/dict methods — with `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token` and any extra variables (e.g. `enable_thinking` for Qwen3-style templates).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use crate::{Result, Tokenizer, TokenizerError};

/// One chat message. Templates may read more fields (tool calls, reasoning); pass those with
/// [`ChatTemplate::render_json`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are the texts the template sees under
    /// those names.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TokenizerError::Template(format!("compiling the template: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template a tokenizer's file carries, with its BOS/EOS texts; `None` when the file
    /// has no template.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
        let Some(src) = tok.chat_template() else {
            return Ok(None);
        };
        let text = |id: Option<u32>| {
            id.and_then(|i| tok.token_text(i).ok())
                .unwrap_or("")
                .to_string()
        };
        ChatTemplate::new(src, &text(tok.bos()), &text(tok.eos())).map(Some)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads `enable_thinking` (Qwen3-style reasoning switch).
    pub fn supports_thinking(&self) -> bool {
        self.source.contains("enable_thinking")
    }

    /// Renders a conversation. `extra` adds template variables (an object; e.g.
    /// `{"enable_thinking": false}`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let msgs =
            serde_json::to_value(messages).map_err(|e| TokenizerError::Template(e.to_string()))?;
        self.render_json(&msgs, add_generation_prompt, extra)
    }

    /// Renders messages given as JSON (an array of objects with any fields the template reads).
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.entry("bos_token")
            .or_insert_with(|| self.bos_token.clone().into());
        ctx.entry("eos_token")
            .or_insert_with(|| self.eos_token.clone().into());
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TokenizerError::Template(format!("{e:#}")))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| TokenizerError::Template(render_error(&e)))
    }
}

fn render_error(e: &Error) -> String {
    // A template's own `raise_exception` message is the useful part; keep minijinja's location.
    let mut s = format!("{e}");
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i64::try_from(v.clone()) {
                out.push_str(&i.to_string());
            } else if let Ok(f) = f64::try_from(v.clone()) {
                out.push_str(&py_float(f));
            } else {
                out.push_str(&v.to_string());
            }
        }
        ValueKind::String => py_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                newline(out, level + 1);
                py_json(item, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                newline(out, level + 1);
                match k.as_str() {
                    Some(s) => py_str(s, out),
                    None => py_str(&k.to_string(), out),
                }
                out.push_str(": ");
                let item = v.get_item(k)?;
                py_json(&item, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => py_str(&v.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn py_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`, which `json.dumps` uses.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Scientific, with at least two exponent digits and an explicit sign.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    if f.fract() == 0.0 {
        return format!("{f:.1}");
    }
    format!("{f}")
}

/// HF's `strftime_now(format)`: the current UTC time, with the common `%` codes.
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

fn strftime(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix.div_euclid(86_400);
    let rem = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month_name = MONTHS[(month - 1).clamp(0, 11) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                out.push_str(&day.to_string());
            }
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_formatting() {
        let v =
            Value::from_serialize(serde_json::json!({"a": [1, 2.5, "x\"\n", null, true], "b": {}}));
        let mut s = String::new();
        py_json(&v, None, false, 0, &mut s).unwrap();
        assert_eq!(s, r#"{"a": [1, 2.5, "x\"\n", null, true], "b": {}}"#);
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(1e20), "1e+20");
        assert_eq!(py_float(1e-5), "1e-05");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %b", 0),
            "1970-01-01 00:00:00 Thu Jan"
        );
        assert_eq!(
            strftime("%d %B %Y, %A", 1_709_251_200),
            "01 March 2024, Friday"
        );
    }
}
