// Agent Deployments: create, update (rolling), list, get, delete deployments; their service instances, the
// services' recent output, and the restart of SPEC.md (request-only envs, Idempotency-Key).

import { Type } from "typebox";
import type { FastifyReply, FastifyRequest } from "fastify";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { SERVICE_STATUSES } from "../../deployments/lifecycle.ts";
import { DEPLOYMENT_STATUSES, ROLLOUT_STATUSES } from "../../deployments/views.ts";
import { ACCESS_MODES, CreateDeployment, RestartRequest, UpdateDeployment } from "../../deployments/schemas.ts";
import { errors, Cursor, Id, Limit } from "../schemas.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";
import { KilnError } from "../../errors.ts";

const Nullable = <T extends Parameters<typeof Type.Union>[0][number]>(t: T) => Type.Union([t, Type.Null()]);

const ReadinessOut = Type.Object({ path: Type.Optional(Type.String()), interval_s: Type.Number(), timeout_s: Type.Number() });

const Version = Type.Object({
  id: Type.String(),
  number: Type.Integer(),
  template: Type.String(),
  command: Type.String(),
  port: Type.Integer(),
  env_names: Type.Array(Type.String(), { description: "Names of the version's envs; their values are sealed at rest and never shown" }),
  readiness: ReadinessOut,
  created_at: Type.String({ format: "date-time" }),
});

const Deployment = Type.Object({
  id: Type.String(),
  name: Type.String(),
  status: Type.Enum(DEPLOYMENT_STATUSES),
  current_version_id: Type.String(),
  version: Type.Integer(),
  template: Type.String(),
  command: Type.String(),
  port: Type.Integer(),
  env_names: Type.Array(Type.String()),
  readiness: ReadinessOut,
  replicas: Type.Integer(),
  public_url: Type.Boolean(),
  access: Type.Enum(ACCESS_MODES),
  edge_url: Nullable(
    Type.String({
      description:
        "The deployment's own public URL (any ready replica; the same across reads, rollouts and restarts) in `token` and `public` access; null for `signed` or without public_url. A `token` URL is a credential: keep it out of logs",
    }),
  ),
  rollout_status: Type.Enum(ROLLOUT_STATUSES),
  rollout_error: Nullable(Type.String()),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  deleted_at: Nullable(Type.String({ format: "date-time" })),
  versions: Type.Optional(Type.Array(Version)),
});

/** The agent service instance of SPEC.md. */
const ServiceInstance = Type.Object({
  id: Type.String(),
  deployment_id: Type.String(),
  version_id: Type.String(),
  status: Type.Enum(SERVICE_STATUSES),
  port: Type.Integer({ minimum: 1, maximum: 65535 }),
  created_at: Type.String({ format: "date-time" }),
  updated_at: Type.String({ format: "date-time" }),
  machine_id: Type.String(),
  process_id: Nullable(Type.Integer()),
  public_url: Nullable(
    Type.String({ description: "Edge URL of a ready service, as its deployment's access makes it (stable token, public, or signed and expiring); an edge_token is a credential: never log or store it" }),
  ),
  readiness_status: Type.Object({}, { additionalProperties: true }),
  failure_reason: Nullable(Type.String()),
  started_at: Nullable(Type.String({ format: "date-time" })),
  stopped_at: Nullable(Type.String({ format: "date-time" })),
  idempotency_key: Nullable(Type.String()),
});

const ServiceLogs = Type.Object({ service_id: Type.String(), process_id: Nullable(Type.Integer()), output: Type.String(), total_bytes: Type.Integer(), truncated: Type.Boolean() });

/**
 * Ajv coerces scalars to strings (the server's setting); envs accept only string values (SPEC.md for restart, the
 * same rule for deployment envs), so they are checked before validation runs. A bare body counts as `{}`.
 */
function stringEnvsOnly(req: FastifyRequest, _reply: FastifyReply, done: (err?: Error) => void) {
  if (req.body === undefined) req.body = {};
  const envs = (req.body as { envs?: unknown }).envs;
  if (envs !== undefined && (typeof envs !== "object" || envs === null || Array.isArray(envs) || Object.values(envs).some((v) => typeof v !== "string"))) {
    return done(new KilnError("invalid_request", "envs must be an object of string values", { detail: { code: "invalid_request", details: { field: "envs" } } }));
  }
  done();
}

const DepParams = Type.Object({ deployment_id: Id });
const SvcParams = Type.Object({ deployment_id: Id, service_id: Id });

