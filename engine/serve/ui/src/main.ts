// The console of `strata serve`: a client of the same API, with the same keys. The key is asked once and kept
// in the browser's session storage; WebSockets (which cannot send headers) carry it as the subprotocol
// `strata.key.BASE64URL`, beside `strata`, which the server selects. Never in a URL.

import '@xterm/xterm/css/xterm.css'
import 'uplot/dist/uPlot.min.css'
import './style.css'
import { Terminal } from '@xterm/xterm'
import { FitAddon } from '@xterm/addon-fit'
import uPlot from 'uplot'

const KEY = 'strata.key'
const POLL_MS = 2000

// ---- the API --------------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(readonly status: number, readonly code: string, message: string) {
    super(message)
  }
}

function key(): string | null {
  return sessionStorage.getItem(KEY)
}

async function api<T = any>(method: string, path: string, body?: unknown): Promise<T> {
  const headers: Record<string, string> = {}
  const k = key()
  if (k) headers['Authorization'] = `Bearer ${k}`
  let payload: BodyInit | undefined
  if (body instanceof Blob || body instanceof ArrayBuffer) {
    payload = body
    headers['Content-Type'] = 'application/octet-stream'
  } else if (body !== undefined) {
    payload = JSON.stringify(body)
    headers['Content-Type'] = 'application/json'
  }
  const response = await fetch(path, { method, headers, body: payload })
  if (!response.ok) {
    const error = await response.json().catch(() => null)
    const code = error?.error?.code ?? String(response.status)
    if (response.status === 401) keyState(false)
    throw new ApiError(response.status, code, error?.error?.message ?? response.statusText)
  }
  if (response.status === 204) return null as T
  const type = response.headers.get('content-type') ?? ''
  return (type.includes('json') ? response.json() : response.text()) as Promise<T>
}

function socket(path: string): WebSocket {
  const scheme = location.protocol === 'https:' ? 'wss:' : 'ws:'
  const protocols = ['strata']
  const k = key()
  if (k) {
    const bytes = new TextEncoder().encode(k)
    const encoded = btoa(String.fromCharCode(...bytes)).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '')
    protocols.push(`strata.key.${encoded}`)
  }
  const ws = new WebSocket(`${scheme}//${location.host}${path}`, protocols)
  ws.binaryType = 'arraybuffer'
  return ws
}

// ---- small helpers --------------------------------------------------------------------------------------------

type Child = Node | string | null | undefined | false
function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: Partial<Record<string, string>> = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag)
  for (const [name, value] of Object.entries(props)) {
    if (value !== undefined) node.setAttribute(name, value)
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue
    node.append(typeof child === 'string' ? document.createTextNode(child) : child)
  }
  return node
}

function button(label: string, onClick: () => unknown, props: Record<string, string> = {}): HTMLButtonElement {
  const b = el('button', { type: 'button', ...props }, label)
  b.addEventListener('click', async () => {
    b.disabled = true
    try {
      await onClick()
    } catch (e) {
      toast(e instanceof Error ? e.message : String(e), true)
    } finally {
      b.disabled = false
    }
  })
  return b
}

function toast(text: string, bad = false): void {
  const t = document.getElementById('toast')!
  t.textContent = text
  t.className = bad ? 'show bad' : 'show'
  window.setTimeout(() => (t.className = ''), 4000)
}

function bytes(n: number | undefined): string {
  if (n === undefined || n === null) return '–'
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB']
  let i = 0
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024
    i++
  }
  return `${n < 10 && i > 0 ? n.toFixed(1) : Math.round(n)} ${units[i]}`
}

