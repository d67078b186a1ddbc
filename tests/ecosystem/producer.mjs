// JS client volume on a JSON stream: an IdempotentProducer at its DEFAULT options (maxBatchBytes
// 1 MiB, lingerMs 5, maxInFlight 5, epoch 0, no autoClaim) writes 100,000 small messages {"i":n}
// while two `stream()` readers tail the stream live, one with SSE and one with long-poll; then the
// producer flushes and closes the stream. Checks: every message stored once and in order, and seen
// exactly once, in order, by each reader, which both end at the stream's close.
//
//   node producer.mjs http://127.0.0.1:4437/v1/stream

import { DurableStream, IdempotentProducer, stream } from "@durable-streams/client"
import { Report, baseUrlFromArgs, captureConsole, countRequests, describeError, sleep, uniqueName } from "./lib.mjs"

const MESSAGES = 100_000
const BURST = 50_000 // the first half is appended in one synchronous burst: batches cut at maxBatchBytes
const PACE_EVERY = 500 // the second half yields to the event loop every 500 appends: batches cut by lingerMs

const report = new Report(`producer`)
const base = baseUrlFromArgs()
const url = `${base}/${uniqueName(`producer`)}`
const requests = countRequests()
const logged = captureConsole()
const readers = {}
report.watchdog(300, () => ({ readers: progress(), requests }))

function progress() {
  return Object.fromEntries(Object.entries(readers).map(([mode, r]) => [mode, { seen: r.seen, closed: r.closed }]))
}

/** A live reader from the start of the stream: checks each item is the next expected one. */
async function tail(mode) {
  const reader = { seen: 0, outOfOrder: 0, firstProblem: null, batches: 0, closed: false, error: null }
  readers[mode] = reader
  const res = await stream({ url, offset: `-1`, live: mode })
  res.subscribeJson(async (batch) => {
    reader.batches += 1
    for (const item of batch.items) {
      if (item?.i !== reader.seen && reader.firstProblem === null) {
        reader.firstProblem = `expected {"i":${reader.seen}}, got ${JSON.stringify(item)}`
      }
      if (item?.i !== reader.seen) reader.outOfOrder += 1
      reader.seen += 1
    }
  })
  reader.done = res.closed.then(
    () => {
      reader.closed = true
    },
    (err) => {
      reader.error = describeError(err)
    }
  )
  return reader
}

async function main() {
  const handle = await DurableStream.create({ url, contentType: `application/json` })
  const sse = await tail(`sse`)
  const longPoll = await tail(`long-poll`)

  const producerErrors = []
  const producer = new IdempotentProducer(handle, `eco-producer`, {
    onError: (err) => producerErrors.push(describeError(err)), // errors are only reported here
  })
  const started = Date.now()
  for (let i = 0; i < BURST; i++) producer.append(JSON.stringify({ i }))
  for (let i = BURST; i < MESSAGES; i++) {
    producer.append(JSON.stringify({ i }))
    if (i % PACE_EVERY === 0) await new Promise((resolve) => setImmediate(resolve))
  }
  await producer.flush()
  report.set(`producerSeconds`, (Date.now() - started) / 1000)
  report.set(`producerPosts`, requests.posts)
  report.set(`largestPostBytes`, requests.largestPostBytes)
  if (!report.check(`producer reported no errors`, producerErrors.length === 0, producerErrors.slice(0, 5))) {
    report.set(`requests`, requests)
    report.finish()
  }
  try {
    await producer.close()
    report.check(`producer.close() closed the stream`, true)
  } catch (err) {
    report.check(`producer.close() closed the stream`, false, describeError(err))
  }

  // Both readers end when they see the stream closed (EOF).
  const deadline = Date.now() + 60_000
  while ((!sse.closed || !longPoll.closed) && !sse.error && !longPoll.error && Date.now() < deadline) await sleep(50)
  for (const [mode, reader] of Object.entries(readers)) {
    report.check(`${mode} reader ended at the close without error`, reader.closed && !reader.error, reader)
    report.check(`${mode} reader saw every message once, in order`, reader.seen === MESSAGES && reader.outOfOrder === 0,
      { seen: reader.seen, expected: MESSAGES, outOfOrder: reader.outOfOrder, first: reader.firstProblem })
  }

  // Everything stored once and in order (a catch-up read from the start).
  const stored = await (await stream({ url, offset: `-1` })).json() // json() stops at up-to-date
  let misplaced = 0
  let firstMisplaced = null
  stored.forEach((item, n) => {
    if (item?.i !== n) {
      misplaced += 1
      firstMisplaced ??= { position: n, item }
    }
  })
  report.check(`stored: every message once, in order`, stored.length === MESSAGES && misplaced === 0,
    { stored: stored.length, expected: MESSAGES, misplaced, firstMisplaced })
  const head = await handle.head()
  report.check(`stream is closed`, head.streamClosed === true, head)

  report.set(`readers`, Object.fromEntries(Object.entries(readers).map(([m, r]) => [m, { seen: r.seen, batches: r.batches }])))
  report.set(`requests`, requests)
  report.set(`clientWarnings`, logged.filter((line) => line.includes(`Durable Streams`) || line.includes(`Falling back`)))
  report.check(`the SSE reader stayed on SSE (no fallback to long-poll)`,
    !logged.some((line) => line.includes(`Falling back to long polling`)), logged.slice(0, 5))
  report.finish()
}

main().catch((err) => report.fail(err))
