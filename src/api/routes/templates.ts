// Templates: the streaming build (SSE), context blobs, build history, log replay, cancel, aliases, and the
// template list/get/delete. Validation and blob failures answer an envelope before any stream starts.

import { Type } from "typebox";
import type { FastifyReply, FastifyRequest } from "fastify";
import type { Readable } from "node:stream";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { errors, Id, Limit, Cursor } from "../schemas.ts";
import { BuildRequest } from "../../builder/request.ts";
import { BUILD_BACKENDS, BUILD_STATUSES, SOURCE_TYPES } from "../../builder/enums.ts";
import { sseFrame, SSE_KEEPALIVE } from "../../builder/log.ts";
import { SHA256_HEX } from "../../builder/context.ts";
import { KilnError } from "../../errors.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";

/** SSE comment sent while nothing else is, so proxies and clients keep the stream open. */
const KEEPALIVE_MS = 15_000;

const CacheSummary = Type.Record(Type.String(), Type.Integer());
const BuildRecord = Type.Object({
  build_id: Type.String(),
  template_id: Type.String(),
  name: Type.String(),
  tags: Type.Array(Type.String()),
  status: Type.Enum(BUILD_STATUSES),
  build_backend: Type.Enum(BUILD_BACKENDS),
  source_type: Type.Enum(SOURCE_TYPES),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  source_digest: Type.Union([Type.String(), Type.Null()]),
  context_digest: Type.Union([Type.String(), Type.Null()]),
  dockerfile_digest: Type.Union([Type.String(), Type.Null()]),
  triggered_by: Type.Union([Type.String(), Type.Null()]),
  queued_at: Type.String({ format: "date-time" }),
  started_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  finished_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  duration_ms: Type.Union([Type.Integer(), Type.Null()]),
  failure_phase: Type.Union([Type.String(), Type.Null()]),
  cache_summary: CacheSummary,
  artifact_availability: Type.Object({ status: Type.String(), reason: Type.String() }),
  promotability: Type.Object({ status: Type.String(), promotable: Type.Boolean(), reason: Type.String() }),
  retention_expires_at: Type.Union([Type.String({ format: "date-time" }), Type.Null()]),
  artifact_ids: Type.Array(Type.String()),
  host_id: Type.Union([Type.String(), Type.Null()], { description: "The host that ran the build (its live log stream and cancel are served there through any server)" }),
});

const Template = Type.Object({
  template_id: Type.String(),
  namespace: Type.String(),
  name: Type.String(),
  canonical_ref: Type.String(),
  aliases: Type.Array(Type.String()),
  tags: Type.Record(Type.String(), Type.String()),
  artifacts: Type.Array(Type.Object({}, { additionalProperties: true })),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
});

const TemplateParams = Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }) });
const BuildParams = Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }), build_id: Id });
const SseResponse = { 200: { description: "text/event-stream of build log entries (id: <seq>, event: <kind>, data: <json>)", content: { "text/event-stream": { schema: Type.String() } } } };

