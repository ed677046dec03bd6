// The chat page (`/`): conversations with the served model through its own OpenAI-style API
// (`/v1/chat/completions`, streamed), kept in this browser. Owns the page's state (which
// conversation is open, the generation in flight) and its DOM; storage is store.js, the wire
// is api.js, turning model output into DOM is render.js.

import { call, getJson, readEvents, askForKey, forgetKey, ApiError } from './api.js';
import { renderMarkdown, copyText } from './render.js';
import {
  DEFAULT_SETTINGS, exportJson, loadConversations, loadSettings, newId, parseImport,
  saveConversations, saveSettings,
} from './store.js';

const $ = (id) => document.getElementById(id);

const state = {
  convs: loadConversations(),
  current: localStorage.getItem('strata.current'),
  settings: loadSettings(),
  model: null,
  /** The generation in flight: its AbortController and the message it writes. */
  busy: null,
  editing: -1,
};

function conv() {
  return state.convs.find((c) => c.id === state.current) || null;
}

function notice(text, kind = 'error') {
  const n = $('notice');
  n.textContent = text;
  n.className = text ? kind : '';
}

function persist() {
  try {
    saveConversations(state.convs);
    localStorage.setItem('strata.current', state.current || '');
  } catch (e) {
    notice(`Could not save the conversations in this browser (${e.message}); export them to keep them.`);
  }
}

// ---- conversation list --------------------------------------------------------------------

function titleOf(c) {
  if (c.title) return c.title;
  const first = c.messages.find((m) => m.role === 'user');
  return first ? first.content.slice(0, 60) : 'New chat';
}

function renderList() {
  const ul = $('conv-list');
  ul.replaceChildren();
  const sorted = [...state.convs].sort((a, b) => (b.updated || b.created) - (a.updated || a.created));
  for (const c of sorted) {
    const li = document.createElement('li');
    li.dataset.id = c.id;
    if (c.id === state.current) li.className = 'active';
    const open = document.createElement('button');
    open.type = 'button';
    open.className = 'conv-open';
    open.textContent = titleOf(c);
    open.title = open.textContent;
    open.addEventListener('click', () => {
      if (state.busy) return;
      state.current = c.id;
      state.editing = -1;
      persist();
      renderAll();
    });
    const del = document.createElement('button');
    del.type = 'button';
    del.className = 'conv-del';
    del.textContent = '×';
    del.title = 'Delete this conversation';
    del.addEventListener('click', () => {
      if (state.busy && c.id === state.current) return;
      if (!confirm(`Delete "${titleOf(c)}"?`)) return;
      state.convs = state.convs.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = null;
      persist();
      renderAll();
    });
    li.append(open, del);
    ul.append(li);
  }
}

function newConversation() {
  const c = { id: newId(), title: '', created: Date.now(), updated: Date.now(), messages: [] };
  state.convs.push(c);
  state.current = c.id;
  return c;
}

// ---- messages -----------------------------------------------------------------------------

function button(label, cls, onClick) {
  const b = document.createElement('button');
  b.type = 'button';
  b.className = cls;
  b.textContent = label;
  b.addEventListener('click', onClick);
  return b;
}

function fmtRate(n, ms) {
  return ms > 0 && n > 0 ? `${(n / (ms / 1000)).toFixed(1)} tok/s` : '–';
}

/** The line under a reply: tokens, prompt and generation speed, cached tokens, MTP acceptance. */
function statsText(m) {
  const parts = [];
  const u = m.usage;
  const t = m.timings;
  if (u) {
    parts.push(`${u.completion_tokens} tokens`);
    const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`prompt ${u.prompt_tokens} (${cached} cached)`);
  } else if (m.chunks) {
    parts.push(`${m.chunks} chunks`);
  }
  if (t) {
    parts.push(`prompt ${fmtRate(t.prompt_n, t.prompt_ms)}`);
    parts.push(`generation ${fmtRate(t.predicted_n, t.predicted_ms)}`);
  }
  if (u) parts.push(mtpText(u.speculative));
  if (m.finish) parts.push(`finish: ${m.finish}`);
  if (m.stopped) parts.push('stopped');
  return parts.join(' · ');
}

