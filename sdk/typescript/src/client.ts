// The SDK's entry: a typed openapi-fetch client for every documented route (types generated from the served
// OpenAPI document, openapi.ts), plus the stream helpers HTTP/JSON alone cannot give.

import createClient from "openapi-fetch";
import type { paths } from "./openapi.ts";
import { MachineSocket } from "./machine-socket.ts";
import { VolumeWatcher } from "./volume-watch.ts";
import { build, buildLogs } from "./builds.ts";

export interface KilnOptions {
  /** Kiln's address, e.g. http://127.0.0.1:8080 */
  baseUrl: string;
  apiKey: string;
  fetch?: typeof fetch;
  /** A WebSocket class that takes `{ headers }` (Node's global one does; `ws` does too). */
  WebSocket?: new (url: string, init: { headers: Record<string, string> }) => WebSocketLike;
}

/** What the SDK uses of a WebSocket. */
export interface WebSocketLike {
  send(data: string): void;
  close(): void;
  addEventListener(type: string, listener: (ev: any) => void, opts?: { once?: boolean }): void;
}

export function createKiln(opts: KilnOptions) {
  const api = createClient<paths>({
    baseUrl: opts.baseUrl.replace(/\/+$/, ""),
    headers: { authorization: `Bearer ${opts.apiKey}` },
    ...(opts.fetch ? { fetch: opts.fetch } : {}),
  });
  return {
    /** Every route of GET /v1/openapi.json, typed: `api.GET("/v1/machines/{id}", { params: { path: { id } } })`. */
    api,
    /** Opens the machine's exec/PTY socket. */
    machineSocket: (machineId: string) => MachineSocket.open(opts, machineId),
    /** Opens a file-watch socket on a volume. */
    volumeWatcher: (volumeId: string) => VolumeWatcher.open(opts, volumeId),
    /** Starts a template build and yields its log entries as they come. */
    build: (request: Record<string, unknown>) => build(opts, request),
    /** A build's log from after `afterSeq` (replayed, then followed while the build runs). */
    buildLogs: (templateId: string, buildId: string, afterSeq?: number) => buildLogs(opts, templateId, buildId, afterSeq),
  };
}

export type Kiln = ReturnType<typeof createKiln>;
