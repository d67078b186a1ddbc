// The npm reference server for side-by-side runs.
// usage: node reference-server.mjs <port> [dataDir]   (dataDir: file-backed, its durable mode)
import { DurableStreamTestServer } from "@durable-streams/server"

const [port, dataDir] = process.argv.slice(2)
// webhooks: webhook subscriptions (off by default in 0.3.7); loadtest/subscriptions.py uses them.
const server = new DurableStreamTestServer({ port: Number(port), host: "127.0.0.1", dataDir, webhooks: true })
await server.start()
console.log(`reference server on ${server.url}${dataDir ? ` (file-backed in ${dataDir})` : " (in memory)"}`)
