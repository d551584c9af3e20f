// Files of a machine: read and write bytes, list, metadata (SPEC.md's POST …/files/info), mkdir, remove, move.
// Relative paths resolve by SPEC.md's rule in the file service, never here.

import { Type } from "typebox";
import { Transform } from "node:stream";
import type { Readable } from "node:stream";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors, FileListPage, FileMetadata, Id, ListCursor, ListDepth, ListLimit, MachinePath, OctalMode, UserName } from "../schemas.ts";
import { LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT } from "../../agent/list-pages.ts";
import { KilnError } from "../../errors.ts";

const Params = Type.Object({ id: Id });
const PathQuery = Type.Object({ path: MachinePath, user: Type.Optional(UserName) }, { additionalProperties: false });

export async function fileRoutes(app: App, opts: { services: Services }) {
  const { files } = opts.services;
  const tags = ["Files"];
  const fileErrors = errors(400, 404, 409);

  app.post(
    "/v1/machines/:id/files/info",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "File metadata (lstat) of a machine path",
        params: Params,
        body: Type.Object({ path: MachinePath, user: Type.Optional(UserName) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => files.info(req.params.id, req.body),
  );

  app.get(
    "/v1/machines/:id/files",
    { config: { auth: "key" }, schema: { tags, summary: "Read a file's bytes", params: Params, querystring: PathQuery, response: { ...fileErrors } } },
    async (req, reply) => {
      const stream = await files.read(req.params.id, req.query);
      return reply.type("application/octet-stream").send(stream);
    },
  );

  app.put(
    "/v1/machines/:id/files",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Write a file from the request body (application/octet-stream); parents are created",
        params: Params,
        querystring: Type.Object({ path: MachinePath, user: Type.Optional(UserName), mode: Type.Optional(OctalMode) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...errors(400, 404, 409, 413, 415) },
      },
    },
    async (req) => {
      const body = req.body as Readable | Buffer | string | undefined;
      if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the file's bytes as the request body (Content-Type: application/octet-stream)");
      const limit = app.initialConfig.bodyLimit ?? 1024 * 1024;
      const declared = Number(req.headers["content-length"] ?? 0);
      if (declared > limit) throw tooLarge(limit);
      if (typeof body === "string" || Buffer.isBuffer(body)) return files.write(req.params.id, req.query, typeof body === "string" ? Buffer.from(body) : body);
      // A chunked upload declares no length: count as it streams, and answer 413 (not the agent's failure) past the limit.
      const limited = limitBytes(body, limit);
      return files.write(req.params.id, req.query, limited.stream).catch((err: unknown) => {
        throw limited.exceeded() ? tooLarge(limit) : err;
      });
    },
  );

  app.get(
    "/v1/machines/:id/files/list",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List a directory",
        params: Params,
        description: `Depth-first, each directory's names in order; at most \`limit\` entries per answer (default ${LIST_DEFAULT_LIMIT}, at most ${LIST_MAX_LIMIT}), the rest through \`next_cursor\` (null on the last page), with the same path and depth.`,
        querystring: Type.Object({ path: MachinePath, user: Type.Optional(UserName), depth: Type.Optional(ListDepth), limit: Type.Optional(ListLimit), cursor: Type.Optional(ListCursor) }, { additionalProperties: false }),
        response: { 200: FileListPage, ...fileErrors },
      },
    },
    async (req) => files.list(req.params.id, req.query),
  );

  app.delete(
    "/v1/machines/:id/files",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Remove a file or directory",
        params: Params,
        querystring: Type.Object({ path: MachinePath, user: Type.Optional(UserName), recursive: Type.Optional(Type.Boolean({ default: false })) }, { additionalProperties: false }),
        response: { 204: Type.Null(), ...fileErrors },
      },
    },
    async (req, reply) => {
      await files.remove(req.params.id, req.query);
      return reply.code(204).send(null);
    },
  );

  app.post(
    "/v1/machines/:id/files/mkdir",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Make a directory and its parents",
        params: Params,
        body: Type.Object({ path: MachinePath, user: Type.Optional(UserName), mode: Type.Optional(OctalMode) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => files.mkdir(req.params.id, req.body),
  );

  app.post(
    "/v1/machines/:id/files/move",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Move or rename a file or directory",
        params: Params,
        body: Type.Object({ src: MachinePath, dest: MachinePath, user: Type.Optional(UserName) }, { additionalProperties: false }),
        response: { 200: FileMetadata, ...fileErrors },
      },
    },
    async (req) => files.move(req.params.id, req.body),
  );
}

const tooLarge = (limit: number) => new KilnError("payload_too_large", `The file is larger than the ${limit}-byte limit`);

/** Passes a byte stream through, failing it once it exceeds `limit` (chunked uploads); says whether it did. */
export function limitBytes(source: Readable, limit: number): { stream: Readable; exceeded: () => boolean } {
  let seen = 0;
  const counter = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      seen += chunk.length;
      if (seen > limit) cb(tooLarge(limit));
      else cb(null, chunk);
    },
  });
  source.on("error", (err) => counter.destroy(err));
  return { stream: source.pipe(counter), exceeded: () => seen > limit };
}
