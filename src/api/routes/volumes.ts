// Volumes: create, list, get, delete, and their files under /v1/volumes/{id}/files… with paths rooted at the
// volume's own `/` (no `user`, no relative paths: a volume has no users and no working directory).

import { Type } from "typebox";
import type { Readable } from "node:stream";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { VOLUME_LIMITS, VOLUME_STATUSES } from "../../volumes/service.ts";
import { errors, Cursor, FileListPage, FileMetadata, Id, Limit, ListCursor, ListDepth, ListLimit, OctalMode } from "../schemas.ts";
import { decodeListCursor, nextCursor, encodeListCursor, pageAfter } from "../../store/cursor.ts";
import { LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT } from "../../agent/list-pages.ts";
import { KilnError } from "../../errors.ts";
import { limitBytes } from "./files.ts";

const Params = Type.Object({ id: Id });
const VolumePath = Type.String({ minLength: 1, maxLength: 4096, pattern: "^/", description: "Volume path, rooted at the volume's /" });

export const Volume = Type.Object({
  id: Type.String(),
  name: Type.String(),
  size_mb: Type.Integer(),
  status: Type.Enum(VOLUME_STATUSES),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  host_id: Type.Union([Type.String(), Type.Null()], { description: "The host that holds its data: machines mounting it are placed there" }),
});

const CreateVolume = Type.Object(
  {
    name: Type.String({ minLength: 1, maxLength: 128, pattern: "^[A-Za-z0-9][A-Za-z0-9._-]*$" }),
    size_mb: Type.Optional(Type.Integer({ minimum: VOLUME_LIMITS.minSizeMb, maximum: VOLUME_LIMITS.maxSizeMb, description: `Size limit in MiB (default ${VOLUME_LIMITS.defaultSizeMb})` })),
  },
  { additionalProperties: false },
);

