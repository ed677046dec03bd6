//! Chat templates rendered by minijinja against Python jinja2 with Hugging Face's settings (the
//! oracle strings in fixtures/tokenizer/chat_cases.json, made by tools/make_chat_fixture.py):
//! Qwen2.5-Coder (tools), the fixture models' ChatML, Qwen3 and Qwen3.5 (thinking on/off,
//! reasoning in history, tool calls), Llama 3.1 (date line, BOS).

use std::path::PathBuf;

use strata_gguf::GgufFile;
use strata_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizer")
}

#[derive(serde::Deserialize)]
struct Case {
    template: String,
    messages: serde_json::Value,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, serde_json::Value>,
    bos_token: String,
    eos_token: String,
    expected: String,
}

#[derive(serde::Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[test]
fn templates_render_like_hugging_face_jinja() {
    let s = std::fs::read_to_string(fixtures().join("chat_cases.json")).unwrap();
    let cases: Cases = serde_json::from_str(&s).unwrap();
    assert!(cases.cases.len() >= 15);
    let mut failures = Vec::new();
    for (i, c) in cases.cases.iter().enumerate() {
        let src = std::fs::read_to_string(fixtures().join("templates").join(&c.template)).unwrap();
        let t = ChatTemplate::new(&src, &c.bos_token, &c.eos_token).unwrap();
        match t.render_json(&c.messages, c.add_generation_prompt, &c.extra) {
            Ok(got) if got == c.expected => {}
            Ok(got) => failures.push(format!(
                "case {i} ({}):\n--- got\n{got}\n--- want\n{}",
                c.template, c.expected
            )),
            Err(e) => failures.push(format!("case {i} ({}): {e}", c.template)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn template_from_the_model_file_and_thinking_switch() {
    let f = GgufFile::open(fixtures().join("qwen25-coder-vocab.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let t = ChatTemplate::from_tokenizer(&tok)
        .unwrap()
        .expect("the model has a template");
    assert!(!t.supports_thinking());
    let msgs = [ChatMessage::new("user", "hi")];
    let out = t.render(&msgs, true, &serde_json::Map::new()).unwrap();
    assert!(
        out.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        "{out}"
    );
    // The rendered prompt tokenizes with the chat markers as single control tokens.
    let ids = tok.encode(&out, false, true).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 151644).count(), 3);

    let src = std::fs::read_to_string(fixtures().join("templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
    let q3 = ChatTemplate::new(&src, "", "<|im_end|>").unwrap();
    assert!(q3.supports_thinking());
    let mut off = serde_json::Map::new();
    off.insert("enable_thinking".into(), false.into());
    let a = q3.render(&msgs, true, &off).unwrap();
    let b = q3.render(&msgs, true, &serde_json::Map::new()).unwrap();
    assert!(a.ends_with("<think>\n\n</think>\n\n") && !b.ends_with("</think>\n\n"));
}

#[test]
fn raise_exception_and_syntax_errors_are_errors() {
    let t = ChatTemplate::new("{{ raise_exception('no system role allowed') }}", "", "").unwrap();
    let e = t
        .render(&[], false, &serde_json::Map::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no system role allowed"), "{e}");
    assert!(ChatTemplate::new("{% if %}", "", "").is_err());
}
