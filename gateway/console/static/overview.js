// The system live: the overview (graphs of the last minutes, the figures now, the
// subscriptions with their state) and one stream's activity (its live readers on every
// gateway, its write rate). All of it from the gateway's JSON statistics, read from Redis,
// so every gateway shows the same; refreshed every few seconds while shown (and the tab is).

import { chart, niceCeiling } from "./charts.js";
import { formatAgo, formatBytes, formatTime } from "./views.js";

const REFRESH_MS = 5000;

function element(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

export function formatRate(n) {
  if (n == null) return "—";
  if (n >= 1000) return `${(n / 1000).toFixed(1)}k/s`;
  return `${n >= 10 || Number.isInteger(n) ? Math.round(n) : n.toFixed(1)}/s`;
}

function formatByteRate(n) {
  return n == null ? "—" : `${formatBytes(Math.round(n))}/s`;
}

// A round top for a scale of bytes: 1, 2 or 5 times a power of ten of a binary unit.
function byteCeiling(n) {
  const unit = 1024 ** Math.max(0, Math.floor(Math.log(Math.max(n, 1)) / Math.log(1024)));
  return niceCeiling(n / unit) * unit;
}

function formatCount(n) {
  return n == null ? "—" : String(Math.round(n * 10) / 10);
}

function formatSeconds(n) {
  if (n == null) return "—";
  return n < 10 ? `${n.toFixed(1)} s` : n < 120 ? `${Math.round(n)} s` : `${Math.round(n / 60)} min`;
}

function figures(list, pairs) {
  list.replaceChildren(...pairs.map(([name, value, note]) => {
    const dd = element("dd", {}, element("span", { className: "value", textContent: value }));
    if (note) dd.append(element("span", { className: "note", textContent: note }));
    return element("div", {}, element("dt", { textContent: name }), dd);
  }));
}

// Why the statistics could not be read, in words.
function refusal(err, what) {
  if (err.status === 401) return `Sign in to see ${what}.`;
  if (err.status === 403) {
    const needed = what === "the overview" ? "every stream" : "them";
    return `This token may not see ${what}: it needs read access to ${needed}.`;
  }
  if (err.status === 404) return "This server does not serve statistics.";
  return `Could not read ${what}: ${err.message}`;
}

// Runs `load` now and every REFRESH_MS while started and the tab is visible.
class Poller {
  constructor(load) {
    this.load = load;
    this.timer = 0;
    this.running = false;
    document.addEventListener("visibilitychange", () => {
      if (this.running && !document.hidden) this.kick();
    });
  }

  start() {
    this.running = true;
    this.kick();
  }

  stop() {
    this.running = false;
    clearTimeout(this.timer);
  }

  async kick() {
    clearTimeout(this.timer);
    if (!this.running || document.hidden) return;
    await this.load();
    clearTimeout(this.timer);
    if (this.running) this.timer = setTimeout(() => this.kick(), REFRESH_MS);
  }
}

// -- the overview ---------------------------------------------------------------------------

// [key, title, legend, format, scale options]
const CHARTS = [
  ["appends", "Appends per second", [], formatRate, { axis: formatCount }],
  ["bytes", "Bytes written per second", [], formatByteRate, { axis: formatBytes, ceiling: byteCeiling }],
  ["readers", "Live readers", [["SSE", "s1"], ["long-poll", "s2"]], formatCount, {}],
  ["lag", "Archive lag", [], formatSeconds, {}],
  ["backlog", "Subscription backlog", [], formatCount, {}],
];

function stateOf(sub) {
  const said = { failed: "failed", waking: "wake in flight", due: "due now", scheduled: "scheduled", idle: "idle" };
  return said[sub.state] || sub.state;
}

function subscriptionTable(found) {
  const now = found.now_ms;
  const columns = ["Subscription", "Type", "State", "Watches", "Pending", "Next"];
  const head = element("tr", {}, ...columns.map((name) => element("th", { scope: "col", textContent: name })));
  const rows = found.subscriptions.map((sub) => {
    const state = element("span", { className: `badge state-${sub.state}`, textContent: stateOf(sub) });
    const streams = `${sub.streams} stream${sub.streams === 1 ? "" : "s"}`;
    const watches = sub.pattern ? `${sub.pattern} (${sub.streams} linked)` : streams;
    const next = [];
    if (sub.next_at_ms != null) next.push(sub.next_at_ms <= now ? "now" : formatAgo(sub.next_at_ms));
    if (sub.backfill) next.push("linking the pattern's streams");
    if (sub.attempts) next.push(`attempt ${sub.attempts + 1}`);
    if (sub.holder) next.push(`held by ${sub.holder}`);
    return element(
      "tr",
      {},
      element("th", { scope: "row", textContent: sub.id }),
      element("td", { textContent: sub.type }),
      element("td", {}, state),
      element("td", { textContent: watches }),
      element("td", { textContent: String(sub.pending_streams) }),
      element("td", { textContent: next.join(" · ") || "—" }),
    );
  });
  const caption = `Subscriptions and their state${found.more ? ` (the first ${found.subscriptions.length})` : ""}`;
  return element(
    "table",
    { className: "data" },
    element("caption", { className: "visually-hidden", textContent: caption }),
    element("thead", {}, head),
    element("tbody", {}, ...rows),
  );
}

const TOP_TENANTS = 10;

function tenantTable(found) {
  const ofQuota = (usage, quotas, name, format) => {
    const limit = quotas[name];
    return `${format(usage[name] ?? 0)} / ${limit == null ? "—" : format(limit)}`;
  };
  const head = element("tr", {}, ...["Tenant", "Streams", "Stored", "Written this period", "Live connections"]
    .map((name) => element("th", { scope: "col", textContent: name })));
  const rows = found.tenants.map(({ tenant, usage, quotas }) => element(
    "tr",
    {},
    element("th", { scope: "row", textContent: tenant }),
    element("td", { textContent: ofQuota(usage, quotas, "streams", String) }),
    element("td", { textContent: ofQuota(usage, quotas, "stored_bytes", formatBytes) }),
    element("td", { textContent: ofQuota(usage, quotas, "written_bytes", formatBytes) }),
    element("td", { textContent: ofQuota(usage, quotas, "live_connections", String) }),
  ));
  return element(
    "table",
    { className: "data" },
    element("caption", { className: "visually-hidden", textContent: "Top tenants: usage and quotas" }),
    element("thead", {}, head),
    element("tbody", {}, ...rows),
  );
}

export class Overview {
  constructor(api, $) {
    this.api = api;
    this.$ = $;
    this.charts = new Map();
    for (const [key, title, legend] of CHARTS) {
      const made = chart(title, legend);
      this.charts.set(key, made);
      $("charts").append(made.node);
    }
    this.poller = new Poller(() => this.load());
    $("window").addEventListener("change", () => this.poller.kick());
  }

  start() {
    this.poller.start();
  }

  stop() {
    this.poller.stop();
  }

  async load() {
    const $ = this.$;
    const minutes = Number($("window").value);
    const [stats, subs, tenants] = await Promise.allSettled([
      this.api.stats(minutes), this.api.subscriptionStats(), this.api.topTenants(TOP_TENANTS),
    ]);
    $("tenants-panel").hidden = !this.api.config.tenants;
    if (tenants.status === "fulfilled" && tenants.value) {
      const found = tenants.value;
      $("tenants").replaceChildren(...(found.tenants.length ? [tenantTable(found)] : []));
      $("tenants-state").textContent = found.tenants.length ? "" : "No tenant has stored anything yet.";
    } else if (tenants.status === "rejected") {
      $("tenants").replaceChildren();
      $("tenants-state").textContent = tenants.reason.status === 403
        ? "This token may not see the tenants: it needs admin access to every stream."
        : refusal(tenants.reason, "the tenants");
    }
    if (stats.status === "fulfilled") {
      const found = stats.value;
      this.show(found, minutes);
      const gateways = `${found.processes} gateway process${found.processes === 1 ? "" : "es"} reporting`;
      const appends = `${found.totals.appends.toLocaleString()} appends in ${minutes} min`;
      $("overview-state").textContent = `${gateways} · ${appends} · updated ${new Date(found.now_ms).toLocaleTimeString()}`;
      $("overview").dataset.loaded = "true";
    } else {
      $("overview-state").textContent = refusal(stats.reason, "the overview");
    }
    if (subs.status === "fulfilled") {
      const found = subs.value;
      $("subs").replaceChildren(...(found.subscriptions.length ? [subscriptionTable(found)] : []));
      const counts = `${found.patterns} with a pattern · ${found.scheduled} with work scheduled · ${found.due} due now`;
      $("subs-state").textContent = found.subscriptions.length ? counts : `None to show (${counts})`;
    } else {
      $("subs").replaceChildren();
      $("subs-state").textContent = refusal(subs.reason, "subscriptions");
    }
  }

  show(stats, minutes) {
    const { series, now } = stats;
    const half = (stats.bucket_seconds * 1000) / 2;
    const times = series.start_ms.map((t) => t + half);
    const to = stats.now_ms;
    const from = to - minutes * 60 * 1000;
    const fromLabel = `${minutes} min ago`;
    const draw = (key, parts) => {
      const [, , , format, scale] = CHARTS.find(([name]) => name === key);
      const shown = parts.map(([values, cls, label]) => ({ times, values, cls, label }));
      this.charts.get(key).draw({ series: shown, from, to, format, fromLabel, ...scale });
    };
    draw("appends", [[series.appends_per_s, "s1", ""]]);
    draw("bytes", [[series.bytes_per_s, "s1", ""]]);
    draw("readers", [[series.sse, "s1", "SSE"], [series.long_poll, "s2", "long-poll"]]);
    draw("lag", [[series.archive_lag_s, "s3", ""]]);
    draw("backlog", [[series.subscription_backlog, "s3", ""]]);

    const { archive, subscriptions } = now;
    let lag = formatSeconds(archive.lag_seconds);
    let lagNote = "";
    if (archive.workers === false) [lag, lagNote] = ["—", "no archive worker running"];
    else if (archive.due_streams != null) lagNote = `${archive.due_streams} stream${archive.due_streams === 1 ? "" : "s"} due`;
    let backlogNote = "";
    if (subscriptions.workers === false) backlogNote = "no delivery worker running";
    else if (subscriptions.scheduled != null) backlogNote = `${subscriptions.scheduled} scheduled`;
    figures(this.$("figures"), [
      ["Appends", formatRate(now.appends_per_s), "last 10 s"],
      ["Written", formatByteRate(now.bytes_per_s), "last 10 s"],
      ["Live readers", String(now.sse + now.long_poll), `${now.sse} SSE · ${now.long_poll} long-poll`],
      ["Archive lag", lag, lagNote],
      ["Subscription backlog", formatCount(subscriptions.backlog), backlogNote],
    ]);
  }
}

// -- one stream's activity ------------------------------------------------------------------

export class Activity {
  constructor(api, $) {
    this.api = api;
    this.$ = $;
    this.path = null;
    this.chart = chart("Write rate", []);
    $("activity-chart").append(this.chart.node);
    this.poller = new Poller(() => this.load());
  }

  start(path) {
    this.path = path;
    figures(this.$("activity"), []);
    this.$("activity-state").textContent = "Loading…";
    this.poller.start();
  }

  stop() {
    this.path = null;
    this.poller.stop();
  }

  async load() {
    const path = this.path;
    if (!path) return;
    let found;
    try {
      found = await this.api.streamStats(path);
    } catch (err) {
      if (path === this.path) this.$("activity-state").textContent = refusal(err, "this stream's activity");
      return;
    }
    if (path !== this.path) return;
    const readers = found.readers == null ? "counting…" : String(found.readers);
    figures(this.$("activity"), [
      ["Live readers", readers, "SSE and long-poll, on every gateway"],
      ["Write rate", formatByteRate(found.bytes_per_s), "since the last look"],
      ["Last write", formatAgo(found.last_write_at_ms), found.last_write_at_ms ? formatTime(found.last_write_at_ms) : ""],
    ]);
    const from = found.sampled_since_ms;
    const minutes = Math.max(1, Math.round((found.now_ms - from) / 60000));
    this.chart.draw({
      series: [{ times: found.series.at_ms, values: found.series.bytes_per_s, cls: "s1", label: "" }],
      from,
      to: found.now_ms,
      format: formatByteRate,
      axis: formatBytes,
      ceiling: byteCeiling,
      fromLabel: found.now_ms - from < 60000 ? "since opened" : `${minutes} min ago`,
    });
    this.$("activity-state").textContent = `Sampled every ${REFRESH_MS / 1000} s while a console looks at it (kept 15 minutes)`;
  }
}