/**
 * The server's `usage.speculative` ({window, passes, drafted: [per draft position],
 * accepted: [...]}) as "MTP 6/8 accepted (75%; by position 3/3 2/3 1/2)".
 */
function mtpText(sp) {
  if (!sp || !(sp.window > 1) || !Array.isArray(sp.drafted)) return 'MTP off';
  const acc = Array.isArray(sp.accepted) ? sp.accepted : [];
  const d = sp.drafted.reduce((a, b) => a + b, 0);
  const a = acc.reduce((x, y) => x + y, 0);
  const pct = d > 0 ? ((100 * a) / d).toFixed(0) : '0';
  const by = sp.drafted.map((n, i) => `${acc[i] || 0}/${n}`).join(' ');
  return `MTP ${a}/${d} accepted (${pct}%; by position ${by})`;
}

function renderMessage(m, i, c) {
  const div = document.createElement('div');
  div.className = `msg ${m.role}`;
  div.dataset.index = String(i);
  const role = document.createElement('div');
  role.className = 'role';
  role.textContent = m.role === 'user' ? 'You' : m.role === 'assistant' ? (state.model || 'Assistant') : m.role;
  div.append(role);
  if (m.role === 'user' && state.editing === i) {
    const ta = document.createElement('textarea');
    ta.className = 'edit-box';
    ta.value = m.content;
    ta.rows = Math.min(12, m.content.split('\n').length + 1);
    const bar = document.createElement('div');
    bar.className = 'actions';
    bar.append(
      button('Send', 'edit-send', () => resendEdited(c, i, ta.value)),
      button('Cancel', 'edit-cancel', () => { state.editing = -1; renderMessages(); }),
    );
    div.append(ta, bar);
    return div;
  }
  if (m.role === 'assistant' && (m.reasoning || '').length > 0) {
    const det = document.createElement('details');
    det.className = 'reasoning';
    // Open while it streams, folded once the answer has started.
    det.open = state.busy && state.busy.msg === m && !m.content;
    const sum = document.createElement('summary');
    sum.textContent = 'Reasoning';
    const body = document.createElement('div');
    body.className = 'reasoning-body md';
    renderMarkdown(body, m.reasoning);
    det.append(sum, body);
    div.append(det);
  }
  const body = document.createElement('div');
  if (m.role === 'user' || m.role === 'system') {
    body.className = 'content plain';
    body.textContent = m.content;
  } else {
    body.className = 'content md';
    renderMarkdown(body, m.content, { highlight: !(state.busy && state.busy.msg === m) });
  }
  div.append(body);
  if (m.error) {
    const e = document.createElement('div');
    e.className = 'msg-error';
    e.textContent = m.error;
    div.append(e);
  }
  if (m.role === 'assistant') {
    const st = document.createElement('div');
    st.className = 'stats';
    st.textContent = statsText(m);
    div.append(st);
  }
  const live = state.busy && state.busy.msg === m;
  if (!live && !state.busy) {
    const bar = document.createElement('div');
    bar.className = 'actions';
    if (m.role === 'user') {
      bar.append(button('Edit', 'edit', () => { state.editing = i; renderMessages(); }));
    } else if (m.role === 'assistant') {
      bar.append(button('Copy', 'copy-msg', (e) => copyText(m.content, e.target)));
      if (i === c.messages.length - 1) bar.append(button('Regenerate', 'regen', () => regenerate(c)));
    }
    div.append(bar);
  }
  return div;
}

function renderMessages() {
  const box = $('messages');
  const c = conv();
  box.replaceChildren();
  if (!c || c.messages.length === 0) {
    const e = document.createElement('div');
    e.className = 'empty';
    e.textContent = state.model ? `Chat with ${state.model}.` : 'Chat with the model.';
    box.append(e);
    return;
  }
  c.messages.forEach((m, i) => box.append(renderMessage(m, i, c)));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderList();
  renderMessages();
  const busy = Boolean(state.busy);
  $('send').disabled = busy;
  $('stop').hidden = !busy;
  $('send').hidden = busy;
}

