// The official suite, pointed at a running gateway. (The package's own --run
// CLI finds no test files when installed under node_modules, so we call
// runConformanceTests from a local vitest file instead.)
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.CONFORMANCE_BASE_URL ?? "http://127.0.0.1:4437",
})
