// envd's plain HTTP API: GET/POST /files (download; upload as multipart or octet-stream, with file metadata
// headers) and /health. Errors here are Kiln's envelope mapped to envd's {code, message} by the E2B layer.

import { posix } from "node:path";
import { Transform } from "node:stream";
import type { Readable } from "node:stream";
import { createGunzip } from "node:zlib";
import type { FastifyRequest } from "fastify";
import { KilnError } from "../../errors.ts";
import type { EnvdKit } from "./envd-wire.ts";
import { sandboxIdOf as e2bIdOf } from "./ids.ts";
import { E2bUnserved } from "./errors.ts";

// File metadata travels as `X-Metadata-<key>: <value>` upload headers (envd ≥ 0.6.2); keys and values as the SDK
// checks them. Header names are case-insensitive (fetch sends them lowercased), so keys are stored lowercased.
const METADATA_HEADER = /^x-metadata-(.+)$/i;
const METADATA_KEY = /^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$/;
const METADATA_VALUE = /^[\x20-\x7e]*$/;
// envd's bounds (shared/pkg/filesystem/xattr.go): a key is at most 255 bytes with its `user.e2b.` prefix (the VFS
// xattr-name limit), and a file's set at most 4 KiB counting each prefix, key and value (ext4 keeps an inode's
// xattrs in one block). That also keeps the metadata, URL-encoded into the agent request's query, far within
// Node's 16 KiB header limit.
const XATTR_PREFIX_BYTES = "user.e2b.".length;
const MAX_METADATA_KEY_BYTES = 255 - XATTR_PREFIX_BYTES;
const MAX_METADATA_BYTES = 4 * 1024;

function metadataOf(req: FastifyRequest): Record<string, string> | undefined {
  const out = new Map<string, string>(); // a Map: a key may be any token, `__proto__` included
  let bytes = 0;
  const raw = req.raw.rawHeaders;
  for (let i = 0; i + 1 < raw.length; i += 2) {
    const m = METADATA_HEADER.exec(raw[i]);
    if (!m) continue;
    const [key, value] = [m[1].toLowerCase(), raw[i + 1]];
    if (!METADATA_KEY.test(key) || !METADATA_VALUE.test(value)) throw new KilnError("invalid_request", `Invalid file metadata ${JSON.stringify(key)}`);
    if (key.length > MAX_METADATA_KEY_BYTES) throw new KilnError("invalid_request", `File metadata key ${JSON.stringify(key.slice(0, 32))}… is longer than ${MAX_METADATA_KEY_BYTES} bytes`);
    // The first of a repeated header wins, as envd.
    if (out.has(key)) continue;
    bytes += XATTR_PREFIX_BYTES + key.length + value.length;
    if (bytes > MAX_METADATA_BYTES) throw new KilnError("invalid_request", `File metadata is larger than ${MAX_METADATA_BYTES} bytes`);
    out.set(key, value);
  }
  return out.size > 0 ? Object.fromEntries(out) : undefined;
}

function limitBytes(body: Readable, limit: number): Readable {
  let seen = 0;
  const guard = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      seen += chunk.length;
      if (seen > limit) return cb(new KilnError("payload_too_large", `The file is larger than the ${limit}-byte limit`));
      cb(null, chunk);
    },
  });
  body.on("error", (err) => guard.destroy(err));
  return body.pipe(guard);
}

export function filesRoutes(kit: EnvdKit): void {
  const { app, services, context, resolvePath } = kit;
  const envdRoute = { config: { e2b: "envd", auth: "envd-token" as const }, constraints: { e2bEnvd: "envd" } };

  // envd answers /health only while its sandbox runs; for a paused, killed or unknown sandbox E2B's proxy answers
  // 502, which is how the SDK's isRunning() (and its "was the sandbox killed?" probe) tells them apart.
  app.get("/health", envdRoute, async (req, reply) => {
    const id = kit.sandboxIdOf(req);
    const m = await services.machines.get(id).catch(() => undefined);
    if (m?.status === "running") return reply.code(204).send();
    const sandboxId = e2bIdOf(id);
    return reply.code(502).type("application/json").send({ code: 502, message: `The sandbox ${sandboxId} is not running`, sandboxId });
  });

  // envd routes the SDK never calls: answered unserved, in envd's shape, not as an unknown path.
  const unserved = (what: string) => async () => {
    throw new E2bUnserved(`envd's ${what} is not served by Kiln (see docs/e2b.md)`);
  };
  app.get("/envs", envdRoute, unserved("/envs"));
  app.get("/metrics", envdRoute, unserved("/metrics (use the control plane's GET /sandboxes/{id}/metrics)"));
  app.post("/files/compose", envdRoute, unserved("/files/compose"));

  app.get("/files", envdRoute, async (req, reply) => {
    const { id, user, home } = await context(req);
    const path = (req.query as Record<string, unknown>).path;
    if (typeof path !== "string" || !path) throw new KilnError("invalid_request", "path is required");
    const resolved = resolvePath(path, home);
    const info = await services.files.info(id, { path: resolved, user });
    if (info.type === "directory") throw new KilnError("invalid_request", `path ${resolved} is a directory`);
    const body = await services.files.read(id, { path: resolved, user });
    return reply.type("application/octet-stream").header("content-disposition", `inline; filename=${JSON.stringify(posix.basename(resolved))}`).send(body);
  });

  app.post("/files", envdRoute, async (req, reply) => {
    const { id, user, home } = await context(req);
    const q = (req.query as Record<string, unknown>).path;
    const path = typeof q === "string" && q ? q : undefined;
    const ct = String(req.headers["content-type"] ?? "");
    const metadata = metadataOf(req);
    const written: { name: string; type: "file"; path: string; metadata?: Record<string, string> }[] = [];
    const put = async (target: string, body: Readable | Buffer) => {
      const info = await services.files.write(id, { path: resolvePath(target, home), user, metadata }, body);
      written.push({ name: info.name, type: "file", path: info.path, ...(info.metadata ? { metadata: info.metadata } : {}) });
    };
    if (ct.startsWith("multipart/form-data")) {
      const raw = req.body;
      if (!Buffer.isBuffer(raw)) throw new KilnError("invalid_request", "The multipart body could not be read");
      const form = await new Response(raw, { headers: { "content-type": ct } }).formData().catch(() => {
        throw new KilnError("invalid_request", "The multipart body is malformed");
      });
      const files = form.getAll("file").filter((f): f is File => typeof f !== "string");
      if (files.length === 0) throw new KilnError("invalid_request", "Send the file(s) as multipart parts named file");
      for (const f of files) {
        const target = files.length === 1 && path ? path : f.name;
        if (!target) throw new KilnError("invalid_request", "Each part needs a file name (its path) when no path parameter is given");
        await put(target, Buffer.from(await f.arrayBuffer()));
      }
    } else if (ct.startsWith("application/octet-stream")) {
      if (!path) throw new KilnError("invalid_request", "path is required for an octet-stream upload");
      let body = req.body as Readable | Buffer | undefined;
      if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the file's bytes as the request body");
      if (!Buffer.isBuffer(body)) {
        if (String(req.headers["content-encoding"] ?? "").toLowerCase() === "gzip") body = body.pipe(createGunzip());
        body = limitBytes(body, kit.bodyLimit);
      }
      await put(path, body);
    } else {
      throw new KilnError("unsupported_media_type", "Upload as multipart/form-data or application/octet-stream");
    }
    return reply.code(200).send(written);
  });
}
