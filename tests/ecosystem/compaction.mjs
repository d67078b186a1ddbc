// The referee of State compaction (docs/compaction.md): @durable-streams/state's own materializers
// fed with histories and with what compaction kept of them. tests/test_compaction_rules.py writes
// the cases and compares the states this prints.
//
//   node compaction.mjs cases.json
//
// cases.json: {"cases": [{"history": [message, ...], "readers": [[segment, ...], ...],
//                         "db": {"full": url, "compacted": url} | null}, ...]}
// A segment is {"restart": bool, "messages": [...]}: a reader applies segments in turn to one
// MaterializedState (clearing it on a `reset` control event, as an application does), starting
// over with an empty one where a segment says `restart`. `db` names two streams on a server (the
// history as written, and what compaction kept of it) that createStreamDB (@durable-streams/state/db,
// TanStack DB collections) reads from -1. Prints one JSON line: {"ok": true, "cases": [{"reference":
// state, "readers": [state, ...], "db": {"full": rows, "compacted": rows} | null}, ...]}, a state as
// sorted [type, key, value] triples, rows as each collection's [key, value] in StreamDB's own
// order (`_seq`), without the fields StreamDB adds.

import { readFileSync } from "node:fs"
import { MaterializedState, createStateSchema, isChangeEvent, isControlEvent } from "@durable-streams/state"
import { createStreamDB } from "@durable-streams/state/db"

const anyObject = { "~standard": { version: 1, vendor: `referee`, validate: (value) => ({ value }) } }
const schema = createStateSchema({
  users: { schema: anyObject, type: `user`, primaryKey: `id` },
  tasks: { schema: anyObject, type: `task`, primaryKey: `id` },
})

function isStateEvent(message) {
  return message !== null && typeof message === `object` && !Array.isArray(message) &&
    message.headers !== null && typeof message.headers === `object`
}

function applyAll(state, messages) {
  for (const message of messages) {
    if (!isStateEvent(message)) continue
    if (isChangeEvent(message)) state.apply(message)
    else if (isControlEvent(message) && message.headers.control === `reset`) state.clear()
  }
}

function snapshot(state) {
  const out = []
  for (const type of state.types) for (const [key, value] of state.getType(type)) out.push([type, key, value])
  return out.sort((a, b) => (a[0] + `\u0000` + a[1] < b[0] + `\u0000` + b[1] ? -1 : 1))
}

function replay(segments) {
  let state = new MaterializedState()
  for (const segment of segments) {
    if (segment.restart) state = new MaterializedState()
    applyAll(state, segment.messages)
  }
  return snapshot(state)
}

async function dbRows(url) {
  const db = createStreamDB({ streamOptions: { url, contentType: `application/json` }, state: schema })
  try {
    await db.preload()
    const rows = {}
    for (const name of [`users`, `tasks`]) {
      rows[name] = [...db.collections[name].state.values()]
        .sort((a, b) => a._seq - b._seq)
        .map((row) => [row.id, Object.fromEntries(Object.entries(row).filter(([k]) => k !== `_seq` && !k.startsWith(`$`)))])
    }
    return rows
  } finally {
    db.close()
  }
}

const { cases } = JSON.parse(readFileSync(process.argv[2], `utf8`))
const results = []
for (const c of cases) {
  results.push({
    reference: replay([{ restart: true, messages: c.history }]),
    readers: c.readers.map(replay),
    db: c.db ? { full: await dbRows(c.db.full), compacted: await dbRows(c.db.compacted) } : null,
  })
}
console.log(JSON.stringify({ ok: true, cases: results }))
