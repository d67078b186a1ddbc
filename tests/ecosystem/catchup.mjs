// Whole catch-up reads with @durable-streams/client (issue 41): a large JSON stream and a large
// byte stream, each read from the start in three ways a user reads "everything there is":
//
//   * `live: false`, the README's "Read catch-up only": `(await stream({url, offset: "-1", live: false})).json()`
//     (`.body()` for bytes). The client makes ONE request in this mode and takes its answer as the
//     whole stream (it never follows Stream-Next-Offset), so the server's one answer must hold it all.
//   * the default mode (no `live` given), `.json()` / `.body()`: the promise helpers follow the
//     offsets until up to date, then stop.
//   * the default mode with a subscriber (`subscribeJson` / `subscribeBytes`) cancelled at the
//     first batch that says up to date (the client would go live next: SSE for JSON, long-poll for bytes).
//
// Every read's messages are checked in order (message n is {"i": n, ...}) and summarised by a count
// and the sha256 of their JSON (`JSON.stringify` of the array, i.e. compact); bytes by length and sha256.
// With expectations given, each read must match them exactly.
//
//   node catchup.mjs JSON_STREAM_URL BYTES_STREAM_URL ['{"messages": N, "messagesSha256": "...", "bytes": N, "bytesSha256": "..."}']

import { createHash } from "node:crypto"
import { stream } from "@durable-streams/client"
import { Report, countRequests, describeError } from "./lib.mjs"

const [jsonUrl, bytesUrl, expectArg] = process.argv.slice(2)
if (!/^https?:\/\//.test(jsonUrl ?? ``) || !/^https?:\/\//.test(bytesUrl ?? ``)) {
  console.error(`usage: node ${process.argv[1]} JSON_STREAM_URL BYTES_STREAM_URL [EXPECTATIONS_JSON]`)
  process.exit(2)
}
const expected = expectArg ? JSON.parse(expectArg) : null

const report = new Report(`catchup`)
const requests = countRequests()
const reads = {}
let current = null
report.watchdog(240, () => ({ current, reads, requests }))

const sha256 = (data) => createHash(`sha256`).update(data).digest(`hex`)

/** Counts, order and digest of the messages one read returned. */
function summariseMessages(items) {
  let outOfOrder = -1
  for (let n = 0; n < items.length; n++) {
    if (items[n]?.i !== n) {
      outOfOrder = n
      break
    }
  }
  return {
    messages: items.length,
    firstOutOfOrder: outOfOrder, // -1: message n is {"i": n, ...} for every n
    lastI: items.length ? items[items.length - 1]?.i ?? null : null,
    messagesSha256: sha256(JSON.stringify(items)),
  }
}

/** Runs one read, recording its summary, the GETs it made and its time; an error is recorded too. */
async function read(name, fn) {
  current = name
  const before = requests.requests[`GET`] ?? 0
  const beforeLive = Object.entries(requests.requests)
    .filter(([k]) => k.startsWith(`GET live=`))
    .reduce((sum, [, v]) => sum + v, 0)
  const started = Date.now()
  try {
    reads[name] = await fn()
  } catch (err) {
    reads[name] = { error: describeError(err) }
  }
  reads[name].catchUpRequests = (requests.requests[`GET`] ?? 0) - before
  reads[name].liveRequests = Object.entries(requests.requests)
    .filter(([k]) => k.startsWith(`GET live=`))
    .reduce((sum, [, v]) => sum + v, 0) - beforeLive
  reads[name].seconds = (Date.now() - started) / 1000
  process.stderr.write(`${name}: ${JSON.stringify(reads[name])}\n`)
}

/** A subscriber that keeps every batch until one says up to date, then cancels the session. */
async function subscribeUntilUpToDate(res, subscribe, onBatch) {
  let batches = 0
  let sawUpToDate = false
  await new Promise((resolve, reject) => {
    res.closed.then(resolve, reject)
    subscribe((batch) => {
      batches++
      onBatch(batch)
      if (batch.upToDate && !sawUpToDate) {
        sawUpToDate = true
        res.cancel(`caught up`)
        resolve()
      }
    })
  })
  return { batches, sawUpToDate }
}

async function main() {
  // --- the JSON stream ---
  await read(`json live:false .json()`, async () => {
    const res = await stream({ url: jsonUrl, offset: `-1`, live: false })
    return summariseMessages(await res.json())
  })
  await read(`json default .json()`, async () => {
    const res = await stream({ url: jsonUrl, offset: `-1` })
    return summariseMessages(await res.json())
  })
  await read(`json default subscribeJson until upToDate`, async () => {
    const res = await stream({ url: jsonUrl, offset: `-1` })
    const items = []
    const { batches, sawUpToDate } = await subscribeUntilUpToDate(
      res, (cb) => res.subscribeJson(cb), (batch) => { for (const item of batch.items) items.push(item) })
    return { ...summariseMessages(items), batches, sawUpToDate }
  })

  // --- the byte stream ---
  await read(`bytes live:false .body()`, async () => {
    const res = await stream({ url: bytesUrl, offset: `-1`, live: false })
    const data = await res.body()
    return { bytes: data.length, bytesSha256: sha256(data) }
  })
  await read(`bytes default .body()`, async () => {
    const res = await stream({ url: bytesUrl, offset: `-1` })
    const data = await res.body()
    return { bytes: data.length, bytesSha256: sha256(data) }
  })
  await read(`bytes default subscribeBytes until upToDate`, async () => {
    const res = await stream({ url: bytesUrl, offset: `-1` })
    const hash = createHash(`sha256`)
    let bytes = 0
    const { batches, sawUpToDate } = await subscribeUntilUpToDate(
      res, (cb) => res.subscribeBytes(cb), (chunk) => { hash.update(chunk.data); bytes += chunk.data.length })
    return { bytes, bytesSha256: hash.digest(`hex`), batches, sawUpToDate }
  })

  current = null
  report.set(`reads`, reads)
  report.set(`requests`, requests)
  for (const [name, got] of Object.entries(reads)) {
    if (got.error) {
      report.check(`${name}: no error`, false, got.error)
      continue
    }
    if (!expected) continue
    if (`messages` in got) {
      report.check(`${name}: every message, in order`,
        got.messages === expected.messages && got.firstOutOfOrder === -1 && got.messagesSha256 === expected.messagesSha256,
        `${got.messages} of ${expected.messages} messages, first out of order at ${got.firstOutOfOrder}, ` +
          `sha256 ${got.messagesSha256 === expected.messagesSha256 ? `equal` : `differs`}`)
    } else {
      report.check(`${name}: every byte`,
        got.bytes === expected.bytes && got.bytesSha256 === expected.bytesSha256,
        `${got.bytes} of ${expected.bytes} bytes, sha256 ${got.bytesSha256 === expected.bytesSha256 ? `equal` : `differs`}`)
    }
  }
  report.finish()
}

main().catch((err) => report.fail(err))
