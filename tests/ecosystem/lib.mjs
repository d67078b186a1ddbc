// Shared by the scenario scripts: arguments, a watchdog, request counting, checks and the summary.
//
// Every script is run as `node <script>.mjs <stream base URL>` (e.g. http://127.0.0.1:4437/v1/stream),
// prints ONE JSON summary line on stdout ({"ok": bool, "checks": {...}, ...}) and exits 0 only
// when every check passed. Diagnostics go to stderr.

import { randomUUID } from "node:crypto"

export function baseUrlFromArgs() {
  const base = process.argv[2]
  if (!base || !/^https?:\/\/.+\/v1\/stream$/.test(base.replace(/\/$/, ``))) {
    console.error(`usage: node ${process.argv[1]} http://HOST:PORT/v1/stream`)
    process.exit(2)
  }
  return base.replace(/\/$/, ``)
}

/** A fresh stream path under the base: `eco-<scenario>-<random>/<name>`. */
export function uniqueName(scenario) {
  return `eco-${scenario}-${randomUUID().slice(0, 12)}`
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

/** Until `condition()` is true (polled), or throw `label` after `timeoutMs`. */
export async function waitFor(condition, { timeoutMs = 30_000, intervalMs = 50, label = `condition` } = {}) {
  const deadline = Date.now() + timeoutMs
  while (Date.now() < deadline) {
    if (await condition()) return
    await sleep(intervalMs)
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${label}`)
}

/**
 * The summary and its checks. `check(name, ok, detail)` records one; `finish()` prints the
 * summary and exits (1 when a check failed); `fail(err)` records an unexpected error and finishes.
 */
export class Report {
  constructor(scenario) {
    this.summary = { scenario, ok: true, checks: {}, failures: [] }
    this.started = Date.now()
    this.finished = false
  }

  set(key, value) {
    this.summary[key] = value
  }

  check(name, ok, detail = undefined) {
    this.summary.checks[name] = ok ? `ok` : `FAILED`
    if (!ok) {
      this.summary.ok = false
      const text = detail === undefined ? name : `${name}: ${typeof detail === `string` ? detail : JSON.stringify(detail)}`
      this.summary.failures.push(text.length > 2000 ? `${text.slice(0, 2000)}...` : text)
      process.stderr.write(`[check failed] ${text}\n`) // not console.error: captureConsole() keeps the packages' lines
    }
    return ok
  }

  fail(err) {
    this.summary.ok = false
    this.summary.failures.push(`unexpected error: ${describeError(err)}`)
    this.finish()
  }

  finish() {
    if (this.finished) return
    this.finished = true
    this.summary.seconds = Math.round((Date.now() - this.started) / 100) / 10
    process.stdout.write(`${JSON.stringify(this.summary)}\n`)
    process.exit(this.summary.ok ? 0 : 1)
  }

  /** Finish with a failure if the scenario has not finished after `seconds`. */
  watchdog(seconds, state = () => ({})) {
    const timer = setTimeout(() => {
      this.summary.ok = false
      this.summary.failures.push(`watchdog: not finished after ${seconds} s; state: ${JSON.stringify(state())}`)
      this.finish()
    }, seconds * 1000)
    timer.unref()
  }
}

/** An error with what the client packages attach to it (HTTP status, code, body text). */
export function describeError(err) {
  if (!(err instanceof Error)) return String(err)
  const parts = [`${err.name}: ${err.message}`]
  for (const key of [`status`, `code`]) if (err[key] !== undefined) parts.push(`${key}=${err[key]}`)
  if (typeof err.text === `string` && err.text && !err.message.includes(err.text)) parts.push(`body=${err.text.slice(0, 300)}`)
  if (err.details !== undefined) parts.push(`details=${JSON.stringify(err.details).slice(0, 300)}`)
  return parts.join(` `)
}

/**
 * Counts the HTTP requests the packages make (they call the global fetch at call time), without
 * changing any of their options: per method and `live` mode, the POST bodies' sizes, and every
 * non-2xx answer (method, path, status). Returns the stats object, updated live.
 */
export function countRequests() {
  const stats = { requests: {}, posts: 0, largestPostBytes: 0, errorAnswers: [] }
  const original = globalThis.fetch
  globalThis.fetch = async (input, init = {}) => {
    const url = new URL(typeof input === `string` ? input : input.url ?? String(input))
    const method = (init.method ?? `GET`).toUpperCase()
    const live = url.searchParams.get(`live`)
    const key = live ? `${method} live=${live}` : method
    stats.requests[key] = (stats.requests[key] ?? 0) + 1
    if (method === `POST`) {
      stats.posts += 1
      const size = bodySize(init.body)
      if (size > stats.largestPostBytes) stats.largestPostBytes = size
    }
    const response = await original(input, init)
    if (response.status >= 400 && stats.errorAnswers.length < 20) {
      stats.errorAnswers.push(`${method} ${url.pathname} -> ${response.status}`)
    }
    return response
  }
  return stats
}

function bodySize(body) {
  if (body == null) return 0
  if (typeof body === `string`) return Buffer.byteLength(body)
  if (body instanceof ArrayBuffer) return body.byteLength
  if (ArrayBuffer.isView(body)) return body.byteLength
  return -1 // a stream: size unknown
}

/**
 * console.warn / console.error (and, if asked, console.log) lines: the packages log their trouble
 * (and the YjsServer its compactions) there. Kept, and passed on to stderr: stdout is the summary's.
 */
export function captureConsole(kinds = [`warn`, `error`]) {
  const lines = []
  for (const kind of kinds) {
    const original = (kind === `log` || kind === `info` ? console.error : console[kind]).bind(console)
    console[kind] = (...args) => {
      const text = args.map((a) => (a instanceof Error ? describeError(a) : typeof a === `string` ? a : safeJson(a))).join(` `)
      if (lines.length < 200) lines.push(`${kind}: ${text.slice(0, 500)}`)
      original(...args)
    }
  }
  return lines
}

function safeJson(value) {
  try {
    return JSON.stringify(value)
  } catch {
    return String(value)
  }
}
