// One authenticated WebSocket to a Kiln route, its JSON frames dispatched to listeners; a refused upgrade is turned
// into the server's HTTP envelope (asked again without the upgrade, since a WebSocket error carries no status).

import type { KilnOptions } from "./client.ts";
import { errorFromResponse, KilnApiError } from "./errors.ts";
import type { ServerFrame } from "./frames.ts";

export interface FrameSocket {
  send(frame: Record<string, unknown>): void;
  /** Calls `listener` for every frame until it returns true (then it is removed) or the socket closes. */
  on(listener: (frame: ServerFrame) => boolean | void): void;
  /** Resolves when the socket has closed, with its close code. */
  closed: Promise<number>;
  close(): void;
}

export async function openFrameSocket(opts: KilnOptions, path: string): Promise<FrameSocket> {
  const url = new URL(path, opts.baseUrl.replace(/\/?$/, "/"));
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const headers = { authorization: `Bearer ${opts.apiKey}` };
  const WS = opts.WebSocket ?? (WebSocket as unknown as NonNullable<KilnOptions["WebSocket"]>);
  const ws = new WS(url.toString(), { headers });
  const listeners = new Set<(frame: ServerFrame) => boolean | void>();
  let resolveClosed!: (code: number) => void;
  const closed = new Promise<number>((r) => (resolveClosed = r));
  await new Promise<void>((resolve, reject) => {
    ws.addEventListener("open", () => resolve(), { once: true });
    ws.addEventListener(
      "error",
      () => {
        // Ask the same route without the upgrade: Kiln refuses it the same way, with the envelope.
        const fetchImpl = opts.fetch ?? fetch;
        fetchImpl(new URL(path, opts.baseUrl.replace(/\/?$/, "/")), { headers })
          .then(async (res) => reject(res.status >= 400 ? await errorFromResponse(res) : new KilnApiError(0, undefined, `the WebSocket to ${path} failed`)))
          .catch(reject);
      },
      { once: true },
    );
  });
  ws.addEventListener("message", (ev: { data: unknown }) => {
    if (typeof ev.data !== "string") return;
    let frame: ServerFrame;
    try {
      frame = JSON.parse(ev.data) as ServerFrame;
    } catch {
      return;
    }
    for (const l of [...listeners]) if (l(frame) === true) listeners.delete(l);
  });
  ws.addEventListener("close", (ev: { code: number }) => {
    listeners.clear();
    resolveClosed(ev.code);
  });
  return {
    send: (frame) => ws.send(JSON.stringify(frame)),
    on: (listener) => void listeners.add(listener),
    closed,
    close: () => ws.close(),
  };
}

let counter = 0;
export function requestId(): string {
  return `sdk_${Date.now().toString(36)}_${(counter++).toString(36)}`;
}