export async function volumeRoutes(app: App, opts: { services: Services }) {
  const { volumes } = opts.services;
  const tags = ["Volumes"];
  const fileErrors = errors(400, 403, 404, 409);
  const files = async (id: string) => (await volumes.resolveDataPlane(id)).files;

  app.post(
    "/v1/volumes",
    { config: { auth: "key" }, schema: { tags, summary: "Create a volume (an ext4 filesystem of size_mb, mounted into machines at create)", body: CreateVolume, response: { 201: Volume, ...errors(400) } } },
    async (req, reply) => reply.code(201).send(await volumes.create(req.body)),
  );

  app.get(
    "/v1/volumes",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List volumes, newest first",
        querystring: Type.Object({ limit: Type.Optional(Limit), cursor: Type.Optional(Cursor) }, { additionalProperties: false }),
        response: { 200: Type.Object({ volumes: Type.Array(Volume), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400) },
      },
    },
    async (req) => {
      const after = pageAfter(req.query.cursor);
      const page = await volumes.list({ limit: req.query.limit ?? 50, after });
      return { volumes: page.volumes, next_cursor: nextCursor(page) };
    },
  );

  app.get("/v1/volumes/:id", { config: { auth: "key" }, schema: { tags, summary: "Get a volume", params: Params, response: { 200: Volume, ...errors(404) } } }, async (req) => volumes.get(req.params.id));

  app.delete(
    "/v1/volumes/:id",
    { config: { auth: "key" }, schema: { tags, summary: "Delete a volume and its data (409 while a live machine mounts it)", params: Params, response: { 204: Type.Null(), ...errors(404, 409) } } },
    async (req, reply) => {
      await volumes.remove(req.params.id);
      return reply.code(204).send(null);
    },
  );

  app.post(
    "/v1/volumes/:id/move",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Move an unmounted volume to another host (409 while a live machine mounts it)",
        description:
          "The volume's host streams its image to the target host, which checks its digest and, once its copy is whole, switches the " +
          "volume's `host_id` to itself in one step; the old host then removes its copy. Machines that mount the volume are placed on its new host.",
        params: Params,
        body: Type.Object({ host_id: Type.String({ pattern: "^[A-Za-z0-9_.-]{1,64}$", description: "the target host's id (GET /v1/hosts)" }) }, { additionalProperties: false }),
        response: { 200: Volume, ...errors(400, 404, 409, 503) },
      },
    },
    async (req) => volumes.move(req.params.id, req.body.host_id),
  );

  // Between hosts only (auth `cluster`): the image of a volume being moved here, streamed by its host. Checked
  // against the volume's recorded size and the digest the sender computed before it is kept (src/volumes/move.ts).
  app.put(
    "/v1/cluster/volumes/:id/image",
    {
      config: { auth: "cluster" },
      schema: {
        hide: true,
        params: Params,
        querystring: Type.Object({ digest: Type.String({ pattern: "^sha256:[0-9a-f]{64}$" }), bytes: Type.Integer({ minimum: 1 }) }, { additionalProperties: false }),
      },
    },
    async (req, reply) => {
      if (!req.headers["content-type"]?.startsWith("application/octet-stream")) throw new KilnError("unsupported_media_type", "A volume image is sent as application/octet-stream");
      if (req.forwardedBy === undefined) throw new KilnError("unauthorized", "Only a peer host sends a volume's image");
      await volumes.receive(req.params.id, req.forwardedBy, req.body as Readable, req.query.bytes, req.query.digest);
      return reply.code(204).send();
    },
  );

  app.post(
    "/v1/volumes/:id/files/info",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "File metadata (lstat) of a volume path",
        params: Params,
        body: Type.Object({ path: VolumePath }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => (await files(req.params.id)).info(req.body.path),
  );

  app.get(
    "/v1/volumes/:id/files",
    { config: { auth: "key" }, schema: { tags, summary: "Read a file's bytes", params: Params, querystring: Type.Object({ path: VolumePath }, { additionalProperties: false }), response: { ...fileErrors } } },
    async (req, reply) => {
      const stream = await (await files(req.params.id)).read(req.query.path);
      return reply.type("application/octet-stream").send(stream);
    },
  );

  app.put(
    "/v1/volumes/:id/files",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Write a file from the request body (application/octet-stream); parents are created",
        params: Params,
        querystring: Type.Object({ path: VolumePath, mode: Type.Optional(OctalMode) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...errors(400, 403, 404, 409, 413, 415) },
      },
    },
    async (req, reply) => {
      const body = req.body as Readable | Buffer | string | undefined;
      if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the file's bytes as the request body (Content-Type: application/octet-stream)");
      const limit = app.initialConfig.bodyLimit ?? 1024 * 1024;
      const declared = Number(req.headers["content-length"] ?? 0);
      if (declared > limit) throw new KilnError("payload_too_large", `The file is larger than the ${limit}-byte limit`);
      const data = typeof body === "string" ? Buffer.from(body) : Buffer.isBuffer(body) ? body : limitBytes(body, limit).stream;
      const f = await files(req.params.id);
      try {
        return await f.write(req.query.path, data, { mode: req.query.mode ? parseInt(req.query.mode, 8) : undefined });
      } catch (err) {
        // A refused upload (the volume filled up) leaves body bytes unread: the connection cannot carry another request.
        if (!req.raw.readableEnded) reply.header("connection", "close");
        throw err;
      }
    },
  );

  app.get(
    "/v1/volumes/:id/files/list",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List a directory",
        params: Params,
        description: `Depth-first, each directory's names in order; at most \`limit\` entries per answer (default ${LIST_DEFAULT_LIMIT}, at most ${LIST_MAX_LIMIT}), the rest through \`next_cursor\` (null on the last page), with the same path and depth.`,
        querystring: Type.Object({ path: VolumePath, depth: Type.Optional(ListDepth), limit: Type.Optional(ListLimit), cursor: Type.Optional(ListCursor) }, { additionalProperties: false }),
        response: { 200: FileListPage, ...fileErrors },
      },
    },
    async (req) => {
      const listing = { path: req.query.path, depth: req.query.depth ?? 1 };
      const after = req.query.cursor ? decodeListCursor(req.query.cursor, listing) : undefined;
      const page = await (await files(req.params.id)).list(listing.path, listing.depth, { limit: req.query.limit ?? LIST_DEFAULT_LIMIT, after });
      return { entries: page.entries, next_cursor: page.next ? encodeListCursor(listing, page.next) : null };
    },
  );

  app.delete(
    "/v1/volumes/:id/files",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Remove a file or directory (a symlink itself, never what it points at)",
        params: Params,
        querystring: Type.Object({ path: VolumePath, recursive: Type.Optional(Type.Boolean({ default: false })) }, { additionalProperties: false }),
        response: { 204: Type.Null(), ...fileErrors },
      },
    },
    async (req, reply) => {
      await (await files(req.params.id)).remove(req.query.path, req.query.recursive ?? false);
      return reply.code(204).send(null);
    },
  );

  app.post(
    "/v1/volumes/:id/files/mkdir",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Make a directory and its parents",
        params: Params,
        body: Type.Object({ path: VolumePath, mode: Type.Optional(OctalMode) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => (await files(req.params.id)).mkdir(req.body.path, req.body.mode ? parseInt(req.body.mode, 8) : undefined),
  );

  app.post(
    "/v1/volumes/:id/files/move",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Move or rename a file or directory inside the volume",
        params: Params,
        body: Type.Object({ src: VolumePath, dest: VolumePath }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => (await files(req.params.id)).move(req.body.src, req.body.dest),
  );
}
