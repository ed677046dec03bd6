// Builds dist/ from src/: the chat page (/) and the monitor page (/monitor), each one HTML file,
// one JS bundle and the shared CSS, nothing fetched from elsewhere at run time. dist/ is
// committed and embedded in the server binary (crates/server/src/web.rs), so neither users nor
// CI need Node; run this (`npm ci && npm run build`, or scripts/build-web) after editing src/.
// dist/SOURCES.sha256 records what it was built from; a Rust test (web_bundle_is_current)
// fails when src/ or the pinned packages changed without a rebuild.
import * as esbuild from 'esbuild';
import { createHash } from 'node:crypto';
import { copyFileSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';

rmSync('dist', { recursive: true, force: true });
mkdirSync('dist');
await esbuild.build({
  entryPoints: { chat: 'src/chat.js', monitor: 'src/monitor.js', style: 'src/style.css' },
  bundle: true,
  minify: true,
  format: 'iife',
  target: 'es2020',
  outdir: 'dist',
  charset: 'utf8',
  legalComments: 'eof',
  logLevel: 'warning',
});
for (const f of ['index.html', 'monitor.html']) copyFileSync(`src/${f}`, `dist/${f}`);

// The stamp: sha256 of every source file and of the lock file, one "HASH  PATH" line each, in
// name order (the Rust test computes the same lines).
const inputs = [
  ...readdirSync('src').sort().map((f) => `src/${f}`),
  'package.json',
  'package-lock.json',
];
const lines = inputs.map((p) => {
  const h = createHash('sha256').update(readFileSync(p)).digest('hex');
  return `${h}  ${p}\n`;
});
writeFileSync('dist/SOURCES.sha256', lines.join(''));
