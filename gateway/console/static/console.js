// The console page: the overview (overview.js), the stream list, one stream's details and
// activity, reads, the live tail, appends, and create/close/delete/fork. Every value from
// the server or a stream goes into the page as text (textContent), never as HTML.

import { Api } from "./api.js";
import { Activity, Overview } from "./overview.js";
import { LiveTail } from "./tail.js";
import { defaultView, formatAgo, formatBytes, formatTime, render, rows } from "./views.js";

const $ = (id) => document.getElementById(id);
const PAGE_SIZE = 100; // streams per listing request
const TAIL_ROWS = 500; // rows the live log keeps
const PRODUCER_ROWS = 100; // producers the table shows (the server sends up to 1,000)

const state = {
  api: null,
  prefix: "",
  cursor: null,
  listed: new Map(), // path -> listing entry
  path: null,
  info: null, // HEAD of the open stream
  page: null, // the last catch-up read
  tail: null,
  declined: false, // the user went on without a token
  overview: null, // the overview's graphs, refreshed while shown
  activity: null, // the open stream's readers and write rate, refreshed while open
};

// -- messages -----------------------------------------------------------------------------

function say(text) {
  $("notice").textContent = text;
}

function problem(err) {
  const box = $("problem");
  box.hidden = !err;
  box.textContent = err ? err.message || String(err) : "";
  // A refused token, or none after the user chose to go on without one: asked once, not nagged.
  if (err && err.status === 401 && state.api && (state.api.token || !state.declined)) {
    askToken().then((signedIn) => signedIn && act(reload));
  }
}

// Runs a user action: its error is shown, the button that started it is off meanwhile.
async function act(fn, button) {
  problem(null);
  if (button) button.disabled = true;
  try {
    await fn();
  } catch (err) {
    problem(err);
  } finally {
    if (button) button.disabled = false;
  }
}

function element(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

// -- sign in ------------------------------------------------------------------------------

function updateSession() {
  const signedIn = Boolean(state.api.token);
  $("session-state").textContent = signedIn ? "Signed in with a token" : "Not signed in";
  $("sign-in").hidden = signedIn;
  $("sign-out").hidden = !signedIn;
}

// Resolves true once a token was given, false when the dialog was dismissed.
function askToken() {
  const dialog = $("token-dialog");
  if (!state.api.config.auth || dialog.open) return Promise.resolve(false);
  $("token-input").value = "";
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      state.declined = dialog.returnValue !== "ok";
      resolve(!state.declined);
    }, { once: true });
  });
}

function tokenGiven(event) {
  event.preventDefault();
  const value = $("token-input").value.trim();
  if (!value) return;
  state.api.token = value;
  updateSession();
  say("Signed in");
  $("token-dialog").close("ok");
}

function signOut() {
  state.api.token = "";
  stopTail();
  updateSession();
  say("Signed out");
  act(() => reload());
}

// -- the list -----------------------------------------------------------------------------

function hashFor(path) {
  return `#/s/${encodeURIComponent(path)}`;
}

function listItem(entry) {
  const link = element("a", { href: hashFor(entry.path) }, element("span", { className: "path", textContent: entry.path }));
  if (entry.status === "closed") link.append(element("span", { className: "badge closed", textContent: "closed" }));
  const facts = [entry.content_type, formatBytes(entry.bytes)];
  if (entry.last_write_at_ms) facts.push(`written ${formatAgo(entry.last_write_at_ms)}`);
  link.append(element("span", { className: "facts", textContent: facts.join(" · ") }));
  if (entry.path === state.path) link.setAttribute("aria-current", "true");
  return element("li", {}, link);
}

async function loadList(more = false) {
  if (!more) {
    state.cursor = null;
    state.listed.clear();
  }
  $("list-state").textContent = "Loading…";
  let page;
  try {
    page = await state.api.list(state.prefix, state.cursor, PAGE_SIZE);
  } catch (err) {
    $("list-state").textContent = err.status === 404 ? "This server does not list streams." : "Could not list streams.";
    if (!more) $("stream-list").replaceChildren();
    $("more").hidden = true;
    throw err;
  }
  const items = page.streams.map((entry) => {
    state.listed.set(entry.path, entry);
    return listItem(entry);
  });
  if (more) $("stream-list").append(...items);
  else $("stream-list").replaceChildren(...items);
  state.cursor = page.next_cursor;
  $("more").hidden = !page.has_more;
  const count = state.listed.size;
  const where = state.prefix ? ` under “${state.prefix}”` : "";
  $("list-state").textContent = count
    ? `${count} stream${count === 1 ? "" : "s"}${where}${page.has_more ? ", more to load" : ""}`
    : `No streams${where}`;
}