function duration(seconds: number): string {
  seconds = Math.max(0, Math.round(seconds))
  if (seconds < 60) return `${seconds}s`
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${seconds % 60}s`
  return `${Math.floor(seconds / 3600)}h ${Math.floor((seconds % 3600) / 60)}m`
}

const now = () => Date.now() / 1000

function table(head: string[], rows: Node[][], empty: string): HTMLElement {
  if (rows.length === 0) return el('p', { class: 'dim' }, empty)
  return el(
    'table',
    {},
    el('thead', {}, el('tr', {}, ...head.map((h) => el('th', {}, h)))),
    el('tbody', {}, ...rows.map((cells) => el('tr', {}, ...cells.map((c) => (c instanceof HTMLTableCellElement ? c : el('td', {}, c)))))),
  )
}

const text = (s: string | number) => document.createTextNode(String(s))

// ---- the key --------------------------------------------------------------------------------------------------

function keyState(ok: boolean | null): void {
  const state = document.getElementById('key-state')!
  state.textContent = ok === null ? '' : ok ? (key() ? 'key in use' : 'no key needed') : 'a key is needed'
  state.className = ok === false ? 'bad' : 'dim'
}

function setupKey(): void {
  const form = document.getElementById('key-form') as HTMLFormElement
  const input = document.getElementById('key-input') as HTMLInputElement
  form.addEventListener('submit', (event) => {
    event.preventDefault()
    const value = input.value.trim()
    if (value) sessionStorage.setItem(KEY, value)
    else sessionStorage.removeItem(KEY)
    input.value = ''
    route()
  })
}

// ---- pages ----------------------------------------------------------------------------------------------------

let cleanup: Array<() => void> = []

function every(ms: number, f: () => Promise<void>): void {
  let stopped = false
  const tick = async () => {
    if (stopped) return
    try {
      await f()
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 401)) console.warn(e)
    }
    if (!stopped) timer = window.setTimeout(tick, ms)
  }
  let timer = window.setTimeout(tick, 0)
  cleanup.push(() => {
    stopped = true
    window.clearTimeout(timer)
  })
}

interface Usage {
  cpu_used_pct: number
  memory_used: number
  memory_total: number
}
interface SandboxInfo {
  id: string
  tier: string
  image?: string
  created_at: number
  expires_at: number
  jobs_running: number
  memory_limit: number
  vcpus: number
  usage?: Usage
}

function sandboxesPage(main: HTMLElement): void {
  const filter = el('input', { placeholder: 'filter by id or tier', 'aria-label': 'filter', id: 'filter' })
  const tier = el('select', { 'aria-label': 'tier', id: 'create-tier' }, el('option', {}, 'wasm'), el('option', {}, 'process'))
  const list = el('div', { id: 'sandbox-list' })
  const create = button('Create sandbox', async () => {
    const made = await api<SandboxInfo>('POST', '/v1/sandboxes', { tier: tier.value })
    toast(`created ${made.id}`)
    await refresh()
  })
  main.append(el('h1', {}, 'Sandboxes'), el('div', { class: 'row' }, filter, tier, create), list)
  let last: SandboxInfo[] = []
  const render = () => {
    const f = filter.value.trim().toLowerCase()
    const shown = last.filter((s) => !f || s.id.toLowerCase().includes(f) || s.tier.includes(f))
    const rows = shown.map((s) => [
      el('a', { href: `#/sandbox/${s.id}`, 'data-sandbox': s.id }, s.id),
      text(s.tier),
      text(s.image ?? (s.tier === 'wasm' ? '–' : 'default')),
      text(duration(now() - s.created_at)),
      text(duration(s.expires_at - now())),
      text(s.jobs_running),
      text(s.usage ? `${s.usage.cpu_used_pct.toFixed(1)} %` : '–'),
      text(`${bytes(s.usage?.memory_used)} / ${bytes(s.memory_limit)}`),
      el(
        'span',
        { class: 'row' },
        button('+5 min', async () => {
          await api('POST', `/v1/sandboxes/${s.id}/timeout`, { timeout: Math.round(s.expires_at - now()) + 300 })
          await refresh()
        }),
        button(
          'Kill',
          async () => {
            await api('DELETE', `/v1/sandboxes/${s.id}`)
            toast(`killed ${s.id}`)
            await refresh()
          },
          { class: 'danger', 'data-kill': s.id },
        ),
      ),
    ])
    list.replaceChildren(
      table(['id', 'tier', 'image', 'age', 'TTL left', 'jobs', 'CPU', 'memory (used / limit)', ''], rows, 'No sandboxes.'),
    )
  }
  const refresh = async () => {
    last = (await api<{ sandboxes: SandboxInfo[] }>('GET', '/v1/sandboxes')).sandboxes
    keyState(true)
    render()
  }
  filter.addEventListener('input', render)
  every(POLL_MS, refresh)
}

