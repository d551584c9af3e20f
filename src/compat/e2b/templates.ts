// E2B's template builder (`Template()` … `Template.build`) on Kiln's build pipeline — no second builder. The SDK's
// sequence: POST /v3/templates (a name, tags) → per `copy`, GET /templates/{id}/files/{hash} (an upload link) and a
// PUT of the files as a tar → POST /v2/templates/{id}/builds/{buildID} (the steps) → GET …/status?logsOffset= until
// ready or error. The name is claimed as a Kiln template at the first call; the steps become one Kiln build request
// (RUN → run, COPY → copy from the uploaded files, ENV → env, WORKDIR → workdir, USER → user, startCmd/readyCmd →
// start_cmd/ready_cmd, fromImage → base_image, fromTemplate → a Kiln template base) whose durable log is E2B's.
// Several servers on one store: the requested build is recorded in the store with the host that will build it (the
// one that took the request, or the host of the template's other requested builds); the upload link, the upload (its
// link names that host, signed), the start and the status are served there, forwarded by any other server
// (src/hosts/routing.ts), so a load balancer need not be sticky.

import { createHash, createHmac, randomBytes } from "node:crypto";
import { createReadStream, createWriteStream } from "node:fs";
import { chmod, mkdir, open, readdir, rename, rm, stat, utimes } from "node:fs/promises";
import { join, posix } from "node:path";
import { pipeline } from "node:stream/promises";
import { Readable, Transform } from "node:stream";
import { createGunzip } from "node:zlib";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { Type } from "typebox";
import type { Static } from "typebox";
import tar from "tar-stream";
import type { Services } from "../../services/index.ts";
import type { Bound } from "../../hosts/forward.ts";
import type { Selectable } from "kysely";
import type { E2bBuildRequestsTable } from "../../store/schema.ts";
import { KilnError } from "../../errors.ts";
import { Compile } from "typebox/compile";
import { BuildRequest } from "../../builder/request.ts";
import { EnvName } from "../../builder/steps/fields.ts";
import type { BuildRequestT } from "../../builder/request.ts";
import type { LogEntry } from "../../builder/log.ts";
import { parseTemplateRef } from "../../templates/resolver.ts";
import { unauthorized } from "../../api/auth.ts";
import type { Auth } from "../../api/auth.ts";
import { sameText } from "./token.ts";
import { requestHost } from "./ports.ts";

/** E2B's own base image (`fromBaseImage()`, and a template with no `from…`): Kiln's base template stands for it. */
const E2B_BASE_IMAGE = "e2bdev/base";
/** How long an upload link is good for. */
const UPLOAD_LINK_S = 15 * 60;
/** A requested build whose steps never came is forgotten after this long. */
const PENDING_TTL_MS = 60 * 60 * 1000;
const MAX_PENDING = 1000;
/** One key's share of MAX_PENDING, so a key requesting builds it never starts cannot refuse every other key's. */
const MAX_PENDING_PER_KEY = 100;
/** Files (not directories) one upload may unpack to, and their bytes, relative to the upload's own bound. */
const MAX_ENTRIES = 10_000;
const UNPACK_RATIO = 10;
/** Log entries one status call answers (E2B's default `limit`). */
const LOG_PAGE = 100;
const FILES_HASH = /^[0-9a-f]{64}$/;
const ENV_NAME = new RegExp(EnvName);
const checkBuildRequest = Compile(BuildRequest);

