// Model output to DOM: markdown (marked) through a sanitizer (DOMPurify) — the text is
// untrusted, so no script, no event handlers, no javascript: links, no remote images (the
// server's Content-Security-Policy blocks those too) — then code blocks highlighted
// (highlight.js, from the text alone) and given copy buttons built as DOM nodes.

import { Marked } from 'marked';
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import markdown from 'highlight.js/lib/languages/markdown';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';

const langs = {
  bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql,
  typescript, xml, yaml,
};
for (const [name, def] of Object.entries(langs)) hljs.registerLanguage(name, def);

const marked = new Marked({ gfm: true, breaks: false });

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A' && node.hasAttribute('href')) {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
  // Only images the page itself may load (data: URLs); a remote image in model output could
  // carry the conversation away in its URL.
  if (node.tagName === 'IMG') {
    const src = node.getAttribute('src') || '';
    if (!src.startsWith('data:image/')) node.removeAttribute('src');
  }
});

const PURIFY = {
  FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select', 'iframe', 'object', 'embed'],
  FORBID_ATTR: ['style'],
  ALLOW_DATA_ATTR: false,
};

/** Markdown text → sanitized HTML string. */
export function toSafeHtml(text) {
  const html = marked.parse(text || '', { async: false });
  return DOMPurify.sanitize(html, PURIFY);
}

/**
 * Renders `text` into `el` (replacing what it held). `highlight: false` while a reply streams:
 * it is re-rendered every frame, and guessing a block's language each time would be slow.
 */
export function renderMarkdown(el, text, { highlight = true } = {}) {
  el.innerHTML = toSafeHtml(text);
  for (const code of el.querySelectorAll('pre > code')) decorateCode(code, highlight);
}

function decorateCode(code, highlight) {
  const m = /(?:^|\s)language-([\w+-]+)/.exec(code.className);
  const lang = m && hljs.getLanguage(m[1]) ? m[1] : null;
  const text = code.textContent;
  let out = { value: null, language: null };
  if (highlight) {
    // highlight.js builds its HTML from the text alone, escaping it.
    out = lang ? hljs.highlight(text, { language: lang, ignoreIllegals: true })
      : hljs.highlightAuto(text);
    code.innerHTML = out.value;
  }
  code.classList.add('hljs');
  const pre = code.parentElement;
  const bar = document.createElement('div');
  bar.className = 'code-bar';
  const label = document.createElement('span');
  label.textContent = lang || out.language || 'text';
  const btn = document.createElement('button');
  btn.type = 'button';
  btn.className = 'copy';
  btn.textContent = 'Copy';
  btn.addEventListener('click', () => copyText(text, btn));
  bar.append(label, btn);
  pre.before(bar);
}

/** Copies to the clipboard (falls back to a hidden textarea where the Clipboard API is off). */
export async function copyText(text, btn) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch (_) {
    const ta = document.createElement('textarea');
    ta.value = text;
    ta.setAttribute('readonly', '');
    ta.style.position = 'fixed';
    ta.style.opacity = '0';
    document.body.append(ta);
    ta.select();
    ok = document.execCommand('copy');
    ta.remove();
  }
  if (btn) {
    const was = btn.textContent;
    btn.textContent = ok ? 'Copied' : 'Copy failed';
    setTimeout(() => { btn.textContent = was; }, 1200);
  }
}