function sandboxPage(main: HTMLElement, id: string): void {
  const info = el('div', { class: 'dim' })
  main.append(el('h1', {}, `Sandbox ${id}`), info)
  every(POLL_MS, async () => {
    const s = await api<SandboxInfo>('GET', `/v1/sandboxes/${id}`)
    info.textContent = `${s.tier} · ${s.vcpus} vCPU · memory ${bytes(s.usage?.memory_used)} of ${bytes(s.memory_limit)} · TTL left ${duration(s.expires_at - now())} · ${s.jobs_running} job(s) running`
  })
  const grid = el('div', { class: 'grid' })
  main.append(grid)
  grid.append(runCard(id), terminalCard(id), filesCard(id), snapshotsCard(id))
  main.append(jobsCard(id))
}

function runCard(id: string): HTMLElement {
  const code = el('textarea', { rows: '4', id: 'job-code', 'aria-label': 'job' }) as HTMLTextAreaElement
  code.value = 'print("hello from the console")'
  const kind = el('select', { id: 'job-kind', 'aria-label': 'job kind' }, el('option', {}, 'python'), el('option', {}, 'command'))
  const output = el('pre', { class: 'output', id: 'job-output' })
  const run = button('Run', () => {
    output.textContent = ''
    const job = kind.value === 'python' ? { python: code.value } : { command: ['/bin/sh', '-c', code.value] }
    const ws = socket(`/v1/sandboxes/${id}/exec/ws`)
    return new Promise<void>((resolve) => {
      ws.onopen = () => ws.send(JSON.stringify(job))
      ws.onmessage = (event) => {
        const message = JSON.parse(String(event.data))
        if (message.type === 'stdout' || message.type === 'stderr') {
          const data = message.encoding === 'base64' ? atob(message.data) : message.data
          output.append(message.type === 'stderr' ? el('span', { class: 'bad' }, data) : text(data))
        } else if (message.type === 'outcome') {
          output.append(el('span', { class: 'dim' }, `\n— ${JSON.stringify(message.outcome.status)}`))
        } else if (message.type === 'error') {
          output.append(el('span', { class: 'bad' }, `\n— ${message.error.code}: ${message.error.message}`))
        }
      }
      ws.onclose = () => resolve()
      ws.onerror = () => resolve()
    })
  })
  return el('div', { class: 'card' }, el('h2', {}, 'Run a job (live output)'), el('div', { class: 'row' }, kind, run), code, output)
}

function terminalCard(id: string): HTMLElement {
  const holder = el('div', { id: 'terminal' })
  const card = el('div', { class: 'card' }, el('h2', {}, 'Terminal'), holder)
  let started = false
  const start = async () => {
    if (started) return
    started = true
    const term = new Terminal({ fontSize: 13, cursorBlink: true, convertEol: false })
    const fit = new FitAddon()
    term.loadAddon(fit)
    term.open(holder)
    fit.fit()
    const pty = await api<{ id: string }>('POST', `/v1/sandboxes/${id}/ptys`, { rows: term.rows, cols: term.cols })
    const ws = socket(`/v1/sandboxes/${id}/ptys/${pty.id}/ws`)
    ws.onmessage = (event) => {
      if (typeof event.data === 'string') {
        const message = JSON.parse(event.data)
        if (message.type === 'exit') term.write(`\r\n[exited: ${JSON.stringify(message.outcome?.status)}]\r\n`)
      } else {
        term.write(new Uint8Array(event.data as ArrayBuffer))
      }
    }
    const input = term.onData((data) => ws.readyState === WebSocket.OPEN && ws.send(new TextEncoder().encode(data)))
    const resize = term.onResize(({ rows, cols }) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify({ type: 'resize', rows, cols })))
    const observer = new ResizeObserver(() => fit.fit())
    observer.observe(holder)
    term.focus()
    cleanup.push(() => {
      observer.disconnect()
      input.dispose()
      resize.dispose()
      ws.close()
      term.dispose()
    })
  }
  // Sandboxes without a terminal (wasm) say so when it is opened.
  card.append(
    el('div', { class: 'row' }, button('Open terminal', () => start().catch((e) => {
      started = false
      throw e
    }), { id: 'open-terminal' })),
  )
  return card
}