/** Re-renders only the reply being streamed, at most once a frame. */
let frame = 0;
function renderLive() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const b = state.busy;
    const c = conv();
    if (!b || !c) return;
    const i = c.messages.indexOf(b.msg);
    const old = $('messages').querySelector(`.msg[data-index="${i}"]`);
    if (!old) return renderMessages();
    const box = $('messages');
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    old.replaceWith(renderMessage(b.msg, i, c));
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
}

// ---- generation ---------------------------------------------------------------------------

/** The request body for the conversation's messages so far (the last one the user's). */
function requestBody(messages) {
  const s = state.settings;
  const msgs = [];
  if (s.system.trim()) msgs.push({ role: 'system', content: s.system });
  for (const m of messages) {
    // A reply that failed before any text is not part of the conversation.
    if (m.role === 'assistant' && !m.content) continue;
    msgs.push({ role: m.role, content: m.content });
  }
  const body = {
    model: state.model || 'strata',
    messages: msgs,
    stream: true,
    stream_options: { include_usage: true },
    temperature: s.temperature,
    top_p: s.top_p,
  };
  if (s.max_tokens > 0) body.max_tokens = s.max_tokens;
  if (s.seed !== '') body.seed = Number(s.seed);
  const phrases = s.slop_phrases.split('\n').map((p) => p.trim()).filter(Boolean);
  if (s.slop_mode !== 0 || phrases.length) body.slop_mode = s.slop_mode;
  if (phrases.length) body.slop_phrases = phrases;
  // The MTP verify window (the server's `spec`, 1 = plain decoding); 0 leaves it to the
  // server's `--spec`.
  if (s.mtp_window > 0) body.spec = s.mtp_window;
  return body;
}

async function generate(c) {
  const msg = { role: 'assistant', content: '', reasoning: '', chunks: 0 };
  c.messages.push(msg);
  c.updated = Date.now();
  const ctrl = new AbortController();
  state.busy = { ctrl, msg };
  notice('');
  persist();
  renderAll();
  try {
    const resp = await call('/v1/chat/completions', {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(requestBody(c.messages.slice(0, -1))),
      signal: ctrl.signal,
    });
    await readEvents(resp, (ev) => {
      if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
      if (ev.usage) msg.usage = ev.usage;
      if (ev.timings) msg.timings = ev.timings;
      const ch = ev.choices && ev.choices[0];
      if (!ch) return;
      const d = ch.delta || {};
      if (typeof d.content === 'string' && d.content) msg.content += d.content;
      const r = d.reasoning_content ?? d.reasoning;
      if (typeof r === 'string' && r) msg.reasoning += r;
      if (ch.finish_reason) msg.finish = ch.finish_reason;
      msg.chunks += 1;
      // Kept now and then while it streams, so a reload mid-reply loses little.
      if (msg.chunks % 32 === 0) persist();
      renderLive();
    });
  } catch (e) {
    if (e.name === 'AbortError') msg.stopped = true;
    else msg.error = e instanceof ApiError ? e.message : `Error: ${e.message}`;
  } finally {
    state.busy = null;
    c.updated = Date.now();
    persist();
    renderAll();
  }
}

function stop() {
  if (state.busy) state.busy.ctrl.abort();
}

async function send() {
  const ta = $('prompt');
  const text = ta.value;
  if (!text.trim() || state.busy) return;
  const c = conv() || newConversation();
  c.messages.push({ role: 'user', content: text });
  ta.value = '';
  await generate(c);
}

async function regenerate(c) {
  if (state.busy) return;
  if (c.messages.length && c.messages[c.messages.length - 1].role === 'assistant') c.messages.pop();
  if (!c.messages.length || c.messages[c.messages.length - 1].role !== 'user') return;
  await generate(c);
}

/** Replaces message i with the edited text, drops everything after it, and asks again. */
async function resendEdited(c, i, text) {
  if (state.busy || !text.trim()) return;
  c.messages = c.messages.slice(0, i);
  c.messages.push({ role: 'user', content: text });
  state.editing = -1;
  await generate(c);
}

