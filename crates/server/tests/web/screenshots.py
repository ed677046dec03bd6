"""Screenshots of the chat page and the monitor for docs/img/, taken by hand against a running
`strata serve` (the default model makes a readable page; the tiny fixture writes noise):

    strata serve --port 18080 &
    PYTHONPATH=~/.cache/strata/playwright python3 crates/server/tests/web/screenshots.py \
        http://127.0.0.1:18080 docs/img

Not collected by pytest (no test_ prefix): it asserts nothing beyond the reply arriving.
"""

import os
import sys

from playwright.sync_api import expect, sync_playwright

QUESTION = ("Write a Python function that checks whether a string is a palindrome, "
            "ignoring case and punctuation. Keep the explanation short.")


def main(url, out):
    chromium = os.environ.get("STRATA_CHROMIUM", "/usr/bin/chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1280, "height": 1180})
        page.goto(url + "/")
        page.click("#open-settings")
        page.fill("#settings-form [name=temperature]", "0")
        page.fill("#settings-form [name=max_tokens]", "400")
        page.click("#settings-form button[type=submit]")
        page.fill("#prompt", QUESTION)
        page.click("#send")
        expect(page.locator("#send")).to_be_visible(timeout=600_000)
        page.wait_for_timeout(500)
        page.screenshot(path=os.path.join(out, "web-chat.png"))
        page.goto(url + "/monitor")
        page.wait_for_function("Number(document.getElementById('chart').dataset.max) > 0", timeout=30_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=os.path.join(out, "web-monitor.png"), full_page=True)
        b.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