function filesCard(id: string): HTMLElement {
  const dir = el('input', { value: '/tmp', 'aria-label': 'directory', id: 'files-dir' }) as HTMLInputElement
  const list = el('div', { id: 'files-list' })
  const upload = el('input', { type: 'file', id: 'upload', 'aria-label': 'upload' }) as HTMLInputElement
  const path = (name: string) => `${dir.value.replace(/\/+$/, '')}/${name}`
  const refresh = async () => {
    const listed = await api<{ entries: { name: string; type: string; size: number }[] }>(
      'GET',
      `/v1/sandboxes/${id}/files/list?path=${encodeURIComponent(dir.value)}`,
    )
    const rows = listed.entries.map((e) => [
      text(e.name),
      text(e.type),
      text(bytes(e.size)),
      e.type === 'file' ? button('Download', () => download(id, path(e.name), e.name)) : text(''),
    ])
    list.replaceChildren(table(['name', 'type', 'size', ''], rows, 'Empty.'))
  }
  upload.addEventListener('change', async () => {
    const file = upload.files?.[0]
    if (!file) return
    try {
      await api('PUT', `/v1/sandboxes/${id}/files?path=${encodeURIComponent(path(file.name))}`, file)
      toast(`uploaded ${file.name}`)
      await refresh()
    } catch (e) {
      toast(e instanceof Error ? e.message : String(e), true)
    }
    upload.value = ''
  })
  const card = el(
    'div',
    { class: 'card' },
    el('h2', {}, 'Files'),
    el('div', { class: 'row' }, dir, button('List', refresh, { id: 'files-refresh' }), upload),
    list,
  )
  refresh().catch(() => list.replaceChildren(el('p', { class: 'dim' }, 'Cannot list this directory.')))
  return card
}

async function download(id: string, path: string, name: string): Promise<void> {
  const headers: Record<string, string> = {}
  const k = key()
  if (k) headers['Authorization'] = `Bearer ${k}`
  const response = await fetch(`/v1/sandboxes/${id}/files?path=${encodeURIComponent(path)}`, { headers })
  if (!response.ok) throw new Error(`download: ${response.status}`)
  const url = URL.createObjectURL(await response.blob())
  const link = el('a', { href: url, download: name })
  document.body.append(link)
  link.click()
  link.remove()
  window.setTimeout(() => URL.revokeObjectURL(url), 10_000)
}

interface SnapshotInfo {
  id: string
  tier: string
  source: string
  created_at: number
}

function snapshotsCard(id: string): HTMLElement {
  const list = el('div')
  const refresh = async () => {
    const all = (await api<{ snapshots: SnapshotInfo[] }>('GET', '/v1/snapshots')).snapshots.filter((s) => s.source === id)
    list.replaceChildren(
      table(
        ['snapshot', 'age', ''],
        all.map((s) => [text(s.id), text(duration(now() - s.created_at)), forkButton(s.id)]),
        'No snapshots of this sandbox.',
      ),
    )
  }
  refresh().catch(() => {})
  return el(
    'div',
    { class: 'card' },
    el('h2', {}, 'Snapshots'),
    el(
      'div',
      { class: 'row' },
      button('Snapshot now', async () => {
        const s = await api<SnapshotInfo>('POST', `/v1/sandboxes/${id}/snapshot`)
        toast(`snapshot ${s.id}`)
        await refresh()
      }),
    ),
    list,
  )
}

function forkButton(snapshot: string): HTMLButtonElement {
  return button('Fork', async () => {
    const forks = await api<{ sandboxes: SandboxInfo[] }>('POST', `/v1/snapshots/${snapshot}/fork`, { count: 1 })
    location.hash = `#/sandbox/${forks.sandboxes[0].id}`
  })
}

interface JobRecord {
  number: number
  description: string
  started_at: number
  ended_at: number
  status: { kind: string; code?: number; message?: string }
  stdout_tail: string
  stderr_tail: string
  egress: { host: string; port: number; allowed?: boolean; [k: string]: unknown }[]
}

function jobsCard(id: string): HTMLElement {
  const jobs = el('div', { id: 'jobs' })
  const egress = el('div', { id: 'egress' })
  every(POLL_MS, async () => {
    const list = (await api<{ jobs: JobRecord[] }>('GET', `/v1/sandboxes/${id}/jobs`)).jobs.slice().reverse()
    jobs.replaceChildren(
      table(
        ['#', 'job', 'ended', 'took', 'status', 'stdout (end)'],
        list.map((j) => [
          text(j.number),
          el('td', { class: 'wrap' }, j.description),
          text(`${duration(now() - j.ended_at)} ago`),
          text(`${((j.ended_at - j.started_at) * 1000).toFixed(0)} ms`),
          text(j.status.kind + (j.status.code !== undefined ? ` ${j.status.code}` : '')),
          el('td', { class: 'wrap' }, j.stdout_tail.slice(-200)),
        ]),
        'No jobs yet.',
      ),
    )
    const entries = list.flatMap((j) => j.egress.map((e) => ({ job: j.number, e })))
    egress.replaceChildren(
      table(
        ['job', 'host', 'port', 'entry'],
        entries.map(({ job, e }) => [text(job), text(e.host), text(e.port), el('td', { class: 'wrap' }, JSON.stringify(e))]),
        'No connections through the egress proxy.',
      ),
    )
  })
  return el('div', {}, el('h2', {}, 'Jobs'), jobs, el('h2', {}, 'Egress log'), egress)
}

