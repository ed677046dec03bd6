#!/usr/bin/env python3
"""Builds fixtures/tokenizer/chat_cases.json: chat templates rendered by Python's jinja2 the
way Hugging Face's `apply_chat_template` renders them (ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and loop controls; `raise_exception`; `tojson` = json.dumps with
ensure_ascii=False; `strftime_now`). tests/chat_template.rs renders the same cases with
minijinja and compares.

usage: make_chat_fixture.py FIXTURE_DIR   (reads FIXTURE_DIR/templates/*.jinja and the Qwen2.5
       template text from FIXTURE_DIR/qwen25-coder-chat.jinja)
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render(source, messages, add_generation_prompt, extra, bos, eos):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        # Fixed so the fixture is reproducible; the templates here only use it for a date line.
        return datetime(2024, 3, 1).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    t = env.from_string(source)
    return t.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra)


SIMPLE = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? Answer in \"quotes\"\nplease."},
]
NO_SYSTEM = [{"role": "user", "content": "Write a haiku about rust."}]
# Keys in sorted order at every level: the Rust side builds its JSON maps sorted.
TOOLS = [
    {
        "function": {
            "description": "Get the weather for a city — in °C",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"description": "City name", "type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
        "type": "function",
    }
]
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"content": "", "role": "assistant",
     "tool_calls": [{"function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, "type": "function"}]},
    {"content": "{\"temp\": 21}", "role": "tool"},
]
REASONING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nHello!"},
    {"role": "user", "content": "Bye"},
]


def main():
    fixture_dir = sys.argv[1]
    tdir = os.path.join(fixture_dir, "templates")
    cases = []

    def add(template, messages, gen, extra=None, bos="", eos="", tools=None):
        extra = dict(extra or {})
        if tools is not None:
            extra["tools"] = tools
        with open(os.path.join(tdir, template), encoding="utf-8") as f:
            src = f.read()
        cases.append({
            "template": template,
            "messages": messages,
            "add_generation_prompt": gen,
            "extra": extra,
            "bos_token": bos,
            "eos_token": eos,
            "expected": render(src, messages, gen, extra, bos, eos),
        })

    for t in ["qwen25-coder.jinja", "chatml-tiny.jinja"]:
        add(t, SIMPLE, True)
        add(t, NO_SYSTEM, False)
    add("qwen25-coder.jinja", NO_SYSTEM, True)
    add("qwen25-coder.jinja", TOOL_CONV, True, tools=TOOLS)
    for t in ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja"]:
        add(t, SIMPLE, True)
        add(t, SIMPLE, True, {"enable_thinking": False})
        add(t, SIMPLE, True, {"enable_thinking": True})
        add(t, REASONING, True, {"enable_thinking": False})
        add(t, TOOL_CONV, True, tools=TOOLS)
    add("meta-llama-Llama-3.1-8B-Instruct.jinja", SIMPLE, True, bos="<|begin_of_text|>", eos="<|eot_id|>")
    add("meta-llama-Llama-3.1-8B-Instruct.jinja", NO_SYSTEM, True, {"date_string": "26 Jul 2024"},
        bos="<|begin_of_text|>", eos="<|eot_id|>")
    out = os.path.join(fixture_dir, "chat_cases.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"about": "chat templates rendered by jinja2 with Hugging Face's settings "
                            "(tools/make_chat_fixture.py)", "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