// ---- settings -----------------------------------------------------------------------------

const NUMERIC = {
  temperature: [0, 100, false],
  top_p: [0, 1, false],
  max_tokens: [0, 1e9, true],
  slop_mode: [0, 2, true],
  mtp_window: [0, 8, true],
};

function openSettings() {
  const f = $('settings-form');
  for (const [k, v] of Object.entries(state.settings)) {
    if (f.elements[k]) f.elements[k].value = String(v);
  }
  $('settings-error').textContent = '';
  $('settings-dialog').showModal();
}

function saveSettingsForm(e) {
  e.preventDefault();
  const f = $('settings-form');
  const next = { ...state.settings };
  for (const k of Object.keys(DEFAULT_SETTINGS)) {
    const raw = f.elements[k].value;
    if (k === 'seed') {
      const v = Number(raw);
      if (raw.trim() !== '' && !(Number.isInteger(v) && v >= 0 && v <= Number.MAX_SAFE_INTEGER)) {
        $('settings-error').textContent = `seed: expected empty (random) or a whole number >= 0, got "${raw}"`;
        return;
      }
      next[k] = raw.trim();
    } else if (k in NUMERIC) {
      const [lo, hi, int] = NUMERIC[k];
      const v = Number(raw);
      if (raw.trim() === '' || !Number.isFinite(v) || v < lo || v > hi || (int && !Number.isInteger(v))) {
        $('settings-error').textContent = `${k}: expected ${int ? 'an integer' : 'a number'} in ${lo}..${hi}, got "${raw}"`;
        return;
      }
      next[k] = v;
    } else {
      next[k] = raw;
    }
  }
  state.settings = next;
  saveSettings(next);
  $('settings-dialog').close();
}

// ---- export / import ----------------------------------------------------------------------

function exportAll() {
  const blob = new Blob([exportJson(state.convs)], { type: 'application/json' });
  const a = document.createElement('a');
  a.href = URL.createObjectURL(blob);
  a.download = `strata-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  try {
    const got = parseImport(await file.text(), state.convs);
    state.convs.push(...got);
    persist();
    renderAll();
    notice(`Imported ${got.length} conversation${got.length === 1 ? '' : 's'}.`, 'info');
  } catch (e) {
    notice(`Import of ${file.name} failed, nothing imported: ${e.message}`);
  }
}

// ---- start --------------------------------------------------------------------------------

async function loadModel() {
  try {
    const j = await getJson('/v1/models');
    state.model = (j.data && j.data[0] && j.data[0].id) || null;
    $('model-name').textContent = state.model || '';
    document.title = state.model ? `${state.model} · strata` : 'strata';
  } catch (e) {
    notice(e.status === 503 ? 'The model is loading…' : `Could not reach the server: ${e.message}`, e.status === 503 ? 'info' : 'error');
    if (e.status === 503) setTimeout(loadModel, 1000);
  }
  renderMessages();
}

function start() {
  $('composer').addEventListener('submit', (e) => { e.preventDefault(); send(); });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $('stop').addEventListener('click', stop);
  $('new-chat').addEventListener('click', () => {
    if (state.busy) return;
    state.current = null;
    state.editing = -1;
    persist();
    renderAll();
    $('prompt').focus();
  });
  $('export').addEventListener('click', exportAll);
  $('import').addEventListener('change', (e) => {
    const f = e.target.files && e.target.files[0];
    if (f) importFile(f);
    e.target.value = '';
  });
  $('open-settings').addEventListener('click', openSettings);
  $('settings-form').addEventListener('submit', saveSettingsForm);
  $('settings-cancel').addEventListener('click', () => $('settings-dialog').close());
  $('settings-reset').addEventListener('click', () => {
    const f = $('settings-form');
    for (const [k, v] of Object.entries(DEFAULT_SETTINGS)) f.elements[k].value = String(v);
  });
  $('change-key').addEventListener('click', () => {
    forgetKey();
    askForKey('Enter the API key for this server.').then(loadModel, () => {});
  });
  renderAll();
  loadModel();
}

start();
