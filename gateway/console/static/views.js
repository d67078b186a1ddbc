// Bytes as the console shows them: text, pretty JSON, or a hex dump. Stream data is
// untrusted: callers put the result in textContent, never in HTML.

const TEXT = new TextDecoder("utf-8"); // bad sequences become U+FFFD, never an error
const SHOWN = { text: 1 << 20, json: 1 << 20, hex: 64 << 10 }; // a page is up to 4 MiB: keep the DOM small

export function mediaType(contentType) {
  return (contentType || "").split(";")[0].trim().toLowerCase();
}

export function isJson(contentType) {
  return mediaType(contentType) === "application/json";
}

// As the server decides (protocol section 5.8): SSE data of other types arrives base64.
export function isText(contentType) {
  const media = mediaType(contentType);
  return media.startsWith("text/") || media === "application/json";
}

export function defaultView(contentType) {
  if (isJson(contentType)) return "json";
  return isText(contentType) ? "text" : "hex";
}

export function fromBase64(text) {
  const raw = atob(text.replace(/[\r\n]/g, ""));
  return Uint8Array.from(raw, (c) => c.charCodeAt(0));
}

export function hexDump(bytes, start = 0) {
  const lines = [];
  for (let at = 0; at < bytes.length; at += 16) {
    const row = bytes.subarray(at, at + 16);
    const hex = Array.from(row, (b) => b.toString(16).padStart(2, "0")).join(" ");
    const ascii = Array.from(row, (b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : ".")).join("");
    lines.push(`${(start + at).toString(16).padStart(8, "0")}  ${hex.padEnd(47)}  |${ascii}|`);
  }
  return lines.join("\n");
}

function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    // not one JSON document: JSON lines, one per line
  }
  const lines = text.split("\n").filter((line) => line.trim());
  return lines.map((line) => JSON.stringify(JSON.parse(line), null, 2)).join("\n");
}

// A catch-up page: { text, note } (note: what was left out or could not be shown).
export function render(bytes, view) {
  const limit = SHOWN[view];
  const shown = bytes.length > limit ? bytes.subarray(0, limit) : bytes;
  let note = shown.length < bytes.length ? `showing the first ${shown.length} of ${bytes.length} bytes` : "";
  if (view === "hex") return { text: hexDump(shown), note };
  const text = TEXT.decode(shown);
  if (view === "json" && shown.length === bytes.length) {
    try {
      return { text: pretty(text), note };
    } catch (err) {
      note = `not JSON (${err.message}): shown as text`;
    }
  }
  return { text, note };
}

// One live data event as rows: a JSON stream's event is an array of messages, one row each.
export function rows(bytes, contentType, view) {
  if (view === "hex") return [hexDump(bytes)];
  const text = TEXT.decode(bytes);
  if (isJson(contentType)) {
    try {
      const messages = JSON.parse(text);
      if (Array.isArray(messages)) {
        return messages.map((m) => (view === "json" ? JSON.stringify(m, null, 2) : JSON.stringify(m)));
      }
    } catch {
      // shown as it came
    }
  }
  return [text];
}

export function formatBytes(n) {
  if (n == null) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit ? `${value.toFixed(1)} ${units[unit]}` : `${n} B`;
}

export function formatTime(ms) {
  return ms == null ? "—" : new Date(ms).toLocaleString();
}

const AGO = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
const STEPS = [[60, "second"], [60, "minute"], [24, "hour"], [30, "day"]];

export function formatAgo(ms) {
  if (ms == null) return "—";
  let amount = Math.round((ms - Date.now()) / 1000);
  for (const [size, unit] of STEPS) {
    if (Math.abs(amount) < size) return AGO.format(amount, unit);
    amount = Math.round(amount / size);
  }
  return new Date(ms).toLocaleDateString();
}
