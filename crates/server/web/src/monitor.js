// The monitor page (`/monitor`): polls `/metrics.json` (the JSON twin of `/metrics`, with the
// loaded model's description and the server's one-second samples of its counters) and shows
// the model, requests in flight and queued, tokens/s over the sampled minutes as a live chart
// (uPlot), speculative acceptance per draft position, and the prefix cache.

import uPlot from 'uplot';
import { getJson } from './api.js';

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;

function bytes(n) {
  if (typeof n !== 'number') return '–';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${u[i]}`;
}

function count(n) {
  if (typeof n !== 'number') return '–';
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} M`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)} k`;
  return String(n);
}

/** Fills a <dl> with [term, value] rows (text only). */
function fillDl(dl, rows) {
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = v;
    dd.dataset.key = k;
    dl.append(dt, dd);
  }
}

function showModel(j) {
  const m = j.model;
  const mem = j.memory || {};
  if (!m) {
    fillDl($('model-info'), [['state', 'loading…']]);
    return;
  }
  fillDl($('model-info'), [
    ['id', m.id],
    ['file', m.file],
    ['architecture', m.arch],
    ['file size', bytes(m.file_bytes)],
    ['parameters', count(m.n_params)],
    ['context', `${m.n_ctx} per sequence × ${m.parallel} slots`],
    ['backend', m.backend],
    ['MTP head', m.mtp ? 'loaded' : 'none'],
    ['RAM (resident)', `${bytes(mem.rss_bytes)} (peak ${bytes(mem.rss_peak_bytes)})`],
    ['VRAM', mem.vram_bytes == null ? 'none (CPU backend)' : bytes(mem.vram_bytes)],
  ]);
  const tb = $('formats').querySelector('tbody');
  tb.replaceChildren();
  for (const f of m.formats || []) {
    const tr = document.createElement('tr');
    for (const v of [f.type, String(f.tensors), bytes(f.bytes)]) {
      const td = document.createElement('td');
      td.textContent = v;
      tr.append(td);
    }
    tb.append(tr);
  }
}

function num(metrics, name) {
  const v = metrics[name];
  return typeof v === 'number' ? v : 0;
}

function showCounters(j) {
  const x = j.metrics || {};
  fillDl($('requests'), [
    ['in flight', String(num(x, 'requests_processing'))],
    ['queued', String(num(x, 'requests_deferred'))],
    ['accepted (total)', String(num(x, 'requests_total'))],
    ['refused, queue full', String(num(x, 'requests_rejected_total'))],
    ['cancelled', String(num(x, 'requests_cancelled_total'))],
    ['prompt tokens', count(num(x, 'prompt_tokens_total'))],
    ['generated tokens', count(num(x, 'tokens_predicted_total'))],
    ['avg prompt tok/s', num(x, 'prompt_tokens_seconds').toFixed(1)],
    ['avg generation tok/s', num(x, 'predicted_tokens_seconds').toFixed(1)],
  ]);
  const budget = j.memory && j.memory.checkpoint_budget_bytes;
  fillDl($('cache'), [
    ['hits', String(num(x, 'prefix_cache_hits_total'))],
    ['tokens reused', count(num(x, 'prefix_cached_tokens_total'))],
    ['checkpoint restores', String(num(x, 'checkpoint_restores_total'))],
    ['checkpoint evictions', String(num(x, 'checkpoint_evictions_total'))],
    ['checkpoint memory', `${bytes(num(x, 'checkpoint_bytes'))} of ${bytes(budget)}`],
  ]);
  showSpec(j);
}

/**
 * Speculative counters per draft position: any metric with "draft" or "spec" in its name whose
 * samples carry a position label; drafted and accepted are told apart by "accept" in the name.
 */
function showSpec(j) {
  const box = $('spec');
  box.replaceChildren();
  const rows = new Map();
  for (const [name, v] of Object.entries(j.metrics || {})) {
    if (!Array.isArray(v) || !/draft|spec/.test(name)) continue;
    const kind = /accept/.test(name) ? 'accepted' : 'drafted';
    for (const s of v) {
      const l = s.labels || {};
      const pos = l.pos ?? l.position ?? l.draft_pos ?? l.i;
      if (pos === undefined) continue;
      const r = rows.get(pos) || { drafted: 0, accepted: 0 };
      r[kind] += s.value;
      rows.set(pos, r);
    }
  }
  const mtp = Boolean(j.model && j.model.mtp);
  if (!mtp || rows.size === 0) {
    const p = document.createElement('p');
    p.className = 'muted';
    p.textContent = mtp ? 'No drafts yet.' : 'No MTP head loaded: nothing is drafted (strata serve --mtp).';
    box.append(p);
    return;
  }
  const t = document.createElement('table');
  t.id = 'spec-table';
  const head = document.createElement('tr');
  for (const h of ['position', 'drafted', 'accepted', 'rate', '']) {
    const th = document.createElement('th');
    th.textContent = h;
    head.append(th);
  }
  t.append(head);
  const sorted = [...rows.entries()].sort((a, b) => Number(a[0]) - Number(b[0]));
  for (const [pos, r] of sorted) {
    const rate = r.drafted > 0 ? r.accepted / r.drafted : 0;
    const tr = document.createElement('tr');
    for (const v of [String(pos), String(r.drafted), String(r.accepted), `${(100 * rate).toFixed(0)}%`]) {
      const td = document.createElement('td');
      td.textContent = v;
      tr.append(td);
    }
    const bar = document.createElement('td');
    const fill = document.createElement('div');
    fill.className = 'bar';
    fill.style.width = `${Math.round(100 * rate)}%`;
    bar.append(fill);
    tr.append(bar);
    t.append(tr);
  }
  box.append(t);
}

// ---- the chart ----------------------------------------------------------------------------

let plot = null;

/** Rates from the one-second samples of the counters: [t, generation tok/s, prompt tok/s]. */
function rates(h) {
  const t = [];
  const gen = [];
  const pr = [];
  const n = h && Array.isArray(h.t) ? h.t.length : 0;
  for (let i = 1; i < n; i++) {
    const dt = h.t[i] - h.t[i - 1];
    if (!(dt > 0)) continue;
    t.push(h.t[i]);
    gen.push(Math.max(0, h.tokens_predicted_total[i] - h.tokens_predicted_total[i - 1]) / dt);
    pr.push(Math.max(0, h.prompt_tokens_total[i] - h.prompt_tokens_total[i - 1]) / dt);
  }
  return [t, gen, pr];
}

function chartWidth() {
  return Math.max(300, $('chart').clientWidth || 800);
}

function showChart(j) {
  const data = rates(j.history);
  const el = $('chart');
  el.dataset.points = String(data[0].length);
  el.dataset.max = String(Math.max(0, ...data[1], ...data[2]));
  const span = j.history && j.history.t && j.history.t.length
    ? `last ${Math.round((j.history.t[j.history.t.length - 1] - j.history.t[0]) / 60 * 10) / 10} min`
    : '';
  $('chart-span').textContent = span;
  if (!plot) {
    plot = new uPlot({
      width: chartWidth(),
      height: 260,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      axes: [{}, { label: 'tokens/s' }],
      series: [
        {},
        { label: 'generation', stroke: '#2f6fed', width: 2, fill: 'rgba(47,111,237,0.12)', points: { show: false } },
        { label: 'prompt', stroke: '#e07b00', width: 2, points: { show: false } },
      ],
    }, data, el);
    window.addEventListener('resize', () => plot.setSize({ width: chartWidth(), height: 260 }));
  } else {
    plot.setData(data);
  }
}

let reqPlot = null;

/** Requests in flight and queued at each sample. */
function showRequestChart(j) {
  const h = j.history || {};
  // From the second sample on, as the rate chart above starts there (rates need two).
  const from1 = (a) => (a || []).slice(1);
  const data = [from1(h.t), from1(h.requests_processing), from1(h.requests_deferred)];
  if (!reqPlot) {
    reqPlot = new uPlot({
      width: chartWidth(),
      height: 160,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi + 1)] } },
      axes: [{}, { label: 'requests' }],
      series: [
        {},
        { label: 'in flight', stroke: '#1d8a4a', width: 2, points: { show: false } },
        { label: 'queued', stroke: '#b3261e', width: 2, points: { show: false } },
      ],
    }, data, $('req-chart'));
    window.addEventListener('resize', () => reqPlot.setSize({ width: chartWidth(), height: 160 }));
  } else {
    reqPlot.setData(data);
  }
}

function notice(text) {
  const n = $('notice');
  n.textContent = text;
  n.className = text ? 'error' : '';
}

async function poll() {
  try {
    const j = await getJson('/metrics.json');
    $('status').textContent = j.ready ? 'serving' : 'loading';
    $('status').className = `pill ${j.ready ? 'ok' : 'warn'}`;
    notice('');
    showModel(j);
    showCounters(j);
    showChart(j);
    showRequestChart(j);
  } catch (e) {
    $('status').textContent = 'unreachable';
    $('status').className = 'pill bad';
    notice(`Could not read /metrics.json: ${e.message}`);
  }
  setTimeout(poll, POLL_MS);
}

poll();
