//! From generated tokens to what a response carries: text decoded as it streams (UTF-8 held
//! until complete), stop strings (text held back while it could still be the start of one, so
//! nothing sent is ever taken back), and the split of the model's output into reasoning
//! (`<think>…</think>`), content and tool calls (Qwen's `<tool_call>` JSON and the Coder models'
//! `<function=…><parameter=…>` XML form).
//!
//! Streaming and non-streaming responses are both built from these pieces, so they agree.

use std::sync::Arc;

use serde_json::Value;
use strata_tokenizer::{StreamDecoder, Tokenizer};

/// Decodes tokens and applies stop strings.
pub struct TextStream {
    dec: StreamDecoder,
    /// Control tokens that print anyway (the tool-call and think tags, which some files mark
    /// as control tokens).
    preserved: Arc<Vec<u32>>,
    stops: Vec<String>,
    held: String,
    /// The stop string that matched.
    pub stopped: Option<String>,
}

impl TextStream {
    pub fn new(stops: Vec<String>, preserved: Arc<Vec<u32>>) -> TextStream {
        TextStream {
            dec: StreamDecoder::new(false),
            preserved,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: None,
        }
    }

    /// The text that became final with `id`; after a stop string matched, nothing more.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, String> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        let s = if self.preserved.contains(&id) {
            let piece = tok
                .token_to_piece(id, true)
                .map_err(|e| format!("detokenizing: {e}"))?;
            self.dec.push_bytes(piece)
        } else {
            self.dec
                .push(tok, id)
                .map_err(|e| format!("detokenizing: {e}"))?
        };
        Ok(self.push_text(&s))
    }

    fn push_text(&mut self, s: &str) -> String {
        self.held.push_str(s);
        let first = self
            .stops
            .iter()
            .filter_map(|st| self.held.find(st.as_str()).map(|i| (i, st)))
            .min_by_key(|(i, _)| *i);
        if let Some((i, st)) = first {
            self.stopped = Some(st.clone());
            let out = self.held[..i].to_string();
            self.held.clear();
            return out;
        }
        let keep = self
            .stops
            .iter()
            .map(|st| partial_suffix(&self.held, st))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// Whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        if self.stopped.is_some() {
            return String::new();
        }
        let rest = self.dec.flush();
        let mut out = self.push_text(&rest);
        if self.stopped.is_none() {
            out.push_str(&std::mem::take(&mut self.held));
        }
        out
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat` (on char boundaries).
fn partial_suffix(s: &str, pat: &str) -> usize {
    let max = (pat.len().saturating_sub(1)).min(s.len());
    (1..=max)
        .rev()
        .find(|&k| {
            s.is_char_boundary(s.len() - k) && pat.is_char_boundary(k) && s.ends_with(&pat[..k])
        })
        .unwrap_or(0)
}

/// A piece of a response.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    /// A complete tool call: its name and its arguments as JSON text.
    ToolCall {
        name: String,
        arguments: String,
    },
    /// A `<tool_call>` in the JSON form, streamed: its name once the model has written it,
    /// then its arguments' text as it comes (what the model wrote), then its end. Together
    /// they say what one [`Piece::ToolCall`] says.
    ToolStart {
        name: String,
    },
    ToolArgs(String),
    ToolEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Content,
    Think,
    Tool,
    /// The reply so far is a JSON object: held whole until the end decides.
    Bare,
}

/// Tags the splitter reads, which must reach it even when the vocabulary marks them control.
pub const TAGS: [&str; 4] = [THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE];

/// The ids of [`TAGS`] that are single tokens of `tok`.
pub fn preserved_ids(tok: &Tokenizer) -> Vec<u32> {
    TAGS.iter().filter_map(|t| tok.token_id(t)).collect()
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// Splits generated text into reasoning, content and tool calls, as it streams.
pub struct Splitter {
    mode: Mode,
    /// The mode a tool call returns to.
    back: Mode,
    reasoning: bool,
    tools: bool,
    held: String,
    call: String,
    /// Just after `</think>`: the template's blank line before the answer is not content.
    after_think: bool,
    /// Tool names a bare `{"name": ...}` reply may call (llama.cpp accepts a Hermes-style call
    /// without its `<tool_call>` tag, which small Qwen models often leave out).
    bare_names: Vec<String>,
    /// No content has been emitted yet (a bare call can only be the whole reply).
    fresh: bool,
    /// A streamed call: where its arguments start in `call`, and how far they were sent.
    streaming: Option<(usize, usize)>,
    /// Malformed calls passed on as text.
    pub malformed: usize,
}

impl Splitter {
    /// `in_think`: the prompt already opened a `<think>` block. `reasoning`: split `<think>`
    /// blocks out (else they stay in the content). `tools`: parse tool calls (else text).
    pub fn new(in_think: bool, reasoning: bool, tools: bool) -> Splitter {
        Splitter {
            mode: if in_think && reasoning {
                Mode::Think
            } else {
                Mode::Content
            },
            back: Mode::Content,
            reasoning,
            tools,
            held: String::new(),
            call: String::new(),
            after_think: false,
            bare_names: Vec::new(),
            fresh: true,
            streaming: None,
            malformed: 0,
        }
    }

    /// Accepts a whole reply of bare JSON calls to these tools as tool calls.
    pub fn with_bare_calls(mut self, names: Vec<String>) -> Splitter {
        self.bare_names = names;
        self
    }

    fn tags(&self) -> Vec<&'static str> {
        let mut t = Vec::new();
        match self.mode {
            Mode::Content => {
                if self.reasoning {
                    t.push(THINK_OPEN);
                }
                if self.tools {
                    t.push(TOOL_OPEN);
                }
            }
            Mode::Think => {
                t.push(THINK_CLOSE);
                if self.tools {
                    t.push(TOOL_OPEN);
                }
            }
            Mode::Tool => t.push(TOOL_CLOSE),
            Mode::Bare => {}
        }
        t
    }

    fn emit(&mut self, out: &mut Vec<Piece>, s: &str) {
        if s.is_empty() {
            return;
        }
        match self.mode {
            Mode::Content => {
                let s = if self.after_think {
                    s.trim_start_matches('\n')
                } else {
                    s
                };
                if !s.is_empty() {
                    self.after_think = false;
                    self.fresh = false;
                    push_piece(out, Piece::Content(s.to_string()));
                }
            }
            Mode::Bare => self.call.push_str(s),
            Mode::Think => push_piece(out, Piece::Reasoning(s.to_string())),
            Mode::Tool => {
                self.call.push_str(s);
                self.stream_args(out);
            }
        }
    }

    /// Sends what can be sent of a JSON-form call: its start once `"arguments":` is written,
    /// then the arguments' text, holding back trailing whitespace and a last `}` (which may be
    /// the call object's own).
    fn stream_args(&mut self, out: &mut Vec<Piece>) {
        let (start, sent) = match self.streaming {
            Some(x) => x,
            None => match call_head(&self.call) {
                Some((name, start)) => {
                    out.push(Piece::ToolStart { name });
                    self.streaming = Some((start, start));
                    (start, start)
                }
                None => return,
            },
        };
        let t = self.call.trim_end();
        let safe = if t.ends_with('}') {
            t.len() - 1
        } else {
            t.len()
        };
        if safe > sent {
            out.push(Piece::ToolArgs(self.call[sent..safe].to_string()));
            self.streaming = Some((start, safe));
        }
    }

    /// Ends a streamed call: the rest of its arguments (the call object's closing brace cut).
    fn end_streamed(&mut self, out: &mut Vec<Piece>, call: &str, closed: bool) {
        let Some((start, sent)) = self.streaming.take() else {
            return;
        };
        let t = call.trim_end();
        let end = if closed {
            t.strip_suffix('}').unwrap_or(t).trim_end().len()
        } else {
            t.len()
        };
        if end > sent {
            out.push(Piece::ToolArgs(call[sent..end].to_string()));
        }
        out.push(Piece::ToolEnd);
        let args_ok = serde_json::from_str::<Value>(&call[start..end.max(start)])
            .is_ok_and(|v| v.is_object());
        if !closed || !args_ok || parse_tool_call(call).is_none() {
            self.malformed += 1;
            tracing::warn!(
                "a streamed tool call was malformed (its arguments were sent as written): {call:?}"
            );
        }
    }

    pub fn push(&mut self, s: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.held.push_str(s);
        if self.mode == Mode::Content && self.fresh && !self.bare_names.is_empty() {
            let t = self.held.trim_start();
            if t.is_empty() {
                return out;
            }
            if t.starts_with('{') {
                self.mode = Mode::Bare;
                self.call.clear();
            } else {
                self.bare_names.clear();
            }
        }
        if self.mode == Mode::Bare {
            let s = std::mem::take(&mut self.held);
            self.call.push_str(&s);
            return out;
        }
        loop {
            let tags = self.tags();
            let hit = tags
                .iter()
                .filter_map(|t| self.held.find(t).map(|i| (i, *t)))
                .min_by_key(|(i, _)| *i);
            match hit {
                Some((i, tag)) => {
                    let before = self.held[..i].to_string();
                    self.emit(&mut out, &before);
                    self.held.drain(..i + tag.len());
                    match tag {
                        THINK_OPEN => self.mode = Mode::Think,
                        THINK_CLOSE => {
                            self.mode = Mode::Content;
                            self.after_think = true;
                        }
                        TOOL_OPEN => {
                            self.back = self.mode;
                            self.mode = Mode::Tool;
                            self.call.clear();
                            self.streaming = None;
                        }
                        _ => {
                            let call = std::mem::take(&mut self.call);
                            self.mode = self.back;
                            if self.streaming.is_some() {
                                self.end_streamed(&mut out, &call, true);
                                continue;
                            }
                            match parse_tool_call(&call) {
                                Some((name, arguments)) => {
                                    out.push(Piece::ToolCall { name, arguments })
                                }
                                None => {
                                    self.malformed += 1;
                                    tracing::warn!(
                                        "a malformed tool call was returned as text: {call:?}"
                                    );
                                    let text = format!("{TOOL_OPEN}{call}{TOOL_CLOSE}");
                                    self.emit(&mut out, &text);
                                }
                            }
                        }
                    }
                }
                None => {
                    let keep = tags
                        .iter()
                        .map(|t| partial_suffix(&self.held, t))
                        .max()
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    let text = self.held[..cut].to_string();
                    self.held.drain(..cut);
                    self.emit(&mut out, &text);
                    return out;
                }
            }
        }
    }

    /// The end of the text: held-back text is text; an unclosed tool call is malformed.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        self.emit(&mut out, &rest);
        if self.mode == Mode::Bare {
            let body = std::mem::take(&mut self.call);
            self.mode = Mode::Content;
            match bare_calls(&body, &self.bare_names) {
                Some(calls) => out.extend(calls),
                None => self.emit(&mut out, &body),
            }
            return out;
        }
        if self.mode == Mode::Tool && self.streaming.is_some() {
            let call = std::mem::take(&mut self.call);
            self.mode = self.back;
            self.end_streamed(&mut out, &call, false);
            return out;
        }
        if self.mode == Mode::Tool {
            let call = std::mem::take(&mut self.call);
            self.malformed += 1;
            tracing::warn!("an unfinished tool call was returned as text: {call:?}");
            self.mode = self.back;
            self.emit(&mut out, &format!("{TOOL_OPEN}{call}"));
        }
        out
    }
}

/// Whole calls as their streamed form (start, arguments, end), so that a response is built from
/// one kind of call piece.
pub fn expand_calls(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        match p {
            Piece::ToolCall { name, arguments } => {
                out.push(Piece::ToolStart { name });
                out.push(Piece::ToolArgs(arguments));
                out.push(Piece::ToolEnd);
            }
            p => out.push(p),
        }
    }
    out
}

fn push_piece(out: &mut Vec<Piece>, p: Piece) {
    match (out.last_mut(), &p) {
        (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(b),
        (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(b),
        _ => out.push(p),
    }
}

/// The head `{"name": "N", "arguments":` of a JSON-form call: the name and where the
/// arguments start; None while it is not (yet) written, or for another form.
fn call_head(call: &str) -> Option<(String, usize)> {
    let s = call.trim_start();
    let off = call.len() - s.len();
    let mut i = 0;
    let b = s.as_bytes();
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let lit = |i: &mut usize, l: &str| -> Option<()> {
        if s[*i..].starts_with(l) {
            *i += l.len();
            Some(())
        } else {
            None
        }
    };
    lit(&mut i, "{")?;
    ws(&mut i);
    lit(&mut i, "\"name\"")?;
    ws(&mut i);
    lit(&mut i, ":")?;
    ws(&mut i);
    // The name: a JSON string up to its closing quote.
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    while j < b.len() && b[j] != b'"' {
        j += if b[j] == b'\\' { 2 } else { 1 };
    }
    if j >= b.len() {
        return None;
    }
    let name: String = serde_json::from_str(&s[i..=j]).ok()?;
    i = j + 1;
    ws(&mut i);
    lit(&mut i, ",")?;
    ws(&mut i);
    lit(&mut i, "\"arguments\"")?;
    ws(&mut i);
    lit(&mut i, ":")?;
    ws(&mut i);
    // Only once the arguments have begun (so the call's form is settled).
    if i >= b.len() || name.is_empty() {
        return None;
    }
    Some((name, off + i))
}

/// A reply that is one JSON call, or one per line, to known tools.
fn bare_calls(body: &str, names: &[String]) -> Option<Vec<Piece>> {
    let known = |c: &(String, String)| names.contains(&c.0);
    if let Some(c) = parse_tool_call(body).filter(known) {
        return Some(vec![Piece::ToolCall {
            name: c.0,
            arguments: c.1,
        }]);
    }
    let mut out = Vec::new();
    for line in body.lines().filter(|l| !l.trim().is_empty()) {
        let (name, arguments) = parse_tool_call(line).filter(known)?;
        out.push(Piece::ToolCall { name, arguments });
    }
    (!out.is_empty()).then_some(out)
}

/// The body of a `<tool_call>`: `{"name": ..., "arguments": {...}}` or
/// `<function=NAME><parameter=P>VALUE</parameter>...</function>`; the arguments come back as
/// JSON text.
pub fn parse_tool_call(body: &str) -> Option<(String, String)> {
    let b = body.trim();
    if b.starts_with('{') {
        let v: Value = serde_json::from_str(b).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        if name.is_empty() {
            return None;
        }
        let args = match v.get("arguments").or_else(|| v.get("parameters")) {
            None => Value::Object(Default::default()),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => serde_json::from_str(s).ok()?,
            Some(a) => a.clone(),
        };
        if !args.is_object() {
            return None;
        }
        return Some((name, args.to_string()));
    }
    let rest = b.strip_prefix("<function=")?;
    let end = rest.find('>')?;
    let name = rest[..end].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let mut body = &rest[end + 1..];
    body = body.trim_end().strip_suffix("</function>")?;
    let mut args = serde_json::Map::new();
    loop {
        let t = body.trim_start();
        if t.is_empty() {
            break;
        }
        let r = t.strip_prefix("<parameter=")?;
        let e = r.find('>')?;
        let key = r[..e].trim().to_string();
        let r = &r[e + 1..];
        let close = r.find("</parameter>")?;
        let raw = r[..close].strip_prefix('\n').unwrap_or(&r[..close]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        // A value that parses as JSON (number, object, true) is that value, else a string.
        let v = serde_json::from_str::<Value>(raw).unwrap_or_else(|_| Value::String(raw.into()));
        args.insert(key, v);
        body = &r[close + "</parameter>".len()..];
    }
    Some((name, Value::Object(args).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(parts: &[&str], in_think: bool) -> Vec<Piece> {
        let mut s = Splitter::new(in_think, true, true);
        let mut out = Vec::new();
        for p in parts {
            for x in s.push(p) {
                push_any(&mut out, x);
            }
        }
        for x in s.finish() {
            push_any(&mut out, x);
        }
        out
    }

    /// Folds streamed calls (start, argument pieces, end) into whole ones.
    fn push_any(out: &mut Vec<Piece>, p: Piece) {
        match p {
            Piece::ToolStart { name } => out.push(Piece::ToolCall {
                name,
                arguments: String::new(),
            }),
            Piece::ToolArgs(a) => match out.last_mut() {
                Some(Piece::ToolCall { arguments, .. }) => arguments.push_str(&a),
                _ => panic!("arguments outside a call"),
            },
            Piece::ToolEnd => {}
            Piece::ToolCall { .. } => out.push(p),
            p => push_piece(out, p),
        }
    }

    #[test]
    fn splits_reasoning_content_and_a_json_call_across_any_chunking() {
        let text = "<think>plan it</think>\n\nSure.<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let want = vec![
            Piece::Reasoning("plan it".into()),
            Piece::Content("Sure.".into()),
            Piece::ToolCall {
                name: "get".into(),
                arguments: r#"{"city": "Oslo"}"#.into(),
            },
        ];
        // Every split point, so tags cut across chunks are found too.
        for i in 0..text.len() {
            if !text.is_char_boundary(i) {
                continue;
            }
            assert_eq!(
                split_all(&[&text[..i], &text[i..]], false),
                want,
                "split at {i}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(|s| s.as_str()).collect();
        assert_eq!(split_all(&refs, false), want);
    }

    #[test]
    fn json_calls_stream_their_arguments_as_they_are_written() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": {\"b\": [1, 2]}, \"c\": \"}\"}}\n</tool_call>";
        let mut s = Splitter::new(false, true, true);
        let mut raw = Vec::new();
        for ch in text.chars() {
            raw.extend(s.push(&ch.to_string()));
        }
        raw.extend(s.finish());
        assert_eq!(raw.first(), Some(&Piece::ToolStart { name: "f".into() }));
        assert_eq!(raw.last(), Some(&Piece::ToolEnd));
        let n_args = raw
            .iter()
            .filter(|p| matches!(p, Piece::ToolArgs(_)))
            .count();
        assert!(n_args > 10, "{raw:?}");
        let args: String = raw
            .iter()
            .filter_map(|p| match p {
                Piece::ToolArgs(a) => Some(a.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, r#"{"a": {"b": [1, 2]}, "c": "}"}"#);
        assert_eq!(s.malformed, 0);
    }

    #[test]
    fn a_prompt_that_opened_think_starts_in_reasoning() {
        assert_eq!(
            split_all(&["a b</think>c"], true),
            vec![Piece::Reasoning("a b".into()), Piece::Content("c".into())]
        );
    }

    #[test]
    fn xml_calls_and_calls_inside_think() {
        let text = "<think>x<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>y</think>z";
        assert_eq!(
            split_all(&[text], false),
            vec![
                Piece::Reasoning("x".into()),
                Piece::ToolCall {
                    name: "run".into(),
                    arguments: r#"{"cmd":"ls -l","n":3}"#.into()
                },
                Piece::Reasoning("y".into()),
                Piece::Content("z".into()),
            ]
        );
    }

    #[test]
    fn a_malformed_call_is_text_not_an_empty_turn() {
        let mut s = Splitter::new(false, true, true);
        let mut out = s.push("<tool_call>{not json}</tool_call>");
        out.extend(s.finish());
        assert_eq!(
            out,
            vec![Piece::Content("<tool_call>{not json}</tool_call>".into())]
        );
        assert_eq!(s.malformed, 1);
        let mut s = Splitter::new(false, true, true);
        let mut out = s.push("<tool_call>{\"name\":");
        out.extend(s.finish());
        assert_eq!(out, vec![Piece::Content("<tool_call>{\"name\":".into())]);
    }

    #[test]
    fn a_bare_json_reply_to_a_known_tool_is_a_call() {
        let run = |parts: &[&str], names: &[&str]| {
            let mut s = Splitter::new(false, true, true)
                .with_bare_calls(names.iter().map(|n| n.to_string()).collect());
            let mut out = Vec::new();
            for p in parts {
                out.extend(s.push(p));
            }
            out.extend(s.finish());
            out
        };
        let call = Piece::ToolCall {
            name: "get".into(),
            arguments: r#"{"city":"Oslo"}"#.into(),
        };
        assert_eq!(
            run(
                &[
                    " {\"name\": \"get\", ",
                    "\"arguments\": {\"city\": \"Oslo\"}}"
                ],
                &["get"]
            ),
            vec![call.clone()]
        );
        assert_eq!(
            run(&["{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}"], &["get"]),
            vec![call.clone(), call]
        );
        // An unknown name, other JSON, or text first: content.
        let j = "{\"name\": \"other\", \"arguments\": {}}";
        assert_eq!(run(&[j], &["get"]), vec![Piece::Content(j.into())]);
        assert_eq!(
            run(&["{\"a\": 1}"], &["get"]),
            vec![Piece::Content("{\"a\": 1}".into())]
        );
        assert_eq!(
            run(&["Hi {\"name\": \"get\"}"], &["get"]),
            vec![Piece::Content("Hi {\"name\": \"get\"}".into())]
        );
    }

    #[test]
    fn without_tools_a_call_is_text() {
        let mut s = Splitter::new(false, true, false);
        let mut out = s.push("<tool_call>{\"name\":\"f\"}</tool_call>");
        out.extend(s.finish());
        assert_eq!(
            out,
            vec![Piece::Content(
                "<tool_call>{\"name\":\"f\"}</tool_call>".into()
            )]
        );
    }

    #[test]
    fn stop_strings_cut_and_hold_back_partial_matches() {
        let mut t = TextStream::new(vec!["END".into(), "\n\n".into()], Arc::default());
        assert_eq!(t.push_text("abc E"), "abc ");
        assert_eq!(t.push_text("N"), "");
        assert_eq!(t.push_text("x"), "ENx");
        assert_eq!(t.push_text("yEND more"), "y");
        assert_eq!(t.stopped.as_deref(), Some("END"));
        let mut t = TextStream::new(vec!["é!".into()], Arc::default());
        assert_eq!(t.push_text("aé"), "a");
        assert_eq!(t.finish(), "é");
    }
}