function snapshotsPage(main: HTMLElement): void {
  const list = el('div')
  main.append(el('h1', {}, 'Snapshots'), list)
  every(POLL_MS * 2, async () => {
    const all = (await api<{ snapshots: SnapshotInfo[] }>('GET', '/v1/snapshots')).snapshots
    list.replaceChildren(
      table(
        ['snapshot', 'tier', 'of sandbox', 'age', ''],
        all.map((s) => [
          text(s.id),
          text(s.tier),
          el('a', { href: `#/sandbox/${s.source}` }, s.source),
          text(duration(now() - s.created_at)),
          el(
            'span',
            { class: 'row' },
            forkButton(s.id),
            button('Delete', async () => {
              await api('DELETE', `/v1/snapshots/${s.id}`)
              toast(`deleted ${s.id}`)
            }, { class: 'danger' }),
          ),
        ]),
        'No snapshots.',
      ),
    )
  })
}

function imagesPage(main: HTMLElement): void {
  const list = el('div')
  main.append(el('h1', {}, 'Images and templates'), list)
  api<{ images: { name: string; source: unknown; created: string; layers: number; templates: string[] }[] }>('GET', '/v1/images')
    .then(({ images }) =>
      list.replaceChildren(
        table(
          ['image', 'templates', 'layers', 'created', 'source'],
          images.map((i) => [
            text(i.name),
            text(i.templates.join(', ') || '–'),
            text(i.layers),
            text(i.created),
            el('td', { class: 'wrap' }, JSON.stringify(i.source)),
          ]),
          'No images in the store (strata images build …). The built-in templates need none.',
        ),
      ),
    )
    .catch((e) => list.replaceChildren(el('p', { class: 'bad' }, String(e.message ?? e))))
}

function nodesPage(main: HTMLElement): void {
  const list = el('div')
  main.append(el('h1', {}, 'Nodes'), list)
  every(POLL_MS, async () => {
    try {
      const fleet = await api<{ node: string | null; nodes: { name: string; state: string; advertise: string; cpus: number; memory: number; sandboxes: number }[] }>('GET', '/v1/nodes')
      if (fleet.node === null) {
        list.replaceChildren(el('p', { class: 'dim' }, 'This server is not a node of a fleet (strata serve --cluster …).'))
        return
      }
      list.replaceChildren(
        el('p', { class: 'dim' }, `This node: ${fleet.node}`),
        table(
          ['node', 'state', 'address', 'CPUs', 'memory', 'sandboxes', ''],
          fleet.nodes.map((n) => [
            text(n.name),
            el('span', { class: n.state === 'up' ? 'good' : n.state === 'lost' ? 'bad' : 'dim' }, n.state),
            text(n.advertise),
            text(n.cpus),
            text(bytes(n.memory)),
            text(n.sandboxes),
            n.state === 'up' ? button('Drain', () => api('POST', `/v1/nodes/${n.name}/drain`)) : text(''),
          ]),
          'No nodes.',
        ),
      )
    } catch (e) {
      if (e instanceof ApiError && (e.status === 404 || e.code === 'not_in_a_fleet')) {
        list.replaceChildren(el('p', { class: 'dim' }, 'This server is not a node of a fleet (strata serve --cluster …).'))
      } else {
        throw e
      }
    }
  })
}

/// One Prometheus text exposition, as `name{labels}` → value.
function parseMetrics(body: string): Map<string, number> {
  const values = new Map<string, number>()
  for (const line of body.split('\n')) {
    if (!line || line.startsWith('#')) continue
    const at = line.lastIndexOf(' ')
    values.set(line.slice(0, at), Number(line.slice(at + 1)))
  }
  return values
}