/** The request the SDK's steps became, held to Kiln's own build request schema (as POST /v1/templates/build is). */
function checked(req: BuildRequestT): BuildRequestT {
  if (checkBuildRequest.Check(req)) return req;
  const first = [...checkBuildRequest.Errors(req)][0] as { instancePath?: string; message?: string } | undefined;
  const m = /^\/steps\/(\d+)(.*)$/.exec(first?.instancePath ?? "");
  const where = m ? `step ${Number(m[1]) + 1}${m[2] ? ` (${m[2].slice(1).replaceAll("/", ".")})` : ""}` : (first?.instancePath ?? "").replace(/^\//, "").replaceAll("/", ".") || "the template";
  throw new KilnError("invalid_request", `Invalid template: ${where} ${first?.message ?? "is not valid"}`);
}

interface PendingBuild {
  templateId: string;
  name: string;
  tags: string[];
  vm: { vcpus?: number; memory_mb?: number };
  keyId: string | null;
  hostId: string;
}
/** A host id as an upload link carries it (what KILN_HOST_ID may be). */
const HOST_ID = /^[A-Za-z0-9_.-]{1,64}$/;

const RequestBody = Type.Object(
  {
    name: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
    alias: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
    tags: Type.Optional(Type.Array(Type.String({ minLength: 1, maxLength: 128 }), { maxItems: 64 })),
    cpuCount: Type.Optional(Type.Integer({ minimum: 1, maximum: 64 })),
    memoryMB: Type.Optional(Type.Integer({ minimum: 128, maximum: 262_144 })),
    minFreeDiskMb: Type.Optional(Type.Integer({ minimum: 0 })),
    teamID: Type.Optional(Type.String()),
  },
  { additionalProperties: true },
);

const StepBody = Type.Object(
  { type: Type.String({ minLength: 1, maxLength: 32 }), args: Type.Optional(Type.Array(Type.String({ maxLength: 65536 }), { maxItems: 1024 })), filesHash: Type.Optional(Type.String({ maxLength: 128 })), force: Type.Optional(Type.Boolean()) },
  { additionalProperties: true },
);
const StartBody = Type.Object(
  {
    fromImage: Type.Optional(Type.String({ maxLength: 1024 })),
    fromTemplate: Type.Optional(Type.String({ maxLength: 256 })),
    fromImageRegistry: Type.Optional(Type.Record(Type.String(), Type.Unknown())),
    startCmd: Type.Optional(Type.String({ maxLength: 65536 })),
    readyCmd: Type.Optional(Type.String({ maxLength: 65536 })),
    force: Type.Optional(Type.Boolean()),
    steps: Type.Optional(Type.Array(StepBody, { maxItems: 256 })),
  },
  { additionalProperties: true },
);
type StartBodyT = Static<typeof StartBody>;

function bad(message: string): never {
  throw new KilnError("invalid_request", message);
}

/** E2B's `name[:tag]` as a Kiln template name plus the tags the build sets (E2B's default tag is `default`, as Kiln's). */
export function e2bNameAndTags(raw: string, tags: string[] | undefined): { name: string; tags: string[] } {
  const colon = raw.lastIndexOf(":");
  const name = colon > 0 ? raw.slice(0, colon) : raw;
  const tag = colon > 0 ? raw.slice(colon + 1) : undefined;
  if (!/^(?:[a-z0-9][a-z0-9._-]*\/)?[a-z0-9][a-z0-9._-]*$/.test(name) || name.length > 128) bad(`Template name ${JSON.stringify(name)} is not valid: lowercase letters, digits, '.', '_' and '-' (optionally namespace/name)`);
  const all = [...new Set([...(tag ? [tag] : []), ...(tags ?? [])])];
  for (const t of all) if (!/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/.test(t)) bad(`Tag ${JSON.stringify(t)} is not valid: letters, digits, '.', '_' and '-'`);
  return { name, tags: all.length ? all : ["default"] };
}

/** Whether `src` (an SDK `copy` source, relative to its context dir) is a glob; its fixed leading directories. */
function globPrefix(src: string): string | undefined {
  const parts = src.split("/");
  const i = parts.findIndex((p) => /[*?[\]{}]/.test(p));
  return i < 0 ? undefined : parts.slice(0, i).join("/");
}

/** A path inside an upload, checked: relative, no `..`, no control characters; normalized without `./`. */
function safeRelative(p: string, what: string): string {
  const norm = posix.normalize(p.replace(/^(\.\/)+/, "")).replace(/\/+$/, "");
  if (p.startsWith("/") || norm === ".." || norm.startsWith("../") || /[\x00-\x1f]/.test(p)) bad(`${what} ${JSON.stringify(p)} is outside the copy's context (absolute, or climbing out with ..)`);
  return norm === "." ? "" : norm;
}

export function createE2bTemplateFiles(dataDir: string, maxBytes: number) {
  const dir = join(dataDir, "e2b-template-files");
  const pathOf = (hash: string) => {
    if (!FILES_HASH.test(hash)) bad("A files hash is the lowercase hex sha256 the SDK computes");
    return join(dir, hash);
  };
  async function ensureDir() {
    await mkdir(dir, { recursive: true, mode: 0o700 });
    await chmod(dir, 0o700);
  }

  async function present(hash: string): Promise<boolean> {
    return (await stat(pathOf(hash)).catch(() => null))?.isFile() ?? false;
  }

  /** Streams an upload to disk, bounded; it replaces what the hash held only once complete. */
  async function put(hash: string, body: Readable): Promise<number> {
    const final = pathOf(hash);
    await ensureDir();
    const tmp = join(dir, `.upload-${hash}-${randomBytes(6).toString("hex")}`);
    let size = 0;
    const counter = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        size += chunk.length;
        if (size > maxBytes) return cb(new KilnError("payload_too_large", `A template file upload may hold at most ${maxBytes} bytes (KILN_BODY_LIMIT_BYTES)`));
        cb(null, chunk);
      },
    });
    try {
      await pipeline(body, counter, createWriteStream(tmp, { mode: 0o600 }));
      if (size === 0) bad("The upload is empty: send the tar the SDK makes of the copied files");
      await rename(tmp, final);
      return size;
    } finally {
      await rm(tmp, { force: true });
    }
  }

  /**
   * Unpacks one upload into Kiln's build-context blob store: its files as context entries under `e2b/<hash>/`,
   * relative to `strip` (a glob's fixed directories). Directories are implied; links and devices are refused.
   */
  async function unpack(hash: string, strip: string, blobs: Services["builds"]["blobs"]): Promise<{ path: string; sha256: string; mode: string }[]> {
    const file = pathOf(hash);
    const head = Buffer.alloc(2);
    const fh = await open(file, "r").catch(() => bad(`No files were uploaded for hash ${hash}: the SDK uploads them before it starts the build`));
    try {
      await fh.read(head, 0, 2, 0);
    } finally {
      await fh.close();
    }
    const now = new Date();
    await utimes(file, now, now); // retention counts from the last use
    await mkdir(blobs.dir, { recursive: true });
    const out: { path: string; sha256: string; mode: string }[] = [];
    let unpacked = 0;
    const extract = tar.extract();
    const done = (async () => {
      for await (const entry of extract) {
        const h = entry.header;
        const rel = safeRelative(h.name, "A file in the upload");
        if (h.type === "directory") {
          entry.resume();
          continue;
        }
        if (h.type !== "file" && h.type !== "contiguous-file") bad(`The upload holds ${JSON.stringify(h.name)}, a ${h.type}: Kiln's builds copy regular files only (copy(…, {resolveSymlinks: true}) copies what links point at)`);
        if (out.length >= MAX_ENTRIES) bad(`The upload holds more than ${MAX_ENTRIES} files`);
        if (strip && rel !== strip && !rel.startsWith(strip + "/")) bad(`The upload holds ${JSON.stringify(h.name)}, outside ${JSON.stringify(strip)}`);
        const inside = strip ? rel.slice(strip.length + 1) : rel;
        if (!inside) bad(`The upload holds ${JSON.stringify(h.name)} where a directory was expected`);
        const sha = createHash("sha256");
        const tmp = join(blobs.dir, `.e2b-${randomBytes(6).toString("hex")}`);
        try {
          await pipeline(
            entry,
            new Transform({
              transform(chunk: Buffer, _enc, cb) {
                unpacked += chunk.length;
                if (unpacked > maxBytes * UNPACK_RATIO) return cb(new KilnError("payload_too_large", `The upload unpacks to more than ${maxBytes * UNPACK_RATIO} bytes`));
                sha.update(chunk);
                cb(null, chunk);
              },
            }),
            createWriteStream(tmp, { mode: 0o600 }),
          );
          const digest = sha.digest("hex");
          await rename(tmp, blobs.pathOf(digest));
          out.push({ path: `e2b/${hash}/${inside}`, sha256: digest, mode: ((h.mode ?? 0o644) & 0o7777).toString(8).padStart(4, "0") });
        } finally {
          await rm(tmp, { force: true });
        }
      }
    })();
    const source = createReadStream(file);
    const gz = head[0] === 0x1f && head[1] === 0x8b;
    // The whole tar stream is bounded, headers and padding included: a gzip of repeated directory headers (which
    // count as no file and no file byte) would otherwise decompress a thousandfold and keep the server busy.
    let streamed = 0;
    const bounded = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        streamed += chunk.length;
        if (streamed > maxBytes * UNPACK_RATIO) return cb(new KilnError("payload_too_large", `The upload unpacks to more than ${maxBytes * UNPACK_RATIO} bytes`));
        cb(null, chunk);
      },
    });
    try {
      await Promise.all([pipeline(gz ? source.pipe(createGunzip()) : source, bounded, extract), done]);
    } catch (err) {
      source.destroy();
      extract.destroy();
      if (err instanceof KilnError) throw err;
      bad(`The upload for hash ${hash} is not a readable tar: ${(err as Error).message}`);
    }
    if (out.length === 0) bad(`The upload for hash ${hash} holds no files`);
    return out;
  }

  /** Removes uploads unused for `retentionS` (and upload leftovers older than an hour). */
  async function collect(retentionS: number): Promise<number> {
    const names = await readdir(dir).catch(() => [] as string[]);
    let removed = 0;
    for (const n of names) {
      const st = await stat(join(dir, n)).catch(() => null);
      if (!st) continue;
      const limitMs = n.startsWith(".upload-") ? 3600_000 : retentionS * 1000;
      if (Date.now() - st.mtimeMs > limitMs) {
        await rm(join(dir, n), { force: true });
        removed++;
      }
    }
    return removed;
  }

  return { dir, present, put, unpack, collect };
}

