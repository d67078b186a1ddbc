// JS client appends on a byte stream: concurrent `DurableStream.append` calls with batching on
// (the default: calls that overlap a request in flight are sent together as ONE POST), as
// upstream's benchmark makes them (packages/benchmarks: rounds of 75 concurrent 100-byte appends,
// rounds of 15 concurrent 1 MiB appends), then a round mixing both, then `close()`. Every message
// has its own bytes; the stream read back must be exactly the messages, each once, in call order.
//
//   node appends.mjs http://127.0.0.1:4437/v1/stream

import { DurableStream, stream } from "@durable-streams/client"
import { Report, baseUrlFromArgs, countRequests, describeError, uniqueName } from "./lib.mjs"

const SMALL = { size: 100, count: 1500, concurrency: 75 }
const LARGE = { size: 1024 * 1024, count: 60, concurrency: 15 }
const MIXED = { large: 5, smallPerLarge: 30 } // one round: 5 x (1 MiB, then 30 small), all concurrent

const report = new Report(`appends`)
const base = baseUrlFromArgs()
const url = `${base}/${uniqueName(`appends`)}`
const requests = countRequests()
report.watchdog(300, () => ({ requests }))

const expected = [] // every message's bytes, in call order
let nextId = 0

/** A message of `size` bytes that names itself: "#<id>#" then bytes that depend on the id. */
function message(size) {
  const id = nextId++
  const bytes = new Uint8Array(size)
  bytes.fill(id % 251)
  const label = new TextEncoder().encode(`#${id}#`)
  bytes.set(label.subarray(0, Math.min(label.length, size)))
  expected.push(bytes)
  return bytes
}

async function rounds(handle, { size, count, concurrency }, phase) {
  for (let done = 0; done < count; done += concurrency) {
    const n = Math.min(concurrency, count - done)
    const calls = Array.from({ length: n }, () => handle.append(message(size)))
    const results = await Promise.allSettled(calls)
    const failed = results.filter((r) => r.status === `rejected`)
    if (failed.length > 0) {
      report.check(`${phase}: every append succeeded`, false,
        `${failed.length} of ${n} appends in a round failed: ${describeError(failed[0].reason)}`)
      report.set(`requests`, requests)
      report.finish()
    }
  }
  report.check(`${phase}: every append succeeded`, true)
}

async function main() {
  const handle = await DurableStream.create({ url, contentType: `application/octet-stream` })
  await rounds(handle, SMALL, `small appends (${SMALL.count} x ${SMALL.size} B, ${SMALL.concurrency} at a time)`)
  const postsAfterSmall = requests.posts
  await rounds(handle, LARGE, `1 MiB appends (${LARGE.count}, ${LARGE.concurrency} at a time)`)
  const calls = []
  for (let k = 0; k < MIXED.large; k++) {
    calls.push(handle.append(message(1024 * 1024)))
    for (let s = 0; s < MIXED.smallPerLarge; s++) calls.push(handle.append(message(SMALL.size)))
  }
  const mixed = await Promise.allSettled(calls)
  const mixedFailed = mixed.filter((r) => r.status === `rejected`)
  report.check(`mixed round: every append succeeded`, mixedFailed.length === 0,
    mixedFailed.length ? `${mixedFailed.length} of ${calls.length} failed: ${describeError(mixedFailed[0].reason)}` : undefined)
  try {
    await handle.close()
    report.check(`close() closed the stream`, true)
  } catch (err) {
    report.check(`close() closed the stream`, false, describeError(err))
  }

  const want = Buffer.concat(expected)
  // The default live mode: body() follows the offsets until up to date (live: false reads one response).
  const got = Buffer.from(await (await stream({ url, offset: `-1` })).body())
  let detail
  if (!got.equals(want)) {
    let at = 0
    while (at < Math.min(got.length, want.length) && got[at] === want[at]) at++
    let start = 0
    let which = 0
    while (which < expected.length && start + expected[which].length <= at) start += expected[which++].length
    detail = { storedBytes: got.length, expectedBytes: want.length, firstDifferenceAt: at, inMessage: which,
      messageStartsAt: start, storedThere: got.subarray(at, at + 16).toString(`latin1`) }
  }
  report.check(`stored: every message's bytes once, in call order`, detail === undefined, detail)
  const head = await handle.head()
  report.check(`stream is closed`, head.streamClosed === true, head)
  report.set(`messages`, expected.length)
  report.set(`bytes`, want.length)
  report.set(`postsForSmallAppends`, postsAfterSmall)
  report.set(`requests`, requests)
  report.finish()
}

main().catch((err) => report.fail(err))
