// Snapshots: take one of a machine, list, inspect and delete them, and fork a machine into many. Machines are made
// from a snapshot through POST /v1/machines {snapshot} (routes/machines.ts); the rules are in docs/snapshots.md.

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { MACHINE_LIMITS } from "../../machines/service.ts";
import { INPUT_LIMITS } from "../../machines/input-limits.ts";
import { SNAPSHOT_LIMITS } from "../../snapshots/service.ts";
import { Snapshot } from "../../snapshots/views.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";
import { errors, Cursor, Id, Limit, Machine, Metadata, NoNul } from "../schemas.ts";
import { emptyBodyIsEmptyObject } from "./machines.ts";

const Params = Type.Object({ id: Id });

const CreateSnapshot = Type.Object(
  {
    name: Type.Optional(NoNul({ minLength: 1, maxLength: INPUT_LIMITS.nameChars })),
    memory: Type.Optional(Type.Boolean({ default: false, description: "Save the machine's running processes too (gVisor); 400 with the reason where the runtime cannot" })),
    metadata: Type.Optional(Metadata),
  },
  { additionalProperties: false },
);

const Fork = Type.Object(
  {
    count: Type.Optional(Type.Integer({ minimum: 1, maximum: SNAPSHOT_LIMITS.maxForkCount, default: 1 })),
    timeout_s: Type.Optional(Type.Integer({ minimum: 1, maximum: MACHINE_LIMITS.maxTimeoutS })),
    metadata: Type.Optional(Metadata),
    memory: Type.Optional(Type.Boolean({ default: false, description: "Children continue the parent's running processes (gVisor); 400 with the reason where the runtime cannot" })),
  },
  { additionalProperties: false },
);

export async function snapshotRoutes(app: App, opts: { services: Services }) {
  const { snapshots } = opts.services;
  const tags = ["Snapshots"];

  app.post(
    "/v1/machines/:id/snapshots",
    {
      config: { auth: "key" },
      schema: { tags, summary: "Snapshot a machine (its disk, and with memory its processes); the machine goes on", params: Params, body: CreateSnapshot, response: { 201: Snapshot, ...errors(400, 404, 409, 503) } },
      preValidation: emptyBodyIsEmptyObject,
    },
    async (req, reply) => reply.code(201).send(await snapshots.create(req.params.id, req.body ?? {})),
  );

  app.post(
    "/v1/machines/:id/fork",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Snapshot a machine and make count machines from it in one call; the parent goes on",
        params: Params,
        body: Fork,
        response: { 201: Type.Object({ machines: Type.Array(Machine) }), ...errors(400, 404, 409, 503) },
      },
      preValidation: emptyBodyIsEmptyObject,
    },
    async (req, reply) => reply.code(201).send(await snapshots.fork(req.params.id, req.body ?? {})),
  );

  app.get(
    "/v1/snapshots",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List snapshots, newest first",
        querystring: Type.Object({ machine_id: Type.Optional(Id), limit: Type.Optional(Limit), cursor: Type.Optional(Cursor) }, { additionalProperties: false }),
        response: { 200: Type.Object({ snapshots: Type.Array(Snapshot), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400) },
      },
    },
    async (req) => {
      const page = await snapshots.list({ limit: req.query.limit ?? 50, after: pageAfter(req.query.cursor), machineId: req.query.machine_id });
      return { snapshots: page.snapshots, next_cursor: nextCursor(page) };
    },
  );

  app.get("/v1/snapshots/:id", { config: { auth: "key" }, schema: { tags, summary: "Get a snapshot", params: Params, response: { 200: Snapshot, ...errors(404) } } }, async (req) =>
    snapshots.get(req.params.id),
  );

  app.delete(
    "/v1/snapshots/:id",
    { config: { auth: "key" }, schema: { tags, summary: "Delete a snapshot; machines made from it keep their own copies", params: Params, response: { 200: Snapshot, ...errors(404, 409) } } },
    async (req) => snapshots.remove(req.params.id),
  );
}
