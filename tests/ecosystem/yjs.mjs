// Yjs over the gateway: the package's own YjsServer (@durable-streams/y-durable-streams/server)
// with the gateway as its `dsServerUrl` and a LOW compaction threshold (1500 bytes, as upstream's
// packages/y-durable-streams/test/yjs-conformance.test.ts uses), and YjsProviders at their default
// options (live mode SSE, updates sent by an IdempotentProducer) under Node (plain fetch, no
// WebSocket). Two providers edit one document concurrently through several compactions; a late
// joiner arrives mid-way; a client that synced before the first snapshot goes offline and resumes
// after several; a raw read from a pre-snapshot offset; a fresh client at the end. Every copy of
// the document must converge to the same content, with every edit in it once.
//
//   node yjs.mjs http://127.0.0.1:4437/v1/stream

import * as Y from "yjs"
import * as decoding from "lib0/decoding"
import { YjsProvider } from "@durable-streams/y-durable-streams"
import { YjsServer } from "@durable-streams/y-durable-streams/server"
import { Report, baseUrlFromArgs, captureConsole, describeError, sleep, uniqueName, waitFor } from "./lib.mjs"

const COMPACTION_THRESHOLD = 1500 // bytes of updates between compactions (the default is 1 MiB)
const EDITS_PER_WRITER = 120
const MIN_COMPACTIONS = 3

const report = new Report(`yjs`)
const base = baseUrlFromArgs()
const origin = base.replace(/\/v1\/stream$/, ``) // YjsServer adds /v1/stream/yjs/... itself
const logged = captureConsole([`log`, `warn`, `error`])
const providers = {}
const providerErrors = []
report.watchdog(240, () => ({ docs: Object.fromEntries(Object.entries(providers).map(([n, p]) => [n, shape(p.doc)])),
  compactions: compactions().length, providerErrors: providerErrors.slice(0, 5) }))

const compactions = () => logged.filter((line) => line.includes(`[Compactor] Compacted`))
const troubles = () => logged.filter((line) => /^(warn|error): /.test(line))

