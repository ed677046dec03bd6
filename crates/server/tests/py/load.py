"""A bounded load run against a `strata serve` on this machine (a program run by hand, not a
test): N clients stream chat completions through the official openai SDK for T seconds, each
request checked to end with a finish reason; the server's RSS is read from /proc before and
after. Only loopback addresses are accepted.

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
    a = ap.parse_args()
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
                        model="m", stream=True, max_tokens=a.max_tokens,
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

    before = rss_kib(a.pid)
    t0 = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    mid = None
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        if mid is None and time.time() - t0 > a.seconds / 2:
            mid = rss_kib(a.pid)
    for t in threads:
        t.join()
    after = rss_kib(a.pid)
    wall = time.time() - t0
    print(f"clients {a.clients}, {wall:.0f} s: streams complete {stats['ok']}, incomplete "
          f"{stats['incomplete']}, errors {stats['errors']}, 429 {stats['rejected']}, "
          f"content chunks {stats['tokens']} ({stats['tokens'] / wall:.1f}/s); "
          f"RSS KiB before {before}, midway {mid}, after {after}")


if __name__ == "__main__":
    main()
