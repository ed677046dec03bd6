"""A bounded load run against a `strata serve` on this machine (a program run by hand, not a
test; `scripts/soak` starts a server and runs it): N clients stream chat completions through
the official openai SDK for T seconds, each request checked to end with a finish reason; the
server's RSS is sampled from /proc every --rss-every seconds. Exits 1 when a stream failed or
ended without a finish reason, or when RSS grew after the warm-up (the first fifth of the run)
by more than --rss-slack-mib. Only loopback addresses are accepted.

  PYTHONPATH=~/.cache/strata/pyclients python3 crates/server/tests/py/load.py \
      --url http://127.0.0.1:8080 --pid PID --clients 100 --seconds 600 --max-tokens 32
"""

import argparse
import threading
import time
import urllib.parse

import openai


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rss-every", type=float, default=10)
    ap.add_argument("--rss-slack-mib", type=float, default=16)
    ap.add_argument("--extra", default="{}", help="JSON merged into each request (extra_body)")
    a = ap.parse_args()
    import json
    extra = json.loads(a.extra)
    host = urllib.parse.urlparse(a.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load.py only targets this machine (127.0.0.1, localhost, ::1)")
    a.seconds = min(a.seconds, 900)

    stats = {"ok": 0, "incomplete": 0, "errors": 0, "tokens": 0, "rejected": 0}
    lock = threading.Lock()
    deadline = time.time() + a.seconds

    def client(i):
        c = openai.OpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0, timeout=600)
        n = 0
        while time.time() < deadline:
            n += 1
            try:
                finish, toks = None, 0
                for ch in c.chat.completions.create(
                        model="m", stream=True, max_tokens=a.max_tokens, extra_body=extra,
                        messages=[{"role": "user", "content": f"Client {i}, request {n}: say something."}]):
                    if ch.choices:
                        toks += 1 if ch.choices[0].delta.content else 0
                        finish = ch.choices[0].finish_reason or finish
                with lock:
                    stats["ok" if finish else "incomplete"] += 1
                    stats["tokens"] += toks
            except openai.RateLimitError:
                with lock:
                    stats["rejected"] += 1
                time.sleep(0.5)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    stats["errors"] += 1
                print(f"client {i}: {type(e).__name__}: {e}")

    samples = [(0.0, rss_kib(a.pid))]
    t0 = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    next_sample = a.rss_every
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.time() - t0 >= next_sample:
            samples.append((time.time() - t0, rss_kib(a.pid)))
            next_sample += a.rss_every
    for t in threads:
        t.join()
    wall = time.time() - t0
    samples.append((wall, rss_kib(a.pid)))
    warm = [kib for (t, kib) in samples if t >= a.seconds / 5]
    base = warm[0] if warm else samples[-1][1]
    peak = max(kib for (_, kib) in samples)
    growth_mib = (max(warm) - base) / 1024 if warm else 0.0
    print("RSS samples (s, MiB): " + ", ".join(f"{t:.0f}:{kib / 1024:.1f}" for t, kib in samples))
    print(f"clients {a.clients}, {wall:.0f} s: streams complete {stats['ok']}, incomplete "
          f"{stats['incomplete']}, errors {stats['errors']}, 429 {stats['rejected']}, "
          f"content chunks {stats['tokens']} ({stats['tokens'] / wall:.1f}/s); "
          f"RSS MiB start {samples[0][1] / 1024:.1f}, after warm-up {base / 1024:.1f}, "
          f"peak {peak / 1024:.1f}, end {samples[-1][1] / 1024:.1f}; "
          f"growth after warm-up {growth_mib:.1f} MiB")
    bad = stats["errors"] or stats["incomplete"] or stats["ok"] == 0
    leak = growth_mib > a.rss_slack_mib
    print("verdict: " + ("FAIL" if bad or leak else "ok")
          + (" (failed or incomplete streams)" if bad else "")
          + (f" (RSS grew {growth_mib:.1f} MiB > {a.rss_slack_mib} after warm-up)" if leak else ""))
    raise SystemExit(1 if bad or leak else 0)


if __name__ == "__main__":
    main()
