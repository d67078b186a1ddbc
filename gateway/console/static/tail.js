// A live tail over SSE (EventSource). The server ends each response after a while (and
// when a signed URL expires); EventSource would reconnect at the offset it started from,
// replaying data, so each end closes it and a new one opens at the last control event's
// offset, with a freshly signed URL when a token is in use.

import { ApiError } from "./api.js";
import { fromBase64, isText } from "./views.js";

const MAX_BACKOFF_MS = 10_000;

export class LiveTail {
  // on.data(bytes), on.state(text, kind): kind is "live", "waiting", "closed", "stopped" or "error".
  constructor(api, path, contentType, on) {
    this.api = api;
    this.path = path;
    this.text = isText(contentType);
    this.on = on;
    this.source = null;
    this.timer = 0;
    this.failures = 0;
    this.running = false;
  }

  start(offset) {
    this.offset = offset;
    this.cursor = "";
    this.running = true;
    this.failures = 0;
    this.on.state("Connecting…", "waiting");
    this.connect();
  }

  stop(text = "Stopped", kind = "stopped") {
    this.running = false;
    clearTimeout(this.timer);
    if (this.source) this.source.close();
    this.source = null;
    this.on.state(text, kind);
  }

  async url() {
    const token = this.api.token;
    if (token && !this.api.config.signed_urls) {
      throw new ApiError(-1, "A live tail with a token needs signed URLs: the server has no --auth-signing-key-file");
    }
    const url = token ? await this.api.signedReadUrl(this.path) : this.api.streamUrl(this.path);
    url.searchParams.set("offset", this.offset);
    url.searchParams.set("live", "sse");
    if (this.cursor) url.searchParams.set("cursor", this.cursor);
    return url;
  }

  async connect() {
    let url;
    try {
      url = await this.url();
    } catch (err) {
      this.failed(err);
      return;
    }
    if (!this.running) return;
    const source = new EventSource(url);
    this.source = source;
    let opened = false;
    source.addEventListener("open", () => {
      opened = true;
    });
    source.addEventListener("data", (event) => {
      this.on.data(this.text ? new TextEncoder().encode(event.data) : fromBase64(event.data));
    });
    source.addEventListener("control", (event) => {
      const control = JSON.parse(event.data);
      this.offset = control.streamNextOffset;
      this.cursor = control.streamCursor || "";
      this.failures = 0;
      if (control.streamClosed) {
        this.stop("The stream is closed: no more data will come", "closed");
      } else if (control.upToDate) {
        this.on.state(`Live: up to date at ${this.offset}`, "live");
      } else {
        this.on.state(`Catching up: at ${this.offset}`, "waiting");
      }
    });
    source.addEventListener("error", () => {
      source.close();
      if (this.source !== source || !this.running) return;
      if (opened) {
        this.retry(0); // the server ended the response: carry on where it left us
      } else {
        this.diagnose();
      }
    });
  }

  // EventSource tells nothing about a refusal: ask the stream itself why.
  async diagnose() {
    try {
      await this.api.head(this.path);
    } catch (err) {
      if ([401, 403, 404, 410].includes(err.status)) {
        this.stop(err.message, "error");
        return;
      }
    }
    this.failures += 1;
    this.retry(Math.min(MAX_BACKOFF_MS, 500 * 2 ** this.failures));
  }

  failed(err) {
    if ([-1, 401, 403, 404, 410].includes(err.status)) {
      this.stop(err.message, "error");
    } else {
      this.failures += 1;
      this.retry(Math.min(MAX_BACKOFF_MS, 500 * 2 ** this.failures));
    }
  }

  retry(delay) {
    if (!this.running) return;
    if (delay) this.on.state(`Reconnecting in ${Math.round(delay / 1000)} s…`, "waiting");
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), delay);
  }
}
