// Upstream's official benchmark cases (packages/benchmarks/src/index.ts in the Durable
// Streams repository, not published on npm), run the same way with the official client,
// outside vitest: node loadtest/official.mjs <server root URL> [rounds]
// Prints one JSON object: each case's mean, p50 and p99 over its iterations.
import { DurableStream } from "@durable-streams/client"

const base = process.argv[2]
const rounds = Number(process.argv[3] ?? "1")
if (!base) {
  console.error("usage: node loadtest/official.mjs http://127.0.0.1:4437 [rounds]")
  process.exit(2)
}

const stats = (values) => {
  const sorted = [...values].sort((a, b) => a - b)
  const at = (p) => sorted[Math.min(sorted.length - 1, Math.floor(sorted.length * p))]
  return { mean: values.reduce((a, b) => a + b, 0) / values.length, p50: at(0.5), p99: at(0.99), n: values.length }
}
const name = (kind) => `${base}/v1/stream/${kind}-${Date.now()}-${Math.random().toString(36).slice(2)}`
const create = (kind) => DurableStream.create({ url: name(kind), contentType: "application/octet-stream" })

async function ping() {
  const started = performance.now()
  await (await fetch(`${base}/health`)).arrayBuffer() // a 404 here is fine: a bare round trip
  return performance.now() - started
}

// One long-poll read that resolves with its first data (as upstream's subscribeBytes loop).
async function firstData(stream, offset) {
  const res = await stream.stream({ offset, live: "long-poll" })
  return new Promise((resolve) => {
    const unsubscribe = res.subscribeBytes((chunk) => {
      if (chunk.data.length > 0) {
        unsubscribe()
        res.cancel()
        resolve(chunk.offset)
      }
      return Promise.resolve()
    })
  })
}

async function latency() {
  const stream = await create("latency-bench")
  const message = new Uint8Array(100).fill(42)
  let offset = (await stream.head()).offset
  const pingTime = await ping()
  const warm = firstData(stream, offset)
  await stream.append(message)
  offset = await warm
  const read = firstData(stream, offset)
  const started = performance.now()
  await stream.append(message)
  await read
  const total = performance.now() - started
  await stream.delete()
  return { total, overhead: total - pingTime }
}

async function throughput(kind, size, count, concurrency) {
  const stream = await create(kind)
  const message = new Uint8Array(size).fill(42)
  const started = performance.now()
  for (let batch = 0; batch < count / concurrency; batch++) {
    await Promise.all(Array.from({ length: concurrency }, () => stream.append(message)))
  }
  const seconds = (performance.now() - started) / 1000
  await stream.delete()
  return count / seconds
}

const out = { ping: [], latency_total: [], latency_overhead: [], small_msg_per_s: [], large_msg_per_s: [] }
for (let r = 0; r < rounds; r++) {
  for (let i = 0; i < 5; i++) out.ping.push(await ping())
  for (let i = 0; i < 10; i++) {
    const { total, overhead } = await latency()
    out.latency_total.push(total)
    out.latency_overhead.push(overhead)
  }
  for (let i = 0; i < 3; i++) out.small_msg_per_s.push(await throughput("msg-small", 100, 1000, 75))
  for (let i = 0; i < 2; i++) out.large_msg_per_s.push(await throughput("msg-large", 1024 * 1024, 50, 15))
}
console.log(JSON.stringify(Object.fromEntries(Object.entries(out).map(([k, v]) => [k, stats(v)]))))