export async function templateRoutes(app: App, opts: { services: Services }) {
  const { builds, templateCatalog } = opts.services;
  const tags = ["Templates"];

  /**
   * Streams a build's log from after `after` until its terminal entry; a client going away only stops its copy. A
   * client that stops reading holds only its socket's buffer: the cursor waits for `drain`, then reads on from the
   * store, so a slow reader sees every entry with the ids a live one saw.
   */
  async function streamLog(req: FastifyRequest, reply: FastifyReply, buildId: string, after: number) {
    reply.hijack();
    const res = reply.raw;
    res.writeHead(200, { "content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache, no-transform", connection: "keep-alive", "x-accel-buffering": "no", "x-request-id": req.id });
    let ended = false;
    // Only while the client keeps up: a keepalive queued behind unread entries says nothing.
    const keepalive = setInterval(() => res.writableLength === 0 && res.write(SSE_KEEPALIVE), KEEPALIVE_MS);
    const cursor = builds.follow(buildId, after, {
      write: (e) => res.write(sseFrame(e)),
      end: () => end(),
    });
    function end() {
      if (ended) return;
      ended = true;
      clearInterval(keepalive);
      cursor.stop();
      res.end();
    }
    res.on("drain", () => cursor.resume());
    res.on("close", end);
    req.log.info({ method: req.method, url: req.url.split("?")[0], status: 200, build_id: buildId }, "build log stream");
  }

  app.post(
    "/v1/templates/build",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Build a template; the answer is an SSE stream of build log entries ending in end, error or cancelled",
        body: BuildRequest,
        response: { ...SseResponse, ...errors(400, 404, 409, 422, 503) },
      },
    },
    async (req, reply) => {
      const prepared = await builds.prepare(req.body, req.apiKeyId ?? null);
      const { buildId } = await builds.start(prepared);
      await streamLog(req, reply, buildId, 0);
    },
  );

  app.put(
    "/v1/templates/blobs/:sha256",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Upload a build-context blob (application/octet-stream); the bytes must hash to the sha256 in the path",
        params: Type.Object({ sha256: Type.String({ pattern: SHA256_HEX }) }),
        response: { 201: Type.Object({ sha256: Type.String(), size: Type.Integer() }), 200: Type.Object({ sha256: Type.String(), size: Type.Integer() }), ...errors(400, 413, 415) },
      },
    },
    async (req, reply) => {
      const body = req.body as Readable | Buffer | string | undefined;
      if (body === undefined || body === null) throw new KilnError("invalid_request", "Send the blob's bytes as the request body (Content-Type: application/octet-stream)");
      // Blobs are held to KILN_BODY_LIMIT_BYTES like every other body: by their declared length before a byte is
      // read, and by counting while they stream (a chunked upload declares none).
      const limit = app.initialConfig.bodyLimit ?? 1024 * 1024;
      if (Number(req.headers["content-length"] ?? 0) > limit) throw new KilnError("payload_too_large", `A context blob may hold at most ${limit} bytes (KILN_BODY_LIMIT_BYTES)`);
      const { Readable: R } = await import("node:stream");
      const stream = typeof body === "string" || Buffer.isBuffer(body) ? R.from([Buffer.from(body)]) : body;
      const r = await builds.blobs.put(req.params.sha256, stream, limit);
      return reply.code(r.created ? 201 : 200).send({ sha256: req.params.sha256, size: r.size });
    },
  );

  app.get(
    "/v1/templates/blobs/:sha256",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Whether a context blob is stored (HEAD answers 200 or 404 without a body)",
        params: Type.Object({ sha256: Type.String({ pattern: SHA256_HEX }) }),
        response: { 200: Type.Object({ sha256: Type.String(), size: Type.Integer() }), ...errors(400, 404) },
      },
    },
    async (req) => {
      const st = await builds.blobs.has(req.params.sha256);
      if (!st) throw new KilnError("not_found", `No blob ${req.params.sha256}`);
      return { sha256: req.params.sha256, size: st.size };
    },
  );

  app.get("/v1/templates", { config: { auth: "key" }, schema: { tags, summary: "List templates", response: { 200: Type.Object({ templates: Type.Array(Template) }) } } }, async () => templateCatalog.list());

  app.get(
    "/v1/templates/:id",
    { config: { auth: "key" }, schema: { tags, summary: "Get a template by id, artifact id or unnamespaced ref", params: TemplateParams, response: { 200: Template, ...errors(404) } } },
    async (req) => templateCatalog.get(req.params.id),
  );

  app.delete(
    "/v1/templates/:id",
    { config: { auth: "key" }, schema: { tags, summary: "Delete a template (refused while machines use it)", params: TemplateParams, response: { 200: Template, ...errors(404, 409) } } },
    async (req) => templateCatalog.remove(req.params.id),
  );

  app.get(
    "/v1/templates/:id/builds",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Build history of a template, newest first; id is an artifact id or a legacy unnamespaced ref",
        params: TemplateParams,
        querystring: Type.Object(
          {
            status: Type.Optional(Type.Enum(BUILD_STATUSES)),
            build_backend: Type.Optional(Type.Enum(BUILD_BACKENDS)),
            source_type: Type.Optional(Type.Enum(SOURCE_TYPES)),
            limit: Type.Optional(Limit),
            cursor: Type.Optional(Cursor),
          },
          { additionalProperties: false },
        ),
        response: { 200: Type.Object({ builds: Type.Array(BuildRecord), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400, 404) },
      },
    },
    async (req) => {
      const { cursor, ...filters } = req.query;
      const page = await builds.list(req.params.id, { ...filters, limit: req.query.limit ?? 50, after: pageAfter(cursor) });
      return { builds: page.builds, next_cursor: nextCursor(page) };
    },
  );

  app.get(
    "/v1/templates/:id/builds/:build_id",
    { config: { auth: "key" }, schema: { tags, summary: "One build record", params: BuildParams, response: { 200: BuildRecord, ...errors(404) } } },
    async (req) => builds.get(req.params.id, req.params.build_id),
  );

  app.get(
    "/v1/templates/:id/builds/:build_id/logs",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Replay a build's log as SSE and follow it while it runs; honours Last-Event-ID",
        params: BuildParams,
        querystring: Type.Object({ last_event_id: Type.Optional(Type.Integer({ minimum: 0 })) }, { additionalProperties: false }),
        headers: Type.Object({ "last-event-id": Type.Optional(Type.String({ pattern: "^[0-9]{1,12}$" })) }),
        response: { ...SseResponse, ...errors(400, 404) },
      },
    },
    async (req, reply) => {
      await builds.get(req.params.id, req.params.build_id);
      const header = req.headers["last-event-id"];
      const after = typeof header === "string" ? Number(header) : (req.query.last_event_id ?? 0);
      await streamLog(req, reply, req.params.build_id, after);
    },
  );

  app.post(
    "/v1/templates/:id/builds/:build_id/cancel",
    { config: { auth: "key" }, schema: { tags, summary: "Cancel a running build (its build machine is destroyed; the record ends cancelled)", params: BuildParams, response: { 200: BuildRecord, ...errors(404, 409) } } },
    async (req) => builds.cancel(req.params.id, req.params.build_id),
  );

  // The ref may contain "/": exactly one trailing `aliases` segment is the subresource (so local/aliases is
  // addressed as /v1/templates/refs/local/aliases/aliases).
  app.get(
    "/v1/templates/refs/*",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Read-only aliases of a logical template: GET /v1/templates/refs/{ref}/aliases",
        params: Type.Object({ "*": Type.String() }),
        response: { 200: Type.Array(Type.Object({ alias_ref: Type.String(), created_at: Type.String({ format: "date-time" }) })), ...errors(404) },
      },
    },
    async (req) => {
      const rest = req.params["*"];
      const m = /^(.+)\/aliases$/.exec(rest);
      if (!m) throw new KilnError("not_found", `No route GET /v1/templates/refs/${rest}: the path ends with /aliases`);
      return builds.aliases(decodeURIComponent(m[1]));
    },
  );
}
