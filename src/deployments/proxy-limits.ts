// Each upstream's share and waits through the edge and the E2B port proxy: the settings (KILN_EDGE_*) and their
// defaults, apart from the proxy itself so configuration can name them without loading it.

export interface ProxyLimits {
  /** Requests in flight to one upstream at once (each holds one kept-alive tunnel). */
  connections: number;
  /** Requests waiting for one of those; with the queue full, a request is answered 503 at once. */
  queue: number;
  /** Longest wait for a place, and for the response head once the request's last byte went. */
  headersTimeoutMs: number;
  /** Longest silence of a body once it streams, either way (an upload, a download, a client that stopped reading). */
  idleTimeoutMs: number;
  /** Longest time to receive a whole request body from the client, however steadily it drips (an answer may stream on). */
  requestTimeoutMs: number;
  /** Longest wait for a tunnel into the machine. */
  connectTimeoutMs: number;
  /** Upgraded connections (WebSockets) open to one upstream at once. */
  upgrades: number;
}

export const DEFAULT_PROXY_LIMITS: ProxyLimits = { connections: 64, queue: 256, headersTimeoutMs: 60_000, idleTimeoutMs: 300_000, requestTimeoutMs: 300_000, connectTimeoutMs: 10_000, upgrades: 1024 };
