// The console in a real browser: Debian's Chromium, headless, driven by playwright-core against the
// `strata serve` that engine/cli/tests/console.rs started. Environment: STRATA_URL (the server), STRATA_KEY (an API
// key the page is given once), SANDBOX_ID (a process sandbox made through the API), SCREENSHOTS (a directory),
// CHROMIUM (the browser). Prints CONSOLE OK when every step passed; any failure exits non-zero with its reason.

import { chromium } from 'playwright-core'
import { mkdirSync } from 'node:fs'
import { join } from 'node:path'

const { STRATA_URL: url, STRATA_KEY: key, SANDBOX_ID: id, SCREENSHOTS: shots, CHROMIUM: executablePath } = process.env
mkdirSync(shots, { recursive: true })

const browser = await chromium.launch({ executablePath, headless: true, args: ['--no-sandbox'] })
const problems = []
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } })
  // A Content-Security-Policy violation or a script error is a failure, whatever the page shows.
  page.on('console', (message) => {
    if (message.type() === 'error' && !/Failed to load resource/.test(message.text())) problems.push(`console: ${message.text()}`)
  })
  page.on('pageerror', (error) => problems.push(`page error: ${error.message}`))
  const step = async (what, f) => {
    try {
      await f()
    } catch (error) {
      await page.screenshot({ path: join(shots, 'failure.png'), fullPage: true }).catch(() => {})
      throw new Error(`${what}: ${error.message}`)
    }
  }

  await step('the page asks for a key, and takes it', async () => {
    await page.goto(`${url}/ui/`)
    await page.locator('#key-state', { hasText: 'a key is needed' }).waitFor({ timeout: 15_000 })
    await page.fill('#key-input', key)
    await page.click('#key-form button[type=submit]')
    await page.locator('#key-state', { hasText: 'key in use' }).waitFor({ timeout: 15_000 })
  })

  await step('the list shows the sandbox made through the API', async () => {
    await page.locator(`a[data-sandbox="${id}"]`).waitFor({ timeout: 15_000 })
    await page.screenshot({ path: join(shots, 'sandboxes.png'), fullPage: true })
  })

  await step('a command typed into the terminal prints its output', async () => {
    await page.click(`a[data-sandbox="${id}"]`)
    await page.click('#open-terminal')
    await page.locator('#terminal .xterm-rows').waitFor({ timeout: 15_000 })
    await page.locator('#terminal .xterm-rows', { hasText: '@strata' }).waitFor({ timeout: 30_000 })
    await page.keyboard.type('echo console-$((6*7))\n')
    await page.locator('#terminal .xterm-rows', { hasText: 'console-42' }).waitFor({ timeout: 30_000 })
  })

  await step('a file uploaded appears in the sandbox', async () => {
    await page.setInputFiles('#upload', { name: 'hello.txt', mimeType: 'text/plain', buffer: Buffer.from('uploaded from the console\n') })
    await page.locator('#files-list', { hasText: 'hello.txt' }).waitFor({ timeout: 15_000 })
  })

  await step('a job runs with its output streamed', async () => {
    await page.selectOption('#job-kind', 'command')
    await page.fill('#job-code', 'cat /tmp/hello.txt; echo job-$((2+3))')
    await page.getByRole('button', { name: 'Run' }).click()
    await page.locator('#job-output', { hasText: 'job-5' }).waitFor({ timeout: 30_000 })
    await page.locator('#job-output', { hasText: 'uploaded from the console' }).waitFor({ timeout: 5_000 })
    await page.locator('#jobs', { hasText: 'cat /tmp/hello.txt' }).waitFor({ timeout: 15_000 })
    await page.screenshot({ path: join(shots, 'sandbox.png'), fullPage: true })
  })

  for (const name of ['snapshots', 'images', 'nodes', 'health']) {
    await step(`the ${name} page`, async () => {
      await page.goto(`${url}/ui/#/${name}`)
      await page.locator('main h1').waitFor({ timeout: 15_000 })
      if (name === 'health') await page.locator('#health-stats .card').first().waitFor({ timeout: 15_000 })
      if (name === 'nodes') await page.locator('main', { hasText: 'not a node of a fleet' }).waitFor({ timeout: 15_000 })
      await page.waitForTimeout(name === 'health' ? 4500 : 500)
      await page.screenshot({ path: join(shots, `${name}.png`), fullPage: true })
    })
  }

  await step('killing from the page removes the sandbox', async () => {
    await page.goto(`${url}/ui/#/sandboxes`)
    await page.click(`button[data-kill="${id}"]`)
    await page.locator(`a[data-sandbox="${id}"]`).waitFor({ state: 'detached', timeout: 15_000 })
  })

  if (problems.length > 0) throw new Error(problems.join('\n'))
  console.log('CONSOLE OK')
} finally {
  await browser.close()
}