function updateListed(entry) {
  state.listed.set(entry.path, entry);
  const href = hashFor(entry.path);
  const link = [...$("stream-list").querySelectorAll("a")].find((a) => a.getAttribute("href") === href);
  if (link) link.parentElement.replaceWith(listItem(entry));
}

function markCurrent() {
  for (const link of $("stream-list").querySelectorAll("a")) {
    if (link.getAttribute("href") === hashFor(state.path)) link.setAttribute("aria-current", "true");
    else link.removeAttribute("aria-current");
  }
}

// -- one stream ---------------------------------------------------------------------------

function stopTail() {
  if (state.tail) state.tail.stop();
  state.tail = null;
}

function showNothing({ focus = false } = {}) {
  stopTail();
  state.activity.stop();
  state.path = null;
  state.info = null;
  $("detail").hidden = true;
  $("overview").hidden = false;
  $("overview-link").setAttribute("aria-current", "page");
  markCurrent();
  state.overview.start();
  if (focus) $("overview-title").focus();
}

async function open(path, { focus = true } = {}) {
  stopTail();
  state.path = path;
  state.page = null;
  markCurrent();
  state.overview.stop();
  $("overview").hidden = true;
  $("overview-link").removeAttribute("aria-current");
  $("detail").hidden = false;
  $("detail-title").textContent = path;
  for (const id of ["read-output", "tail-log"]) $(id).replaceChildren();
  for (const id of ["read-state", "append-state"]) $(id).textContent = "";
  $("tail-state").textContent = "Stopped";
  $("next-page").disabled = true;
  $("read-offset").value = "-1";
  if (focus) $("detail-title").focus();
  state.activity.start(path);
  try {
    await refresh();
  } catch (err) {
    if (path === state.path) {
      // e.g. a link to a stream deleted since: no stream open, and its link works again
      history.replaceState(null, "", location.pathname + location.search);
      showNothing();
    }
    throw err;
  }
  $("view").value = defaultView(state.info.contentType);
  $("append-type").value = state.info.contentType;
  await readPage("-1");
}

async function detail(path) {
  try {
    return await state.api.info(path);
  } catch {
    return state.listed.get(path) || null; // a server without it: HEAD (and the list) alone
  }
}

function producerTable(entry) {
  const shown = entry.producers.slice(0, PRODUCER_ROWS);
  const head = element("tr", {}, ...["Producer-Id", "Epoch", "Last Producer-Seq"].map((name) => element("th", { scope: "col", textContent: name })));
  const body = shown.map((p) => element("tr", {}, element("td", { textContent: p.id }), element("td", { textContent: String(p.epoch) }), element("td", { textContent: String(p.seq) })));
  const more = entry.producer_count - shown.length;
  const caption = `Idempotent producers: ${entry.producer_count}${more > 0 ? ` (the first ${shown.length} shown)` : ""}`;
  return element("table", { className: "producers" }, element("caption", { textContent: caption }), element("thead", {}, head), element("tbody", {}, ...body));
}

// A compacted stream's compaction so far (the listing's "compaction": docs/compaction.md).
function compactionFacts(c) {
  const facts = [["Compaction", `${c.mode}: ${c.ratio}x (bytes written per byte kept)`]];
  facts.push(["Compacted to", c.compacted_to_offset]);
  facts.push(["Dropped", `${c.dropped_messages} messages, ${formatBytes(c.dropped_bytes)}`]);
  facts.push(["Last compacted", c.last_run_at_ms ? formatTime(c.last_run_at_ms) : "not yet"]);
  facts.push(["Not folded yet", formatBytes(c.lag_bytes)]);
  return facts;
}

