// E2B's volume content API (`/volumecontent/{volumeID}/…`: `Volume.list`, `makeDir`, `getInfo`, `exists`,
// `updateMetadata`, `readFile`, `writeFile`, `remove`) onto Kiln's volume files (src/volumes/files.ts): the same
// fd-walked, O_NOFOLLOW operations, path normalisation (`..` stops at the volume root) and size bounds as
// `/v1/volumes/{id}/files`. It authenticates with the volume's token (`e2b-volume-token`, see index.ts): what
// `Volume.create`/`getInfo` hand out, bound to that volume and to the API key that asked, dying with the key.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance } from "fastify";
import type { Readable } from "node:stream";
import type { Services } from "../../services/index.ts";
import type { FileInfo } from "../../agent/protocol.ts";
import { KilnError } from "../../errors.ts";
import { limitBytes } from "../../api/routes/files.ts";
import { volumePathComponents, volumePathOf } from "../../volumes/files.ts";

/** The machines' user, who owns every file of a Kiln volume (uid and gid as the machines see them). */
export const VOLUME_FILE_OWNER_ID = 1000;
/** Entries one `list` answers: E2B answers a whole tree (depth ≤ 10) at once, Kiln bounds it. */
export const MAX_LISTED_ENTRIES = 10_000;

const VolumeId = Type.Object({ id: Type.String({ pattern: "^vol_[0-9a-z]{26}$" }) });
const Path = Type.String({ minLength: 1, maxLength: 4096 });
const Id32 = Type.Integer({ minimum: 0, maximum: 4294967295 });
const Owner = { uid: Type.Optional(Id32), gid: Type.Optional(Id32), mode: Type.Optional(Type.Integer({ minimum: 0, maximum: 0o7777 })) };
const CreateQuery = Type.Object({ path: Path, ...Owner, force: Type.Optional(Type.Boolean()) }, { additionalProperties: false });
const PathQuery = Type.Object({ path: Path }, { additionalProperties: false });
const ListQuery = Type.Object({ path: Path, depth: Type.Optional(Type.Integer({ minimum: 0 })) }, { additionalProperties: false });
const MetadataBody = Type.Object(Owner, { additionalProperties: false });

/** E2B's VolumeEntryStat from Kiln's file info. Kiln's info carries one time, the mtime: atime and ctime are it too. */
function entryStat(f: FileInfo) {
  const id = (name: string) => (name === "root" ? 0 : name === "user" ? VOLUME_FILE_OWNER_ID : /^\d+$/.test(name) ? Number(name) : 65534);
  return {
    name: f.name,
    path: f.path,
    type: f.type,
    size: f.size,
    mode: parseInt(f.mode, 8),
    uid: id(f.owner),
    gid: id(f.group),
    atime: f.modified_time,
    mtime: f.modified_time,
    ctime: f.modified_time,
    ...(f.symlink_target !== undefined ? { target: f.symlink_target } : {}),
  };
}

/** Kiln's volume files all belong to the machines' user: another owner is refused, never silently ignored. */
function checkOwner(q: { uid?: number; gid?: number }) {
  for (const [what, v] of [
    ["uid", q.uid],
    ["gid", q.gid],
  ] as const) {
    if (v !== undefined && v !== VOLUME_FILE_OWNER_ID) throw new KilnError("invalid_request", `${what} ${v} is not served: a Kiln volume's files belong to the machines' user (${VOLUME_FILE_OWNER_ID})`);
  }
}

const parentOf = (path: string) => volumePathOf(volumePathComponents(path).slice(0, -1));

