// A registry that lies, for what a real one refuses to store: wrong or path-shaped digests, declared sizes that
// are not the real ones, blobs cut short or endless, bodies dripped and connections reset. It speaks just enough of
// the distribution API (GET /v2/, manifests, blobs) for Kiln's importer, on loopback, and counts what was asked.

import { createServer } from "node:http";
import type { IncomingMessage, ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { sha256 } from "./oci-registry.ts";

export type Handler = (req: IncomingMessage, res: ServerResponse) => void;

export interface HostileRegistry {
  host: string;
  /** Requests seen, as `GET /v2/…` lines. */
  seen: string[];
  /** Answers GET `/v2/<repo>/manifests/<ref>` with this manifest (or handler). */
  manifest(repo: string, ref: string, manifest: Record<string, unknown> | Handler): string;
  /** Answers GET `/v2/<repo>/blobs/<digest>` with these bytes (or handler). */
  blob(repo: string, digest: string, body: Buffer | Handler): void;
  stop(): Promise<void>;
}

export async function startHostileRegistry(): Promise<HostileRegistry> {
  const routes = new Map<string, Handler>();
  const seen: string[] = [];
  const sockets = new Set<import("node:net").Socket>();
  const server = createServer((req, res) => {
    seen.push(`${req.method} ${req.url}`);
    const route = routes.get(req.url ?? "");
    if (req.url === "/v2/" || req.url === "/v2") return void res.writeHead(200, { "content-type": "application/json" }).end("{}");
    if (!route) return void res.writeHead(404).end();
    route(req, res);
  });
  server.on("connection", (s) => {
    sockets.add(s);
    s.on("close", () => sockets.delete(s));
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
  return {
    host,
    seen,
    manifest(repo, ref, manifest) {
      if (typeof manifest === "function") {
        routes.set(`/v2/${repo}/manifests/${ref}`, manifest as Handler);
        return "";
      }
      const body = Buffer.from(JSON.stringify(manifest));
      const mediaType = (manifest as { mediaType?: string }).mediaType ?? "application/vnd.oci.image.manifest.v1+json";
      routes.set(`/v2/${repo}/manifests/${ref}`, (_req, res) => res.writeHead(200, { "content-type": mediaType, "content-length": body.length }).end(body));
      return sha256(body);
    },
    blob(repo, digest, body) {
      routes.set(`/v2/${repo}/blobs/${digest}`, typeof body === "function" ? body : (_req, res) => res.writeHead(200, { "content-length": body.length }).end(body));
    },
    async stop() {
      for (const s of sockets) s.destroy();
      await new Promise<void>((r) => server.close(() => r()));
    },
  };
}

/** An OCI manifest naming a config and layers by whatever descriptors the test gives (lies included). */
export function manifestOf(config: { digest: string; size: number }, layers: { digest: string; size: number; mediaType?: string }[]): Record<string, unknown> {
  return {
    schemaVersion: 2,
    mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: { mediaType: "application/vnd.oci.image.config.v1+json", ...config },
    layers: layers.map((l) => ({ mediaType: "application/vnd.oci.image.layer.v1.tar", ...l })),
  };
}

/** A linux/amd64 image config recording these diff ids. */
export function configOf(diffIds: string[]): Buffer {
  return Buffer.from(JSON.stringify({ architecture: "amd64", os: "linux", config: {}, rootfs: { type: "layers", diff_ids: diffIds } }));
}