async function refresh() {
  const path = state.path;
  const [info, entry] = await Promise.all([state.api.head(path), detail(path)]);
  if (path !== state.path) return;
  state.info = info;
  if (entry && state.listed.has(path)) updateListed(entry);
  const facts = [
    ["Content type", info.contentType],
    ["Status", info.closed ? "closed" : "open"],
    ["Next offset", info.nextOffset],
  ];
  if (entry) {
    facts.push(["Size", formatBytes(entry.bytes)], ["Created", formatTime(entry.created_at_ms)]);
    facts.push(["Last write", formatTime(entry.last_write_at_ms)]);
    if (entry.forked_from) facts.push(["Forked from", entry.forked_from]);
    if (entry.compaction) facts.push(...compactionFacts(entry.compaction));
  }
  if (info.ttl) facts.push(["Time to live", `${info.ttl} s (sliding)`]);
  if (info.expiresAt) facts.push(["Expires at", info.expiresAt]);
  const producers = entry && Array.isArray(entry.producers);
  if (!producers) facts.push(["Producers", entry ? "shown to credentials that may write this stream" : "not shown by this server"]);
  else if (!entry.producer_count) facts.push(["Producers", "none"]);
  $("meta").replaceChildren(...facts.flatMap(([name, value]) => [
    element("dt", { textContent: name }),
    element("dd", { textContent: value }),
  ]));
  $("producers").replaceChildren(...(producers && entry.producer_count ? [producerTable(entry)] : []));
  $("close").disabled = info.closed;
}

function showPage() {
  const page = state.page;
  if (!page) return;
  const view = $("view").value;
  const { text, note } = render(page.bytes, view);
  $("read-output").textContent = text;
  $("read-output").classList.toggle("hex", view === "hex");
  const facts = [`${formatBytes(page.bytes.length)} from offset ${page.offset}`, `next offset ${page.nextOffset}`];
  if (page.upToDate) facts.push("up to date");
  if (page.closed) facts.push("stream closed");
  if (note) facts.push(note);
  $("read-state").textContent = facts.join(" · ");
}

async function readPage(offset) {
  const path = state.path;
  const page = await state.api.read(path, offset);
  if (path !== state.path) return;
  state.page = { ...page, offset };
  $("read-offset").value = offset;
  $("next-page").disabled = !page.nextOffset;
  showPage();
}

function addTailRows(bytes, contentType) {
  const log = $("tail-log");
  const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 8;
  const time = new Date().toLocaleTimeString();
  const view = $("view").value;
  for (const row of rows(bytes, contentType, view)) {
    const data = element("span", { className: view === "hex" ? "data hex" : "data", textContent: row });
    log.append(element("li", {}, element("time", { textContent: time }), data));
  }
  while (log.childElementCount > TAIL_ROWS) log.firstElementChild.remove();
  if (atEnd) log.scrollTop = log.scrollHeight;
}

function toggleTail() {
  const button = $("tail-toggle");
  if (state.tail && state.tail.running) {
    stopTail();
    return;
  }
  const path = state.path;
  const { contentType } = state.info;
  state.tail = new LiveTail(state.api, path, contentType, {
    data: (bytes) => addTailRows(bytes, contentType),
    state(text, kind) {
      const running = kind === "live" || kind === "waiting";
      $("tail-state").textContent = text;
      $("tail-state").dataset.kind = kind;
      button.textContent = running ? "Stop tail" : "Start tail";
      button.setAttribute("aria-pressed", String(running));
      if (kind === "closed" && path === state.path) act(refresh);
    },
  });
  state.tail.start($("tail-from").value);
}

// -- changes ------------------------------------------------------------------------------