/** The SDK's steps as one Kiln build request, and the uploads its copies need. */
export function buildRequestOf(pending: PendingBuild, body: StartBodyT): { req: BuildRequestT; copies: { hash: string; strip: string }[] } {
  const steps: NonNullable<BuildRequestT["steps"]> = [];
  const copies: { hash: string; strip: string }[] = [];
  for (const [i, s] of (body.steps ?? []).entries()) {
    const args = s.args ?? [];
    const where = `step ${i + 1} (${s.type})`;
    if (s.type === "RUN") {
      if (!args[0]) bad(`${where}: no command`);
      steps.push({ type: "run", command: args[0], ...(args[1] ? { user: args[1] } : {}) });
    } else if (s.type === "COPY") {
      const [src, dest, user, mode] = args;
      if (!src || !dest) bad(`${where}: a copy names a source and a destination`);
      if (!s.filesHash || !FILES_HASH.test(s.filesHash)) bad(`${where}: a copy carries the filesHash of its uploaded files`);
      const rel = safeRelative(src, `${where}: the source`);
      const prefix = globPrefix(rel);
      const strip = prefix === undefined ? "" : prefix;
      copies.push({ hash: s.filesHash, strip });
      const ctxSrc = prefix === undefined ? posix.join("e2b", s.filesHash, rel) : posix.join("e2b", s.filesHash);
      steps.push({ type: "copy", src: ctxSrc, dest: prefix === undefined ? dest : dest.endsWith("/") ? dest : dest + "/", ...(mode ? { mode } : {}), ...(user ? { owner: user } : {}) });
    } else if (s.type === "ENV") {
      if (args.length % 2 !== 0 || args.length === 0) bad(`${where}: environment variables come as name, value pairs`);
      const envs: Record<string, string> = {};
      for (let j = 0; j < args.length; j += 2) {
        if (!ENV_NAME.test(args[j])) bad(`${where}: ${JSON.stringify(args[j])} is not an environment variable name`);
        envs[args[j]] = args[j + 1];
      }
      steps.push({ type: "env", envs });
    } else if (s.type === "WORKDIR") {
      if (!args[0]) bad(`${where}: no directory`);
      steps.push({ type: "workdir", path: args[0] });
    } else if (s.type === "USER") {
      if (!args[0]) bad(`${where}: no user`);
      steps.push({ type: "user", user: args[0] });
    } else {
      bad(`${where}: Kiln's E2B template builder does not know step type ${JSON.stringify(s.type)} (RUN, COPY, ENV, WORKDIR, USER)`);
    }
  }
  if (body.fromImage && body.fromTemplate) bad("Give fromImage or fromTemplate, not both");
  const reg = body.fromImageRegistry as { type?: string; username?: string; password?: string } | undefined;
  if (reg && reg.type !== "registry") bad(`fromImageRegistry of type ${JSON.stringify(reg.type)} (AWS/GCP registries) is not supported by Kiln: give a username and password (type "registry")`);
  const base = body.fromTemplate ?? (body.fromImage && body.fromImage !== E2B_BASE_IMAGE ? body.fromImage : undefined);
  if (body.fromTemplate && reg) bad("fromImageRegistry goes with fromImage");
  const req: BuildRequestT = {
    name: pending.name,
    tags: pending.tags,
    steps,
    ...(base ? { base_image: base } : {}),
    ...(reg?.username && reg.password ? { base_image_auth: { type: "basic" as const, username: reg.username, password: reg.password } } : {}),
    ...(body.startCmd ? { start_cmd: body.startCmd } : {}),
    ...(body.readyCmd ? { ready_cmd: body.readyCmd } : {}),
    ...(body.force ? { skip_cache: true } : {}),
    ...(pending.vm.vcpus || pending.vm.memory_mb ? { vm: pending.vm } : {}),
  };
  return { req, copies };
}