export async function deploymentRoutes(app: App, opts: { services: Services }) {
  const { deployments } = opts.services;
  const tags = ["Agent Deployments"];

  app.post(
    "/v1/agent-deployments",
    { config: { auth: "key" }, schema: { tags, summary: "Create a deployment: its first version and its replicas (starting)", body: CreateDeployment, response: { 201: Deployment, ...errors(400, 404, 503) } }, preValidation: stringEnvsOnly },
    async (req, reply) => reply.code(201).send(await deployments.create(req.body)),
  );

  app.get(
    "/v1/agent-deployments",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List deployments, newest first (deleted ones are left out)",
        querystring: Type.Object({ limit: Type.Optional(Limit), cursor: Type.Optional(Cursor) }, { additionalProperties: false }),
        response: { 200: Type.Object({ deployments: Type.Array(Deployment), next_cursor: Nullable(Type.String()) }), ...errors(400) },
      },
    },
    async (req) => {
      const after = pageAfter(req.query.cursor);
      const page = await deployments.list({ limit: req.query.limit ?? 50, after });
      return { deployments: page.deployments, next_cursor: nextCursor(page) };
    },
  );

  app.get(
    "/v1/agent-deployments/:deployment_id",
    { config: { auth: "key" }, schema: { tags, summary: "Get a deployment with its versions, newest first", params: DepParams, response: { 200: Deployment, ...errors(404) } } },
    async (req) => deployments.get(req.params.deployment_id),
  );

  app.patch(
    "/v1/agent-deployments/:deployment_id",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Update a deployment: a new version, rolled onto the replicas one at a time (an old replica stops once its successor is ready)",
        params: DepParams,
        body: UpdateDeployment,
        response: { 200: Deployment, ...errors(400, 404, 409) },
      },
      preValidation: stringEnvsOnly,
    },
    async (req) => deployments.update(req.params.deployment_id, req.body),
  );

  app.delete(
    "/v1/agent-deployments/:deployment_id",
    { config: { auth: "key" }, schema: { tags, summary: "Delete a deployment: every service stops and its machine is destroyed", params: DepParams, response: { 200: Deployment, ...errors(404) } } },
    async (req) => deployments.remove(req.params.deployment_id),
  );

  app.post(
    "/v1/agent-deployments/:deployment_id/rotate-edge-token",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Replace the deployment's long-lived edge token: URLs with the old one stop at once (open WebSockets too); the answer carries the new edge_url",
        params: DepParams,
        response: { 200: Deployment, ...errors(404, 409) },
      },
    },
    async (req) => deployments.rotateEdgeToken(req.params.deployment_id),
  );

  app.get(
    "/v1/agent-deployments/:deployment_id/services",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List a deployment's service instances, newest first",
        params: DepParams,
        querystring: Type.Object({ status: Type.Optional(Type.Enum(SERVICE_STATUSES)) }, { additionalProperties: false }),
        response: { 200: Type.Object({ services: Type.Array(ServiceInstance) }), ...errors(400, 404) },
      },
    },
    async (req) => ({ services: await deployments.listServices(req.params.deployment_id, { status: req.query.status }) }),
  );

  app.get(
    "/v1/agent-deployments/:deployment_id/services/:service_id",
    { config: { auth: "key" }, schema: { tags, summary: "Get a service instance", params: SvcParams, response: { 200: ServiceInstance, ...errors(404) } } },
    async (req) => deployments.getService(req.params.deployment_id, req.params.service_id),
  );

  app.get(
    "/v1/agent-deployments/:deployment_id/services/:service_id/logs",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "The service's recent output (stdout and stderr, up to 256 KiB kept)",
        params: SvcParams,
        querystring: Type.Object({ tail_bytes: Type.Optional(Type.Integer({ minimum: 0, maximum: 262144, default: 65536 })) }, { additionalProperties: false }),
        response: { 200: ServiceLogs, ...errors(400, 404, 409) },
      },
    },
    async (req) => deployments.serviceLogs(req.params.deployment_id, req.params.service_id, req.query.tail_bytes ?? 65536),
  );

  app.post(
    "/v1/agent-deployments/:deployment_id/services/:service_id/restart",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Restart an agent service instance",
        description:
          "`envs` are request-only: they reach the restarted process (and its crash-restarts) and are stored nowhere. " +
          "An `Idempotency-Key` header makes a repeated restart answer the first result without restarting again.",
        params: SvcParams,
        headers: Type.Object({ "idempotency-key": Type.Optional(Type.String({ minLength: 1, maxLength: 255 })) }),
        body: RestartRequest,
        response: { 200: ServiceInstance, ...errors(400, 404, 409) },
      },
      preValidation: stringEnvsOnly,
    },
    async (req) => deployments.restart(req.params.deployment_id, req.params.service_id, req.body ?? {}, req.headers["idempotency-key"]),
  );

  // Between hosts only (auth `cluster`: signed with the store's cluster secret; an API key is refused): the server
  // that places a deployment's replica on this host asks it to make the replica (its machine, process and
  // supervision are this host's), and to stop one it runs. docs/deployments.md, "Many hosts".
  app.post(
    "/v1/cluster/deployments/:deployment_id/replicas",
    {
      config: { auth: "cluster" },
      schema: {
        hide: true,
        params: DepParams,
        body: Type.Object({
          deployment_id: Id,
          version_id: Id,
          envs: Type.Record(Type.String(), Type.String()),
          detail: Type.Optional(Type.Record(Type.String(), Type.Unknown())),
        }),
      },
    },
    async (req, reply) => reply.code(201).send(await deployments.replicaHere(req.params.deployment_id, req.body.version_id, req.body.envs, req.body.detail)),
  );
  app.post(
    "/v1/cluster/services/:service_id/stop",
    { config: { auth: "cluster" }, schema: { hide: true, params: Type.Object({ service_id: Id }) } },
    async (req) => deployments.stopHere(req.params.service_id),
  );
}
