// The page's one way to the server: fetch with the API key (asked for when the server answers
// 401, kept in this browser's localStorage), and a reader for OpenAI-style server-sent events.

const KEY = 'strata.apiKey';

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(extra) {
  const h = { ...extra };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** The server's error message from an error response (OpenAI or Anthropic shape), else its text. */
async function errorText(resp) {
  const text = await resp.text();
  try {
    const j = JSON.parse(text);
    if (j && j.error && typeof j.error.message === 'string') return j.error.message;
  } catch (_) {
    /* not JSON */
  }
  return text || resp.statusText;
}

let asking = null;

/** Shows the key dialog (once, however many requests wait for it); resolves when a key is saved. */
export function askForKey(reason) {
  if (asking) return asking;
  const dlg = document.getElementById('key-dialog');
  const input = document.getElementById('key-input');
  const msg = document.getElementById('key-reason');
  msg.textContent = reason || 'This server needs an API key.';
  input.value = '';
  asking = new Promise((resolve, reject) => {
    const form = dlg.querySelector('form');
    let saved = false;
    form.onsubmit = (e) => {
      e.preventDefault();
      const k = input.value.trim();
      if (!k) return;
      localStorage.setItem(KEY, k);
      saved = true;
      dlg.close();
    };
    // Closed with a key, or dismissed (Escape): the waiting request goes on or fails.
    dlg.onclose = () => {
      asking = null;
      if (saved) resolve();
      else reject(new ApiError(401, 'no API key given'));
    };
    dlg.showModal();
    input.focus();
  });
  return asking;
}

export function forgetKey() {
  localStorage.removeItem(KEY);
}

/**
 * fetch(path) with the key; a 401 asks for a key and retries (until one works or the dialog is
 * left open). Other non-2xx answers throw an ApiError with the server's message.
 */
export async function call(path, opts = {}) {
  for (;;) {
    const resp = await fetch(path, { ...opts, headers: headers(opts.headers) });
    if (resp.status === 401) {
      const why = await errorText(resp);
      await askForKey(`The server refused the key: ${why}`);
      continue;
    }
    if (!resp.ok) throw new ApiError(resp.status, `${resp.status}: ${await errorText(resp)}`);
    return resp;
  }
}

export async function getJson(path) {
  return (await call(path)).json();
}

/**
 * Reads a text/event-stream body and calls onData with each `data:` payload parsed as JSON
 * (`[DONE]` ends it). Events are split on blank lines as the SSE format says; a payload that
 * is not JSON is an error, not skipped.
 */
export async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let m;
    while ((m = /\r?\n\r?\n/.exec(buf)) !== null) {
      const block = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      const data = block
        .split(/\r?\n/)
        .filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).replace(/^ /, ''))
        .join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      let v;
      try {
        v = JSON.parse(data);
      } catch (_) {
        throw new Error(`the server sent an event that is not JSON: ${data.slice(0, 200)}`);
      }
      onData(v);
    }
  }
}