function sum(values: Map<string, number>, prefix: string): number {
  let total = 0
  for (const [name, value] of values) if (name === prefix || name.startsWith(`${prefix}{`)) total += value
  return total
}

function chart(title: string, unit: string): { node: HTMLElement; push: (t: number, v: number) => void } {
  const holder = el('div', { class: 'card' }, el('h2', {}, `${title} (${unit})`))
  const data: [number[], number[]] = [[], []]
  let plot: uPlot | null = null
  const push = (t: number, v: number) => {
    data[0].push(t)
    data[1].push(v)
    if (data[0].length > 150) {
      data[0].shift()
      data[1].shift()
    }
    if (!plot) {
      plot = new uPlot(
        {
          width: 420,
          height: 140,
          legend: { show: false },
          axes: [{ stroke: '#8a97a6' }, { stroke: '#8a97a6', size: 60 }],
          series: [{}, { stroke: '#4fb3ff', width: 2 }],
        },
        data,
        holder,
      )
    } else {
      plot.setData(data)
    }
  }
  return { node: holder, push }
}

function healthPage(main: HTMLElement): void {
  const stats = el('div', { class: 'row', id: 'health-stats' })
  const charts = {
    sandboxes: chart('Live sandboxes', 'count'),
    memory: chart('Memory committed', 'MiB'),
    slots: chart('vCPU slots used', 'slots'),
    rejections: chart('Admission rejections', 'per s'),
    latency: chart('Mean operation latency (creates, jobs, files…)', 'ms'),
  }
  main.append(el('h1', {}, 'Server health'), stats, el('div', { class: 'grid' }, ...Object.values(charts).map((c) => c.node)))
  let previous: { at: number; rejections: number; count: number; sum: number } | null = null
  every(POLL_MS, async () => {
    const values = parseMetrics(await api<string>('GET', '/metrics'))
    const at = now()
    const live = sum(values, 'strata_sandboxes_active')
    const memory = sum(values, 'strata_memory_committed_bytes')
    const used = values.get('strata_host_vcpu_slots{state="used"}') ?? 0
    const total = values.get('strata_host_vcpu_slots{state="total"}') ?? 0
    const budget = values.get('strata_memory_budget_bytes')
    const rejections = sum(values, 'strata_admission_rejections_total')
    const count = sum(values, 'strata_operation_duration_seconds_count')
    const seconds = sum(values, 'strata_operation_duration_seconds_sum')
    stats.replaceChildren(
      ...[
        ['live sandboxes', String(live)],
        ['admission slots', `${used} / ${total}`],
        ['memory committed', budget ? `${bytes(memory)} of ${bytes(budget)}` : `${bytes(memory)} (no budget)`],
        ['rejections', String(rejections)],
      ].map(([label, value]) => el('div', { class: 'card' }, el('div', { class: 'dim' }, label), el('div', { class: 'stat' }, value))),
    )
    charts.sandboxes.push(at, live)
    charts.memory.push(at, memory / (1 << 20))
    charts.slots.push(at, used)
    if (previous) {
      const dt = Math.max(at - previous.at, 0.001)
      charts.rejections.push(at, (rejections - previous.rejections) / dt)
      const n = count - previous.count
      charts.latency.push(at, n > 0 ? ((seconds - previous.sum) / n) * 1000 : 0)
    }
    previous = { at, rejections, count, sum: seconds }
  })
}

// ---- routing --------------------------------------------------------------------------------------------------

function route(): void {
  for (const stop of cleanup) stop()
  cleanup = []
  const main = document.getElementById('main')!
  main.replaceChildren()
  const [, page = 'sandboxes', arg] = location.hash.split('/')
  for (const link of document.querySelectorAll<HTMLAnchorElement>('nav a')) {
    link.classList.toggle('active', link.dataset.page === page || (page === 'sandbox' && link.dataset.page === 'sandboxes'))
  }
  keyState(null)
  switch (page) {
    case 'sandbox':
      return sandboxPage(main, decodeURIComponent(arg ?? ''))
    case 'snapshots':
      return snapshotsPage(main)
    case 'images':
      return imagesPage(main)
    case 'nodes':
      return nodesPage(main)
    case 'health':
      return healthPage(main)
    default:
      return sandboxesPage(main)
  }
}

setupKey()
window.addEventListener('hashchange', route)
route()