export async function volumeContentRoutes(app: FastifyInstance, services: Services) {
  const config = { e2b: "control", auth: "e2b-volume-token" as const };
  const files = async (id: string) => (await services.volumes.resolveDataPlane(id)).files;
  const bodyLimit = app.initialConfig.bodyLimit ?? 1024 * 1024;

  /** E2B's create without `force`: the parent must exist (404) and the name must be free (409). */
  async function checkCreate(f: Awaited<ReturnType<typeof files>>, path: string) {
    const parent = await f.exists(parentOf(path));
    if (!parent || parent.type !== "directory") throw new KilnError("not_found", `${parentOf(path)} is not a directory of this volume`);
    if (await f.exists(path)) throw new KilnError("conflict", `${volumePathOf(volumePathComponents(path))} already exists`);
  }

  app.get("/volumecontent/:id/dir", { config, schema: { hide: true, params: VolumeId, querystring: ListQuery } }, async (req) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const q = req.query as Static<typeof ListQuery>;
    const depth = Math.max(1, q.depth ?? 1);
    if (depth > 10) throw new KilnError("invalid_request", "depth must be between 1 and 10");
    const f = await files(id);
    const out: ReturnType<typeof entryStat>[] = [];
    let after: string[] | undefined;
    for (;;) {
      const page = await f.list(q.path, depth, { limit: 1000, after });
      for (const e of page.entries) out.push(entryStat(e));
      if (out.length > MAX_LISTED_ENTRIES) throw new KilnError("invalid_request", `${q.path} holds more than ${MAX_LISTED_ENTRIES} entries at depth ${depth}: list a deeper path or a smaller depth`);
      if (!page.next) return out;
      after = page.next;
    }
  });

  app.post("/volumecontent/:id/dir", { config, schema: { hide: true, params: VolumeId, querystring: CreateQuery } }, async (req, reply) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const q = req.query as Static<typeof CreateQuery>;
    checkOwner(q);
    if (volumePathComponents(q.path).length === 0) throw new KilnError("conflict", "/ already exists");
    const f = await files(id);
    if (!q.force) await checkCreate(f, q.path);
    return reply.code(201).send(entryStat(await f.mkdir(q.path, q.mode ?? 0o755)));
  });

  app.get("/volumecontent/:id/path", { config, schema: { hide: true, params: VolumeId, querystring: PathQuery } }, async (req) => {
    const { id } = req.params as Static<typeof VolumeId>;
    return entryStat(await (await files(id)).info((req.query as Static<typeof PathQuery>).path));
  });

  app.patch("/volumecontent/:id/path", { config, schema: { hide: true, params: VolumeId, querystring: PathQuery, body: MetadataBody } }, async (req) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const { path } = req.query as Static<typeof PathQuery>;
    const body = req.body as Static<typeof MetadataBody>;
    checkOwner(body);
    const f = await files(id);
    return entryStat(body.mode === undefined ? await f.info(path) : await f.setMode(path, body.mode));
  });

  app.delete("/volumecontent/:id/path", { config, schema: { hide: true, params: VolumeId, querystring: PathQuery } }, async (req, reply) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const { path } = req.query as Static<typeof PathQuery>;
    if (volumePathComponents(path).length === 0) throw new KilnError("invalid_request", "The volume root / cannot be removed");
    const f = await files(id);
    await f.info(path); // 404 for a missing path, as E2B
    await f.remove(path, true);
    return reply.code(204).send();
  });

  app.get("/volumecontent/:id/file", { config, schema: { hide: true, params: VolumeId, querystring: PathQuery } }, async (req, reply) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const stream = await (await files(id)).read((req.query as Static<typeof PathQuery>).path);
    return reply.type("application/octet-stream").send(stream);
  });

  app.put("/volumecontent/:id/file", { config, schema: { hide: true, params: VolumeId, querystring: CreateQuery } }, async (req, reply) => {
    const { id } = req.params as Static<typeof VolumeId>;
    const q = req.query as Static<typeof CreateQuery>;
    const body = req.body as Readable | Buffer | string | undefined;
    if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the file's bytes as the request body (Content-Type: application/octet-stream)");
    try {
      checkOwner(q);
      if (Number(req.headers["content-length"] ?? 0) > bodyLimit) throw new KilnError("payload_too_large", `The file is larger than the ${bodyLimit}-byte limit`);
      const f = await files(id);
      // Without force E2B creates only (O_EXCL) in an existing directory; with it, parents are made and a file replaced.
      if (!q.force) await checkCreate(f, q.path);
      const data = typeof body === "string" ? Buffer.from(body) : Buffer.isBuffer(body) ? body : limitBytes(body, bodyLimit).stream;
      return reply.code(201).send(entryStat(await f.write(q.path, data, { mode: q.mode })));
    } catch (err) {
      // A refused upload leaves body bytes unread: the connection cannot carry another request.
      if (!req.raw.readableEnded) reply.header("connection", "close");
      throw err;
    }
  });
}
