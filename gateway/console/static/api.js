// The requests the console makes: the protocol's own, the listing, and /auth/sign for
// live tails. The bearer token lives in sessionStorage (this tab only) and travels in
// the Authorization header, never in a URL (URLs end up in logs and histories).

const TOKEN_KEY = "durable-streams-console-token";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// What a refusal says to a person: the status class in words, then the server's reason.
const REASONS = {
  0: "The server could not be reached",
  400: "Bad request",
  401: "Not signed in, or the token was not accepted",
  403: "This token may not do that",
  404: "Not found",
  409: "Conflict",
  410: "Gone",
  413: "Too large",
  429: "Rate limited: try again shortly",
  503: "The server is unavailable: try again shortly",
  504: "The server timed out (the outcome is unknown)",
};

async function refusal(response) {
  let detail = "";
  try {
    detail = (await response.text()).trim().slice(0, 300);
  } catch {
    // the body is only a detail
  }
  const reason = REASONS[response.status] || `HTTP ${response.status}`;
  return new ApiError(response.status, detail ? `${reason} (${response.status}: ${detail})` : `${reason} (${response.status})`);
}

// Segment by segment, so "/" stays a separator. The server decodes paths it is given in
// headers and bodies too (Stream-Forked-From, /auth/sign), and header values must be ASCII.
export function encodePath(path) {
  return path.split("/").map(encodeURIComponent).join("/");
}

export class Api {
  constructor(config, page) {
    this.config = config;
    this.root = new URL(config.stream_root, page);
    this.listing = new URL(config.listing, page);
    this.detail = new URL(config.detail, page);
    this.signer = new URL(config.sign, page);
    this.statistics = new URL(config.stats, page);
    this.tenants = config.tenants ? new URL(config.tenants, page) : null;
  }

  get token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  set token(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  }

  streamUrl(path) {
    return new URL("./" + encodePath(path), this.root); // "./": a leading "/" stays relative
  }

  async request(url, { method = "GET", headers = {}, body } = {}) {
    const sent = new Headers(headers);
    if (this.token) sent.set("Authorization", `Bearer ${this.token}`);
    let response;
    try {
      // no-store: catch-up reads are cacheable for CDNs; the console always wants the server's answer.
      response = await fetch(url, { method, headers: sent, body, cache: "no-store", credentials: "omit" });
    } catch (err) {
      throw new ApiError(0, `${REASONS[0]} (${err.message})`);
    }
    if (!response.ok) throw await refusal(response);
    return response;
  }

  async list(prefix, after, limit = 100) {
    const url = new URL(this.listing);
    url.searchParams.set("prefix", prefix);
    url.searchParams.set("limit", String(limit));
    if (after) url.searchParams.set("after", after);
    return (await this.request(url)).json();
  }

  // One stream as the listing shows it, with its idempotent producers' state.
  async info(path) {
    return (await this.request(new URL("./" + encodePath(path), this.detail))).json();
  }

  // The live statistics (read from Redis: the same on every gateway).
  async stats(minutes) {
    const url = new URL(this.statistics);
    url.searchParams.set("minutes", String(minutes));
    return (await this.request(url)).json();
  }

  async streamStats(path) {
    return (await this.request(new URL(`${this.statistics.pathname}/streams/${encodePath(path)}`, this.statistics))).json();
  }

  // The tenants storing the most (the tenants API; null when the server has no tenants).
  async topTenants(limit) {
    if (!this.tenants) return null;
    const url = new URL(this.tenants);
    url.searchParams.set("limit", String(limit));
    return (await this.request(url)).json();
  }

  async subscriptionStats() {
    return (await this.request(new URL(`${this.statistics.pathname}/subscriptions`, this.statistics))).json();
  }

  async head(path) {
    const { headers } = await this.request(this.streamUrl(path), { method: "HEAD" });
    return {
      contentType: headers.get("Content-Type") || "",
      nextOffset: headers.get("Stream-Next-Offset") || "",
      closed: headers.get("Stream-Closed") === "true",
      ttl: headers.get("Stream-TTL"),
      expiresAt: headers.get("Stream-Expires-At"),
    };
  }

  async read(path, offset) {
    const url = this.streamUrl(path);
    url.searchParams.set("offset", offset);
    const response = await this.request(url);
    return {
      bytes: new Uint8Array(await response.arrayBuffer()),
      contentType: response.headers.get("Content-Type") || "",
      nextOffset: response.headers.get("Stream-Next-Offset") || "",
      upToDate: response.headers.get("Stream-Up-To-Date") === "true",
      closed: response.headers.get("Stream-Closed") === "true",
    };
  }

  async create(path, { contentType, ttl, closed }) {
    const headers = { "Content-Type": contentType };
    if (ttl) headers["Stream-TTL"] = String(ttl);
    if (closed) headers["Stream-Closed"] = "true";
    const response = await this.request(this.streamUrl(path), { method: "PUT", headers });
    return response.status === 201;
  }

  async fork(path, source, offset) {
    const headers = { "Stream-Forked-From": encodePath(source) };
    if (offset) headers["Stream-Fork-Offset"] = offset;
    const response = await this.request(this.streamUrl(path), { method: "PUT", headers });
    return response.status === 201;
  }

  async append(path, contentType, body, producer) {
    const headers = { "Content-Type": contentType };
    if (producer) {
      headers["Producer-Id"] = producer.id;
      headers["Producer-Epoch"] = String(producer.epoch);
      headers["Producer-Seq"] = String(producer.seq);
    }
    const response = await this.request(this.streamUrl(path), { method: "POST", headers, body });
    return {
      status: response.status,
      nextOffset: response.headers.get("Stream-Next-Offset") || "",
      producerEpoch: response.headers.get("Producer-Epoch"),
      producerSeq: response.headers.get("Producer-Seq"),
    };
  }

  async close(path) {
    await this.request(this.streamUrl(path), { method: "POST", headers: { "Stream-Closed": "true" } });
  }

  async remove(path) {
    await this.request(this.streamUrl(path), { method: "DELETE" });
  }

  // A short-lived read URL for one stream (EventSource cannot send Authorization),
  // built on this page's origin from the signature's query (connect-src 'self').
  async signedReadUrl(path) {
    const expires = Math.min(300, this.config.signed_url_max_seconds);
    const response = await this.request(this.signer, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ path: encodePath(path), scope: "read", expires_in: expires }),
    });
    const { query } = await response.json();
    const url = this.streamUrl(path);
    for (const [name, value] of Object.entries(query)) url.searchParams.set(name, value);
    return url;
  }
}