function confirmed(title, text, ok) {
  const dialog = $("confirm-dialog");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-ok").textContent = ok;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}

function go(path) {
  if (path) location.hash = hashFor(path);
  else {
    history.pushState(null, "", location.pathname + location.search);
    showNothing();
  }
}

async function create(event) {
  event.preventDefault();
  const form = event.target;
  const path = $("create-path").value.trim();
  const created = await state.api.create(path, {
    contentType: $("create-type").value.trim(),
    ttl: $("create-ttl").value.trim(),
    closed: $("create-closed").checked,
  });
  say(created ? `Created ${path}` : `${path} exists already, configured the same way`);
  form.reset();
  await loadList();
  go(path);
}

async function append(event) {
  event.preventDefault();
  const path = state.path;
  const data = $("append-data").value;
  const id = $("producer-id").value.trim();
  const producer = id ? { id, epoch: Number($("producer-epoch").value || 0), seq: Number($("producer-seq").value || 0) } : null;
  const result = await state.api.append(path, $("append-type").value.trim(), data, producer);
  let text = `Appended to ${path}: next offset ${result.nextOffset}`;
  if (producer) {
    const duplicate = result.status === 204;
    text = duplicate ? `A duplicate: ${id} sent seq ${producer.seq} before (not appended again)` : text;
    text += ` · producer epoch ${result.producerEpoch}, seq ${result.producerSeq}`;
    if (!duplicate) $("producer-seq").value = String(producer.seq + 1);
  }
  $("append-state").textContent = text;
  $("append-data").value = "";
  await refresh();
}

async function closeStream() {
  const path = state.path;
  if (!(await confirmed("Close stream?", `Close ${path}? Nothing can be appended after, and readers get the end of the stream.`, "Close stream"))) return;
  await state.api.close(path);
  say(`Closed ${path}`);
  await refresh();
  await loadList();
}

async function deleteStream() {
  const path = state.path;
  if (!(await confirmed("Delete stream?", `Delete ${path} and all its data? This cannot be undone.`, "Delete stream"))) return;
  stopTail();
  await state.api.remove(path);
  say(`Deleted ${path}`);
  go(null);
  await loadList();
}

function askFork() {
  $("fork-text").textContent = `A new stream holding the data of ${state.path} up to an offset.`;
  $("fork-path").value = `${state.path}-fork`;
  $("fork-offset").value = state.page ? state.page.nextOffset : "";
  $("fork-dialog").showModal();
}

async function fork(event) {
  event.preventDefault();
  const dialog = $("fork-dialog");
  if (event.submitter && event.submitter.value === "cancel") {
    dialog.close();
    return;
  }
  const source = state.path;
  const path = $("fork-path").value.trim();
  const created = await state.api.fork(path, source, $("fork-offset").value.trim());
  dialog.close();
  say(created ? `Forked ${source} into ${path}` : `${path} exists already as the same fork`);
  await loadList();
  go(path);
}

// -- wiring -------------------------------------------------------------------------------

function route() {
  const hash = location.hash;
  if (hash.startsWith("#/s/")) {
    const path = decodeURIComponent(hash.slice(4));
    if (path !== state.path) act(() => open(path, { focus: true }));
  } else if (!hash || hash === "#" || hash === "#/") {
    showNothing({ focus: Boolean(state.info) || hash === "#/" });
  }
}

async function reload() {
  await loadList();
  if (state.path) await open(state.path, { focus: false });
  else state.overview.start();
}

function wire() {
  $("search").addEventListener("submit", (event) => {
    event.preventDefault();
    state.prefix = $("search-prefix").value;
    act(() => loadList());
  });
  $("more").addEventListener("click", (event) => act(() => loadList(true), event.currentTarget));
  $("create").addEventListener("submit", (event) => act(() => create(event), event.submitter));
  $("refresh").addEventListener("click", (event) => act(async () => {
    await Promise.all([refresh(), state.activity.poller.kick()]);
    say(`Refreshed ${state.path}`);
  }, event.currentTarget));
  $("read").addEventListener("submit", (event) => {
    event.preventDefault();
    act(() => readPage($("read-offset").value.trim() || "-1"), event.submitter);
  });
  $("next-page").addEventListener("click", (event) => act(() => readPage(state.page.nextOffset), event.currentTarget));
  $("view").addEventListener("change", showPage);
  $("tail-toggle").addEventListener("click", toggleTail);
  $("tail-clear").addEventListener("click", () => $("tail-log").replaceChildren());
  $("append").addEventListener("submit", (event) => act(() => append(event), event.submitter));
  // No button to switch off: the confirmation is modal, and refresh() decides "Close…".
  $("close").addEventListener("click", () => act(closeStream));
  $("delete").addEventListener("click", () => act(deleteStream));
  $("fork").addEventListener("click", askFork);
  $("fork-form").addEventListener("submit", (event) => act(() => fork(event), event.submitter));
  $("token-form").addEventListener("submit", tokenGiven);
  $("token-cancel").addEventListener("click", () => $("token-dialog").close("cancel"));
  $("sign-in").addEventListener("click", () => askToken().then((signedIn) => signedIn && act(reload)));
  $("sign-out").addEventListener("click", signOut);
  document.querySelector(".skip").addEventListener("click", (event) => {
    event.preventDefault(); // the hash names the open stream: not a place for a fragment
    ($("detail").hidden ? $("overview-title") : $("detail-title")).focus();
  });
  window.addEventListener("hashchange", route);
}

async function main() {
  const response = await fetch("config.json", { cache: "no-cache" });
  state.api = new Api(await response.json(), location.href);
  state.overview = new Overview(state.api, $);
  state.activity = new Activity(state.api, $);
  wire();
  if (state.api.config.auth) {
    $("session").hidden = false;
    updateSession();
    if (!state.api.token) await askToken(); // then the list, with or without a token
  }
  await act(loadList);
  route();
}

main().catch(problem);
