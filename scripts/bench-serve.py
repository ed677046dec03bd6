#!/usr/bin/env python3
"""Throughput of `strata serve` under concurrent streams (issue 15 §4), through the official
openai SDK: for each stream count N, starts `strata serve --parallel N` (every stream has a
slot, as llama-server's `-np N`), sends N completion streams at once (different prompts, greedy,
`max_tokens` each), and reports the aggregate generated tokens/s (all streams' completion
tokens over the wall time from the first request to the last stream's end), the time to first
token per stream (p50 / max) and the inter-token gaps over all streams (p50 / p99). Not a test:
results go in docs/PERF.md with the prediction written before the run.

    PYTHONPATH=~/.cache/strata/pyclients scripts/bench-serve.py --streams 1,4,16,64
    scripts/bench-serve.py --model fixtures/qwen4exp/tiny/model-f32.gguf --streams 1,4

Needs target/release/strata (cargo build --release -p strata-cli) and the openai SDK that
scripts/test installs into ~/.cache/strata/pyclients.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

try:
    import openai
except ImportError:
    sys.exit("bench-serve: the openai SDK is missing (PYTHONPATH=~/.cache/strata/pyclients)")

PROMPTS = [
    "def quicksort(items):",
    "Write a short story about a lighthouse keeper.",
    "SELECT customers.name, SUM(orders.total) FROM",
    "// A binary search tree in C\nstruct node {",
    "Explain how a hash map works.",
    "import numpy as np\n\ndef softmax(x):",
    "fn parse_args() -> Result<Args, String> {",
    "The history of the printing press begins",
]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def one_stream(client, i, max_tokens, out):
    t0 = time.perf_counter()
    times = []
    usage = None
    stream = client.completions.create(
        model="m",
        prompt=PROMPTS[i % len(PROMPTS)] + (" " * (i // len(PROMPTS))),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    out[i] = {
        "start": t0,
        "times": times,
        "tokens": usage.completion_tokens if usage else len(times),
    }


def run_level(args, n):
    port = free_port()
    cmd = [args.bin, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(n), "--queue", str(max(64, n)), "-t", str(args.threads)]
    if args.model != "default":
        cmd += ["-m", args.model]
    cmd += args.serve_args
    log = open(f"/tmp/bench-serve-{port}.log", "w")
    srv = subprocess.Popen(cmd, stderr=log, stdout=log, env={**os.environ, "STRATA_LOG": "warn"})
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                if srv.poll() is not None:
                    sys.exit(f"bench-serve: the server exited; see {log.name}")
                time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=3600, max_retries=0)
        # One warm-up request (page the weights in).
        one_stream(client, 0, 4, {})
        out = {}
        t0 = time.perf_counter()
        ths = [threading.Thread(target=one_stream, args=(client, i, args.max_tokens, out))
               for i in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        srv.terminate()
        srv.wait()
    if len(out) != n:
        sys.exit(f"bench-serve: {n - len(out)} of {n} streams failed")
    tokens = sum(o["tokens"] for o in out.values())
    ttft = [o["times"][0] - o["start"] for o in out.values() if o["times"]]
    gaps = [b - a for o in out.values() for a, b in zip(o["times"], o["times"][1:])]
    most = next((l.split()[1] for l in metrics.splitlines()
                 if l.startswith("strata:batch_sequences_max ")), "?")
    return {
        "streams": n,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tps": round(tokens / wall, 2),
        "ttft_p50_s": round(pct(ttft, 50), 3),
        "ttft_max_s": round(max(ttft), 3),
        "itl_p50_ms": round(1000 * pct(gaps, 50), 1),
        "itl_p99_ms": round(1000 * pct(gaps, 99), 1),
        "batch_sequences_max": most,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/strata")
    ap.add_argument("--model", default="default")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("serve_args", nargs="*", help="more `strata serve` arguments (after --)")
    args = ap.parse_args()
    for n in [int(x) for x in args.streams.split(",")]:
        print(json.dumps(run_level(args, n)), flush=True)


if __name__ == "__main__":
    main()
