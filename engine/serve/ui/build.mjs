// Builds the console into dist/: one bundle (app.js) and one stylesheet (app.css, with xterm's and uPlot's),
// plus index.html. No inline script anywhere: the server's Content-Security-Policy allows scripts from /ui/ only.
import { build } from 'esbuild'
import { copyFileSync, mkdirSync, rmSync } from 'node:fs'

rmSync('dist', { recursive: true, force: true })
mkdirSync('dist')
await build({
  entryPoints: { app: 'src/main.ts' },
  bundle: true,
  minify: true,
  sourcemap: false,
  format: 'iife',
  target: 'es2022',
  outdir: 'dist',
  loader: { '.css': 'css' },
  logLevel: 'warning',
})
copyFileSync('static/index.html', 'dist/index.html')
console.log('console built into dist/')