function e2bLogEntry(e: LogEntry) {
  return { timestamp: e.timestamp, level: e.level, message: e.message, ...(e.step_index !== undefined ? { step: String(e.step_index) } : {}) };
}

export async function templateBuilderRoutes(
  app: FastifyInstance,
  deps: { services: Services; auth: Auth; secret: Buffer; dataDir: string; publicUrl: string; retentionS: number; maxBytes: number },
) {
  const { services } = deps;
  const { db } = services.store;
  const hostId = services.hosts.hostId;
  const files = createE2bTemplateFiles(deps.dataDir, deps.maxBytes);
  const sweep = setInterval(() => {
    // Any server forgets expired requests (idempotent); each removes its own unused uploads.
    db.deleteFrom("e2b_build_requests").where("expires_at", "<", new Date().toISOString()).execute().catch((err: unknown) => app.log.warn({ err }, "forgetting expired e2b build requests failed"));
    files.collect(deps.retentionS).catch((err: unknown) => app.log.warn({ err }, "e2b template file collection failed"));
  }, 60_000);
  sweep.unref();
  app.addHook("onClose", (_app, done) => {
    clearInterval(sweep);
    done();
  });

  /**
   * The stored request of a build, read once per API request: the cluster's routing hook asks for its host (hostBound)
   * and the route's handler for the request itself (pendingOf), and both get the one read.
   */
  const requestRows = new WeakMap<FastifyRequest, Promise<Selectable<E2bBuildRequestsTable> | undefined>>();
  function requestRowOf(req: FastifyRequest, buildId: string): Promise<Selectable<E2bBuildRequestsTable> | undefined> {
    let row = requestRows.get(req);
    if (!row) requestRows.set(req, (row = db.selectFrom("e2b_build_requests").selectAll().where("id", "=", buildId).executeTakeFirst()));
    return row;
  }

  /** A requested build not started and not expired, as the store holds it. */
  async function pendingOf(req: FastifyRequest, buildId: string): Promise<PendingBuild | undefined> {
    const row = await requestRowOf(req, buildId);
    if (!row || row.expires_at < new Date().toISOString()) return undefined;
    return { templateId: row.template_id, name: row.name, tags: JSON.parse(row.tags_json) as string[], vm: JSON.parse(row.vm_json) as PendingBuild["vm"], keyId: row.key_id, hostId: row.host_id };
  }

  /** The host a template's requested builds build on (all of them one host, so its uploads are where they build). */
  async function buildHostOf(templateId: string): Promise<string | undefined> {
    const row = await db.selectFrom("e2b_build_requests").select("host_id").where("template_id", "=", templateId).where("expires_at", ">=", new Date().toISOString()).orderBy("created_at", "desc").limit(1).executeTakeFirst();
    return row?.host_id;
  }
  const onHost = (id: string | undefined): Bound | undefined => (id ? { kind: "hosts", id } : undefined);

  // An upload link: signed for one template, one hash, one key and the host that keeps the upload, until it expires;
  // the key must still be active.
  const mac = (templateId: string, hash: string, expires: number, keyId: string, host: string) => createHmac("sha256", deps.secret).update(`e2b-upload:${templateId}:${hash}:${expires}:${keyId}:${host}`).digest("base64url");
  deps.auth.provide("e2b-upload", async (req) => {
    const q = req.query as Record<string, unknown>;
    const { id, hash } = req.params as { id?: string; hash?: string };
    const keyId = typeof q.key === "string" && /^key_[0-9a-z]{1,64}$/.test(q.key) ? q.key : undefined;
    const expires = typeof q.expires === "string" && /^\d{1,12}$/.test(q.expires) ? Number(q.expires) : undefined;
    const host = typeof q.host === "string" && HOST_ID.test(q.host) ? q.host : undefined;
    if (!keyId || expires === undefined || !host || typeof q.signature !== "string" || !id || !hash) throw unauthorized("an upload link carries key, expires, host and signature");
    if (!sameText(mac(id, hash, expires, keyId, host), q.signature)) throw unauthorized("invalid upload link signature");
    if (expires < Math.floor(Date.now() / 1000)) throw unauthorized("the upload link has expired: the SDK asks for a new one");
    if (!(await services.keys.isActive(keyId))) throw unauthorized("the key this upload link was issued to is no longer active");
    return keyId;
  });

  const keyRoute = { config: { e2b: "control", auth: "key" as const } };
  const originOf = (req: FastifyRequest) => {
    const pub = new URL(deps.publicUrl);
    if (pub.port !== "0") return pub.origin;
    // Forwarded by a peer: the Host the caller used is the one it sent (the peer's own is this server's address).
    return `${req.protocol}://${requestHost(req) ?? req.headers.host}`;
  };

  async function templateOf(id: string) {
    const t = id.startsWith("tpl_") ? await services.store.db.selectFrom("templates").selectAll().where("id", "=", id).executeTakeFirst() : undefined;
    if (!t) throw new KilnError("not_found", `No template ${JSON.stringify(id)} (the templateID POST /v3/templates answered)`);
    return t;
  }

  // 1. The build is requested: its name is claimed as a Kiln template now (a conflict answers here), its id reserved.
  app.post("/v3/templates", { ...keyRoute, schema: { hide: true, body: RequestBody } }, async (req, reply) => {
    const body = req.body as Static<typeof RequestBody>;
    const raw = body.name ?? body.alias;
    if (!raw) bad("name is required");
    const { name, tags } = e2bNameAndTags(raw, body.tags);
    const now = new Date().toISOString();
    const live = db.selectFrom("e2b_build_requests").select((eb) => eb.fn.countAll().as("n")).where("expires_at", ">=", now);
    if (Number((await live.executeTakeFirstOrThrow()).n) >= MAX_PENDING) throw new KilnError("unavailable", `${MAX_PENDING} template builds are requested and not started; start or let them expire first`);
    const keyId = req.apiKeyId ?? null;
    const mine = await live.where("key_id", keyId === null ? "is" : "=", keyId).executeTakeFirstOrThrow();
    if (Number(mine.n) >= MAX_PENDING_PER_KEY) throw new KilnError("unavailable", `${MAX_PENDING_PER_KEY} template builds requested with this key are not started; start or let them expire first`);
    const claimed = await services.builds.prepare({ name, tags, steps: [] }, req.apiKeyId ?? null);
    // Built here, unless the template has other requested builds: their host, while it is not lost (the SDK's upload
    // links name the template, not the build, so all of one template's go to one host).
    const sibling = await buildHostOf(claimed.template.id);
    const builder = sibling && sibling !== hostId && (await services.hosts.hosts()).get(sibling)?.status !== "lost" ? sibling : hostId;
    await db
      .insertInto("e2b_build_requests")
      .values({ id: claimed.buildId, template_id: claimed.template.id, host_id: builder, name: claimed.name, tags_json: JSON.stringify(tags), vm_json: JSON.stringify({ vcpus: body.cpuCount, memory_mb: body.memoryMB }), key_id: keyId, expires_at: new Date(Date.now() + PENDING_TTL_MS).toISOString(), created_at: now })
      .execute();
    // The counts above and this insert are not one step: requests sent at once (through several servers) all pass
    // them. Counted again with this row in: one over either bound takes its row back (of requests racing, those
    // that see too many refuse; one that survives saw every earlier survivor, so neither bound is ever passed).
    const total = Number((await live.executeTakeFirstOrThrow()).n);
    const ours = total > MAX_PENDING ? MAX_PENDING_PER_KEY + 1 : Number((await live.where("key_id", keyId === null ? "is" : "=", keyId).executeTakeFirstOrThrow()).n);
    if (total > MAX_PENDING || ours > MAX_PENDING_PER_KEY) {
      await db.deleteFrom("e2b_build_requests").where("id", "=", claimed.buildId).execute();
      throw new KilnError("unavailable", total > MAX_PENDING ? `${MAX_PENDING} template builds are requested and not started; start or let them expire first` : `${MAX_PENDING_PER_KEY} template builds requested with this key are not started; start or let them expire first`);
    }
    const short = claimed.name.replace(/^local\//, "");
    return reply.code(202).send({ templateID: claimed.template.id, buildID: claimed.buildId, names: [short], aliases: [short], tags, public: false });
  });

  // 2. Upload links for `copy`: present when Kiln holds the hash's files, a signed PUT link either way. Answered by
  // the host the template's requested builds build on (this one when there is none), whose id the link carries.
  const linkRoute = { config: { ...keyRoute.config, hostBound: async (req: FastifyRequest) => onHost(await buildHostOf((req.params as { id: string }).id)) } };
  app.get("/templates/:id/files/:hash", { ...linkRoute, schema: { hide: true, params: Type.Object({ id: Type.String({ maxLength: 256 }), hash: Type.String({ maxLength: 128 }) }) } }, async (req) => {
    const { id, hash } = req.params as { id: string; hash: string };
    if (!FILES_HASH.test(hash)) bad("A files hash is the lowercase hex sha256 the SDK computes");
    await templateOf(id);
    const expires = Math.floor(Date.now() / 1000) + UPLOAD_LINK_S;
    const keyId = req.apiKeyId!;
    const url = `${originOf(req)}/e2b-template-files/${encodeURIComponent(id)}/${hash}?key=${keyId}&expires=${expires}&host=${encodeURIComponent(hostId)}&signature=${mac(id, hash, expires, keyId, hostId)}`;
    return { present: await files.present(hash), url };
  });

  // The upload itself (the SDK PUTs a tar, gzipped by default, with no content type): in its own scope, so the
  // catch-all body parser hands this route the raw stream and no other route. Kept by the host its link names (the
  // signature checked first, by whichever server took it), streamed there and bounded there.
  const uploadHost = async (req: FastifyRequest) => onHost((req.query as { host?: string }).host);
  await app.register(async (scope) => {
    scope.addContentTypeParser("*", (_req, payload, done) => done(null, payload));
    scope.put("/e2b-template-files/:id/:hash", { config: { e2b: "control", auth: "e2b-upload" as const, hostBound: uploadHost }, schema: { hide: true, params: Type.Object({ id: Type.String({ maxLength: 256 }), hash: Type.String({ pattern: "^[0-9a-f]{64}$" }) }) } }, async (req, reply) => {
      const { id, hash } = req.params as { id: string; hash: string };
      await templateOf(id);
      if (Number(req.headers["content-length"] ?? 0) > deps.maxBytes) throw new KilnError("payload_too_large", `A template file upload may hold at most ${deps.maxBytes} bytes (KILN_BODY_LIMIT_BYTES)`);
      const body = req.body as Readable | Buffer | string | undefined;
      if (body === undefined || body === null) bad("Send the files' tar as the request body");
      const stream = typeof body === "string" || Buffer.isBuffer(body) ? Readable.from([Buffer.from(body)]) : body;
      await files.put(hash, stream);
      return reply.code(200).send();
    });
  });

  // 3. The steps: one Kiln build, under the id reserved at step 1, on the host the request names (where the uploads
  // are); it runs detached, as every Kiln build.
  const BuildParams = Type.Object({ id: Type.String({ maxLength: 256 }), buildId: Type.String({ maxLength: 128 }) });
  const requestHostOf = async (req: FastifyRequest) => (await requestRowOf(req, (req.params as { buildId: string }).buildId))?.host_id;
  const startRoute = { config: { ...keyRoute.config, hostBound: async (req: FastifyRequest) => onHost(await requestHostOf(req)) } };
  app.post("/v2/templates/:id/builds/:buildId", { ...startRoute, schema: { hide: true, params: BuildParams, body: StartBody } }, async (req, reply) => {
    const { id, buildId } = req.params as Static<typeof BuildParams>;
    const p = await pendingOf(req, buildId);
    if (!p || p.templateId !== id) {
      const started = await services.store.db.selectFrom("builds").select("id").where("id", "=", buildId).where("template_id", "=", id).executeTakeFirst();
      if (started) throw new KilnError("conflict", `Build ${buildId} has already started`);
      throw new KilnError("not_found", `No requested build ${buildId} of template ${id}: request it with POST /v3/templates (a request not started within an hour is forgotten)`);
    }
    const { req: request, copies } = buildRequestOf(p, req.body as StartBodyT);
    const context = new Map<string, { path: string; sha256: string; mode: string }>();
    for (const c of copies) for (const f of await files.unpack(c.hash, c.strip, services.builds.blobs)) context.set(f.path, f);
    if (context.size > MAX_ENTRIES) bad(`The copies hold more than ${MAX_ENTRIES} files together`);
    if (context.size) request.context = { files: [...context.values()] };
    const prepared = await services.builds.prepare(checked(request), req.apiKeyId ?? null);
    if (prepared.template.id !== id) throw new KilnError("conflict", `The name ${p.name} now belongs to another template`);
    // Taken once: of two starts at the same moment, one deletes the request and builds.
    const taken = await db.deleteFrom("e2b_build_requests").where("id", "=", buildId).executeTakeFirst();
    if (Number(taken.numDeletedRows) === 0) throw new KilnError("conflict", `Build ${buildId} has already started`);
    prepared.buildId = buildId;
    await services.builds.start(prepared);
    return reply.code(202).send();
  });

  // 4. Status and logs: the build record's status, the durable log from `logsOffset` (entries already received).
  // Answered by the building host (its log's newest entries are there first): the request's host, then the build's.
  const statusRoute = { config: { ...keyRoute.config, hostBound: async (req: FastifyRequest): Promise<Bound> => {
    const { buildId } = req.params as { buildId: string };
    return onHost(await requestHostOf(req)) ?? { kind: "builds", id: buildId };
  } } };
  const StatusQuery = Type.Object({ logsOffset: Type.Optional(Type.Integer({ minimum: 0 })), limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 100 })), level: Type.Optional(Type.String()) }, { additionalProperties: true });
  app.get("/templates/:id/builds/:buildId/status", { ...statusRoute, schema: { hide: true, params: BuildParams, querystring: StatusQuery } }, async (req) => {
    const { id, buildId } = req.params as Static<typeof BuildParams>;
    const q = req.query as Static<typeof StatusQuery>;
    const p = await pendingOf(req, buildId);
    if (p && p.templateId === id) return { templateID: id, buildID: buildId, status: "waiting", logEntries: [], logs: [] };
    const row = await services.store.db.selectFrom("builds").select(["status", "failure_reason"]).where("id", "=", buildId).where("template_id", "=", id).executeTakeFirst();
    if (!row) throw new KilnError("not_found", `No build ${buildId} of template ${id}`);
    const entries = await services.builds.readLog(buildId, q.logsOffset ?? 0, q.limit ?? LOG_PAGE);
    const logEntries = entries.map((e) => e2bLogEntry(e.entry));
    const status = row.status === "ready" ? "ready" : row.status === "error" || row.status === "cancelled" ? "error" : row.status === "waiting" ? "waiting" : "building";
    let reason: { message: string; step?: string; logEntries: ReturnType<typeof e2bLogEntry>[] } | undefined;
    if (status === "error") {
      const last = await services.store.db.selectFrom("build_logs").select("entry_json").where("build_id", "=", buildId).where("kind", "in", ["error", "cancelled"]).orderBy("seq", "desc").limit(1).executeTakeFirst();
      const terminal = last ? (JSON.parse(last.entry_json) as LogEntry) : undefined;
      reason = { message: terminal?.message ?? row.failure_reason ?? `the build ended ${row.status}`, ...(terminal?.step_index !== undefined ? { step: String(terminal.step_index) } : {}), logEntries: [] };
    }
    return { templateID: id, buildID: buildId, status, logEntries, logs: logEntries.map((e) => `[${e.timestamp}] ${e.message}`), ...(reason ? { reason } : {}) };
  });

  // Tags of a template: Kiln's tags and the build each points at.
  app.get("/templates/:id/tags", { ...keyRoute, schema: { hide: true, params: Type.Object({ id: Type.String({ maxLength: 256 }) }) } }, async (req) => {
    const { id } = req.params as { id: string };
    let t = id.startsWith("tpl_") ? await services.store.db.selectFrom("templates").select("id").where("id", "=", id).executeTakeFirst() : undefined;
    if (!t && !id.startsWith("tpl_")) t = await services.store.db.selectFrom("templates").select("id").where("canonical_ref", "=", parseTemplateRef(id).canonicalRef).executeTakeFirst();
    if (!t) throw new KilnError("not_found", `No template ${JSON.stringify(id)}`);
    const rows = await services.store.db.selectFrom("artifact_tags").innerJoin("artifacts", "artifacts.id", "artifact_tags.artifact_id").select(["artifact_tags.tag", "artifact_tags.updated_at", "artifacts.build_id"]).where("artifact_tags.template_id", "=", t.id).orderBy("artifact_tags.tag").execute();
    return rows.map((r) => ({ tag: r.tag, buildID: r.build_id ?? "", createdAt: r.updated_at }));
  });
}
