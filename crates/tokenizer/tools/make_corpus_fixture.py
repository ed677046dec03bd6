#!/usr/bin/env python3
"""Builds fixtures/tokenizer/qwen25_corpus.json: a corpus of texts and the ids llama.cpp's
`llama-tokenize` gives for them on the Qwen2.5-Coder vocabulary (fixtures/tokenizer/
qwen25-coder-vocab.gguf), once with special-token parsing off and once on. The ids are the
oracle that tests/llama_vocab.rs compares against.

usage: make_corpus_fixture.py LLAMA_TOKENIZE VOCAB.gguf OUT.json
"""
import json
import subprocess
import sys
import tempfile

CORPUS = [
    # English
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'm sure they'll say we've done it; DON'T you think? She'd agree, HE'LL NOT.",
    "Mr. O'Neil's dog—a 3-year-old—barked... \"Really?!\" (yes) [no] {maybe} <tag/>",
    # other scripts
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "你好，世界！我想在apple工作1314151天～",
    "日本語のテキストとカタカナ、ひらがな。",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया, यह हिन्दी है।",
    "สวัสดีชาวโลก",
    "កាន់តែពិសេសអាចខលចេញ",
    "Ḽơᶉëᶆ ȋṕšᶙṁ ḍỡḽǭᵳ ʂǐť ӓṁệẗ",
    "cafe\u0301 re\u0301sume\u0301 nai\u0308ve",
    "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son';",
    "const f = async (x) => { await fetch(`/api/${x}`); };  // TODO: fix",
    "    if (a && b || !c) { x += 1; } else { x -= 1; }",
    "<div class=\"main\"><p>Hi &amp; bye</p></div>",
    "$ ls -la | grep '^d' > out.txt 2>&1",
    # numbers
    "3.14159265358979",
    "1,234,567.89 and 0x1F3A and 1e-10 and -42",
    "333333333",
    "2024-03-01T12:34:56Z",
    "٣٤٥ ١٢",
    # emoji
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "👍🏽 👨‍👩‍👧‍👦 🇯🇵 🦙.cpp 🦀",
    # whitespace runs
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    "\t\n",
    "   Hello\n    Hello",
    "a  \n\n  b",
    "line one\r\nline two\r\n",
    "trailing spaces   ",
    "x\u00a0y\u3000z\u2009w",
    "\n =",
    "' era",
    # special and user-defined tokens written as text
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|endoftext|>",
    "a<|fim_prefix|>b<|fim_suffix|>c<|fim_middle|>",
    # odd characters
    "\ufeffBOM and zero\u200bwidth\u200djoiner",
    "control \u0001\u0002 chars",
    "w048 7tuijk dsdfhu",
]


def tokenize(exe, vocab, text, parse_special):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    args = [exe, "-m", vocab, "-f", path, "--ids", "--log-disable", "--no-escape"]
    if not parse_special:
        args.append("--no-parse-special")
    out = subprocess.run(args, check=True, capture_output=True).stdout.decode()
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def main():
    exe, vocab, out = sys.argv[1:4]
    cases = []
    for text in CORPUS:
        cases.append({
            "text": text,
            "ids": tokenize(exe, vocab, text, False),
            "ids_parse_special": tokenize(exe, vocab, text, True),
        })
    doc = {
        "about": "texts and llama.cpp's ids for them on qwen25-coder-vocab.gguf (llama-tokenize --no-escape; "
                 "`ids` with --no-parse-special, `ids_parse_special` without; the vocabulary adds no BOS)",
        "cases": cases,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
