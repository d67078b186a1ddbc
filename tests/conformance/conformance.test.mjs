// The official suite, pointed at a running gateway. (The package's own --run
// CLI finds no test files when installed under node_modules, so we call
// runConformanceTests from a local vitest file instead.)
//
// With CONFORMANCE_TOKEN set (run.py --auth: a gateway with access control on),
// every request the suite makes carries it as a bearer token: the suite and its
// client call the global fetch, wrapped here before they are imported.
const token = process.env.CONFORMANCE_TOKEN
if (token) {
  const originalFetch = globalThis.fetch
  globalThis.fetch = (input, init = {}) => {
    const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined))
    if (!headers.has("authorization")) headers.set("authorization", `Bearer ${token}`)
    return originalFetch(input, { ...init, headers })
  }
}

const { runConformanceTests } = await import("@durable-streams/server-conformance-tests")

// subscriptions: the reserved __ds/subscriptions APIs and their delivery (protocol
// sections 6-7), which upstream's suite runs only when asked, as upstream runs it.
runConformanceTests({
  baseUrl: process.env.CONFORMANCE_BASE_URL ?? "http://127.0.0.1:4437",
  subscriptions: true,
})