/** A seeded PRNG (mulberry32), so a failing run can be replayed. */
function prng(seed) {
  let a = seed >>> 0
  return () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

function content(doc) {
  return JSON.stringify({ items: doc.getArray(`items`).toArray(), text: doc.getText(`text`).toString(),
    map: Object.entries(doc.getMap(`map`).toJSON()).sort(([x], [y]) => (x < y ? -1 : 1)) }) // key order varies
}

function shape(doc) {
  return { items: doc.getArray(`items`).length, text: doc.getText(`text`).length, map: doc.getMap(`map`).size }
}

/** Whether the provider synced within 20 s (a check of its own). */
async function synced(provider, label) {
  const ok = await waitFor(() => provider.synced, { timeoutMs: 20_000 }).then(() => true, () => false)
  report.check(`${label} synced`, ok, { provider: label, errors: providerErrors.slice(0, 3), troubles: troubles().slice(0, 3) })
  return ok
}

function connect(name, baseUrl, docId) {
  const doc = new Y.Doc()
  const provider = new YjsProvider({ doc, baseUrl, docId }) // connects at once
  provider.on(`error`, (err) => providerErrors.push(`${name}: ${describeError(err)}`))
  providers[name] = provider
  return provider
}

/** One edit (one Yjs update): a token into the array at a random place, a chunk of text, a map key. */
function edit(provider, name, n, random) {
  const doc = provider.doc
  doc.transact(() => {
    const items = doc.getArray(`items`)
    items.insert(Math.floor(random() * (items.length + 1)), [`${name}-${n}`])
    const text = doc.getText(`text`)
    text.insert(Math.floor(random() * (text.length + 1)), `<${name}${n}:${`x`.repeat(24)}>`)
    doc.getMap(`map`).set(`${name}-${n % 10}`, n)
  })
}

async function writer(provider, name, seed, edits, onHalf) {
  const random = prng(seed)
  for (let n = 0; n < edits; n++) {
    edit(provider, name, n, random)
    if (n === Math.floor(edits / 2)) await onHalf?.()
    await sleep(2 + Math.floor(random() * 12))
  }
  await provider.flush()
}

async function main() {
  const yjs = new YjsServer({ dsServerUrl: origin, compactionThreshold: COMPACTION_THRESHOLD })
  await yjs.start()
  const service = uniqueName(`yjs`)
  const baseUrl = `${yjs.url}/v1/yjs/${service}`
  const docId = `doc-${Date.now()}`
  const expectedTokens = []

  const a = connect(`A`, baseUrl, docId)
  const b = connect(`B`, baseUrl, docId)
  await synced(a, `A`)
  await synced(b, `B`)

  // C syncs and writes before any snapshot exists, then goes offline.
  const c = connect(`C`, baseUrl, docId)
  await synced(c, `C`)
  const randomC = prng(3)
  for (let n = 0; n < 3; n++) {
    edit(c, `C`, n, randomC)
    expectedTokens.push(`C-${n}`)
  }
  await c.flush()
  await waitFor(() => a.doc.getArray(`items`).length >= 3 && b.doc.getArray(`items`).length >= 3,
    { label: `A and B to see C's first edits` })
  // A raw read of the document so far: its next offset comes from before every snapshot.
  const early = await readUpdates(`${baseUrl}/docs/${docId}`, `-1`)
  await c.disconnect()
  report.check(`no snapshot before the concurrent edits`, compactions().length === 0, compactions())

  // A and B edit concurrently; halfway through, D joins and edits too.
  let d = null
  const joinLate = async () => {
    if (d) return
    d = connect(`D`, baseUrl, docId)
    await synced(d, `D (late joiner, after ${compactions().length} compactions)`)
    report.set(`compactionsBeforeLateJoin`, compactions().length)
  }
  for (let n = 0; n < EDITS_PER_WRITER; n++) expectedTokens.push(`A-${n}`, `B-${n}`)
  await Promise.all([writer(a, `A`, 1, EDITS_PER_WRITER, joinLate), writer(b, `B`, 2, EDITS_PER_WRITER, joinLate)])
  for (let n = 0; n < 20; n++) expectedTokens.push(`D-${n}`)
  await writer(d, `D`, 4, 20)
  const afterEdits = compactions().length

  // C comes back from its pre-snapshot state. (It writes nothing more: a provider reconnecting
  // with the same Y.Doc reuses its producer id `${docId}-${clientID}` at epoch 0 from seq 0, so
  // the server takes its next writes for duplicates of the first session's and drops them, on any
  // server: a bug of the package, not of the gateway.)
  await c.connect()
  await synced(c, `C (resumed after ${compactions().length} compactions)`)

  // A fresh client: the newest snapshot plus the updates after it.
  const e = connect(`E`, baseUrl, docId)
  await synced(e, `E (fresh client)`)

  const names = Object.keys(providers)
  const converged = await waitFor(() => new Set(names.map((n) => content(providers[n].doc))).size === 1,
    { timeoutMs: 30_000, label: `every document to converge` }).then(() => true, () => false)
  const docs = Object.fromEntries(names.map((n) => [n, shape(providers[n].doc)]))
  report.check(`documents ${names.join(`, `)} converged to the same content`, converged, { docs, providerErrors: providerErrors.slice(0, 5) })

  const items = a.doc.getArray(`items`).toArray()
  const counts = new Map()
  for (const item of items) counts.set(item, (counts.get(item) ?? 0) + 1)
  const missing = expectedTokens.filter((t) => !counts.has(t))
  const doubled = [...counts].filter(([, k]) => k > 1).map(([t]) => t)
  report.check(`every edit is in the document once`, missing.length === 0 && doubled.length === 0 && items.length === expectedTokens.length,
    { items: items.length, expected: expectedTokens.length, missing: missing.slice(0, 10), doubled: doubled.slice(0, 10) })

  // Reading the updates from the pre-snapshot offset, on top of the state read then, gives the same document.
  const resumed = new Y.Doc()
  Y.applyUpdate(resumed, Y.encodeStateAsUpdate(early.doc))
  let resumedOk = false
  let resumedDetail
  try {
    const rest = await readUpdates(`${baseUrl}/docs/${docId}`, early.nextOffset, resumed)
    resumedOk = content(rest.doc) === content(a.doc)
    resumedDetail = { early: early.nextOffset, resumed: shape(rest.doc), final: shape(a.doc) }
  } catch (err) {
    resumedDetail = describeError(err)
  }
  report.check(`updates read from a pre-snapshot offset resume the document`, resumedOk, resumedDetail)

  report.check(`compaction ran several times (at least ${MIN_COMPACTIONS}) during the edits`, afterEdits >= MIN_COMPACTIONS,
    { compactions: afterEdits })
  report.check(`no provider errors`, providerErrors.length === 0, providerErrors.slice(0, 5))
  report.check(`no errors or warnings from the packages (YjsServer, compactor, providers)`, troubles().length === 0,
    troubles().slice(0, 8))
  report.set(`compactions`, compactions().length)
  report.set(`lastCompaction`, compactions().at(-1) ?? null)
  report.set(`docs`, docs)
  report.set(`earlyOffset`, early.nextOffset)

  for (const provider of Object.values(providers)) provider.destroy()
  await yjs.stop().catch(() => {})
  report.finish()
}

/**
 * The document's updates from `offset` until up to date, read through the YjsServer with plain
 * GETs (each body is lib0-framed updates), applied to `doc`; with the offset to go on from.
 */
async function readUpdates(docUrl, offset, doc = new Y.Doc()) {
  let next = offset
  for (let page = 0; page < 1000; page++) {
    const response = await fetch(`${docUrl}?offset=${encodeURIComponent(next)}`)
    if (!response.ok) throw new Error(`GET offset=${next}: ${response.status} ${await response.text()}`)
    const body = new Uint8Array(await response.arrayBuffer())
    const decoder = decoding.createDecoder(body)
    while (decoding.hasContent(decoder)) Y.applyUpdate(doc, decoding.readVarUint8Array(decoder))
    next = response.headers.get(`stream-next-offset`) ?? next
    if (response.headers.has(`stream-up-to-date`)) return { doc, nextOffset: next }
  }
  throw new Error(`never up to date reading from ${offset}`)
}

main().catch((err) => report.fail(err))
