// Machines: create from a template, list, inspect, update, hibernate, resume, destroy, and one-shot exec.

import { Type } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { HIBERNATE_MODES, MACHINE_DEFAULTS, MACHINE_LIMITS, MACHINE_STATUSES, ON_TIMEOUT } from "../../machines/service.ts";
import { errors, Cursor, Envs, Id, Limit, Machine, MachinePath, Metadata, NoNul, UserName } from "../schemas.ts";
import { INPUT_LIMITS } from "../../machines/input-limits.ts";
import { nextCursor, pageAfter } from "../../store/cursor.ts";
import { EXEC_ENCODINGS } from "../../machines/exec.ts";
import { checkOpenings } from "../../machines/create.ts";
import { VOLUME_LIMITS } from "../../volumes/service.ts";
import { KilnError } from "../../errors.ts";

const VolumeMountRequest = Type.Object(
  {
    volume_id: Id,
    path: Type.String({ minLength: 2, maxLength: 4096, pattern: "^/", description: "Absolute mount point in the machine" }),
    read_only: Type.Optional(Type.Boolean({ default: false })),
  },
  { additionalProperties: false },
);

const Bytes = Type.Union([Type.Integer({ minimum: 0 }), Type.Null()]);
const MachineMetrics = Type.Object({
  machine_id: Id,
  timestamp: Type.String({ format: "date-time" }),
  cpu_count: Type.Integer(),
  cpu_used_pct: Type.Union([Type.Number(), Type.Null()], { description: "Share of the machine's vCPUs used over the last cpu_window_ms, 0–100; null when the host cannot tell" }),
  cpu_window_ms: Type.Integer({ description: "The interval cpu_used_pct covers: since an earlier metrics call (0.1–60 s ago), else a 200 ms sample the call waits for" }),
  cpu_usage_ns: Type.Union([Type.Integer({ minimum: 0 }), Type.Null()], { description: "CPU time used since the machine (re)started" }),
  mem_used_bytes: { ...Bytes, description: "Memory in use, page cache excluded" },
  mem_cache_bytes: Bytes,
  mem_total_bytes: Type.Integer({ description: "The machine's memory limit (memory_mb)" }),
  disk_used_bytes: Bytes,
  disk_total_bytes: { ...Bytes, description: "Size of the machine's writable layer" },
});

const TimeoutS = Type.Integer({ minimum: 1, maximum: MACHINE_LIMITS.maxTimeoutS });
export const Params = Type.Object({ id: Id });
const CidrList = Type.Array(Type.String({ minLength: 1, maxLength: 64, description: "IPv4 or IPv6 CIDR (a bare address is one host)" }), { maxItems: MACHINE_LIMITS.maxCidrs });

const Lifecycle = {
  on_timeout: Type.Optional(Type.Enum(ON_TIMEOUT, { description: "destroy (default), or hibernate: its memory saved where the runtime can, else its disk kept" })),
  auto_resume: Type.Optional(Type.Boolean({ description: "Wake a hibernated machine on the next exec, files, WebSocket, port or edge request" })),
};

const CreateMachine = Type.Object(
  {
    template: Type.Optional(NoNul({ minLength: 1, maxLength: 256, description: "Template ref (`local/base`, `base`, `base:tag`) or artifact id; default `local/base`" })),
    snapshot: Type.Optional({ ...Id, description: "Make the machine from this snapshot (snp_…) instead of a template: its disk, and with memory its processes" }),
    ...Lifecycle,
    name: Type.Optional(NoNul({ minLength: 1, maxLength: INPUT_LIMITS.nameChars })),
    cwd: Type.Optional(Type.String({ minLength: 1, maxLength: INPUT_LIMITS.pathChars, pattern: "^/[^\\u0000]*$" })),
    user: Type.Optional(UserName),
    envs: Type.Optional(Envs),
    metadata: Type.Optional(Metadata),
    timeout_s: Type.Optional({ ...TimeoutS, default: MACHINE_DEFAULTS.timeoutS }),
    vcpus: Type.Optional(Type.Integer({ minimum: 1, maximum: MACHINE_LIMITS.maxVcpus })),
    memory_mb: Type.Optional(Type.Integer({ minimum: MACHINE_LIMITS.minMemoryMb, maximum: MACHINE_LIMITS.maxMemoryMb })),
    disk_mb: Type.Optional(Type.Integer({ minimum: MACHINE_LIMITS.minDiskMb, maximum: MACHINE_LIMITS.maxDiskMb, description: `Size of the machine's writable layer (default ${MACHINE_DEFAULTS.diskMb}; at most KILN_MAX_DISK_MB)` })),
    // No schema default: a machine from a memory snapshot takes the snapshot's setting unless it says otherwise.
    internet: Type.Optional(Type.Boolean({ description: "Outbound network (default true; from a snapshot, the snapshot's)" })),
    // Volumes mounted at boot (room: volumes).
    volumes: Type.Optional(Type.Array(VolumeMountRequest, { maxItems: VOLUME_LIMITS.maxPerMachine })),
    network: Type.Optional(
      Type.Object(
        {
          allow_out: Type.Optional({ ...CidrList, description: "Destinations opened beyond the default (which refuses the host, link-local and private ranges); wins over deny_out" }),
          deny_out: Type.Optional({ ...CidrList, description: "Destinations closed, e.g. 0.0.0.0/0 with allow_out for an allow list" }),
        },
        { additionalProperties: false },
      ),
    ),
  },
  { additionalProperties: false },
);

const UpdateMachine = Type.Object(
  { name: Type.Optional(NoNul({ minLength: 1, maxLength: INPUT_LIMITS.nameChars })), timeout_s: Type.Optional(TimeoutS), metadata: Type.Optional(Metadata), ...Lifecycle },
  { additionalProperties: false, minProperties: 1 },
);

export const ExecRequest = Type.Object(
  {
    cmd: NoNul({ minLength: 1, maxLength: INPUT_LIMITS.cmdChars, description: "Shell line for /bin/sh -c, or the program when args is given" }),
    args: Type.Optional(Type.Array(NoNul({ maxLength: INPUT_LIMITS.argChars }), { maxItems: INPUT_LIMITS.args })),
    cwd: Type.Optional(MachinePath),
    envs: Type.Optional(Envs),
    user: Type.Optional(UserName),
    stdin: Type.Optional(Type.String({ maxLength: 16 * 1024 * 1024 })),
    timeout_s: Type.Optional(Type.Integer({ minimum: 1, maximum: 3600 })),
    encoding: Type.Optional(Type.Enum(EXEC_ENCODINGS, { description: "`utf8` (default): stdout/stderr as text; `base64`: base64 of the exact bytes" })),
  },
  { additionalProperties: false },
);

const ExecResult = Type.Object({
  exit_code: Type.Union([Type.Integer(), Type.Null()]),
  signal: Type.Union([Type.String(), Type.Null()]),
  stdout: Type.String(),
  stderr: Type.String(),
  duration_ms: Type.Number(),
  encoding: Type.Optional(Type.Enum(EXEC_ENCODINGS)),
  oom_killed: Type.Optional(Type.Boolean({ description: "Present (true) when the kernel's OOM killer ended the command" })),
});

/** A POST whose body is all optional may come without one: it means `{}` (schemas validate an object). */
export async function emptyBodyIsEmptyObject(req: { body: unknown }): Promise<void> {
  if (req.body === undefined || req.body === null) req.body = {};
}

export async function machineRoutes(app: App, opts: { services: Services }) {
  const { machines, exec } = opts.services;
  const tags = ["Machines"];

  app.post(
    "/v1/machines",
    { config: { auth: "key" }, schema: { tags, summary: "Create a machine from a template or a snapshot", body: CreateMachine, response: { 201: Machine, ...errors(400, 403, 404, 409, 503) } } },
    async (req, reply) => {
      const { snapshot, ...input } = req.body;
      if (input.network?.allow_out?.length) checkOpenings(input.network, await opts.services.keys.isOperator(req.apiKeyId));
      return reply.code(201).send(snapshot ? await opts.services.snapshots.createMachine(snapshot, input) : await machines.create(input));
    },
  );

  app.get(
    "/v1/machines",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "List machines, newest first (destroyed ones only when asked by status)",
        querystring: Type.Object(
          { limit: Type.Optional(Limit), cursor: Type.Optional(Cursor), status: Type.Optional(Type.Enum(MACHINE_STATUSES)) },
          { additionalProperties: false },
        ),
        response: { 200: Type.Object({ machines: Type.Array(Machine), next_cursor: Type.Union([Type.String(), Type.Null()]) }), ...errors(400) },
      },
    },
    async (req) => {
      const after = pageAfter(req.query.cursor);
      const page = await machines.list({ limit: req.query.limit ?? 50, after, status: req.query.status });
      return { machines: page.machines, next_cursor: nextCursor(page) };
    },
  );

  app.get("/v1/machines/:id", { config: { auth: "key" }, schema: { tags, summary: "Get a machine", params: Params, response: { 200: Machine, ...errors(404) } } }, async (req) =>
    machines.get(req.params.id),
  );

  app.get(
    "/v1/machines/:id/metrics",
    { config: { auth: "key" }, schema: { tags, summary: "A running machine's CPU, memory and disk use now (cgroup counters and its disk); see docs/e2b.md", params: Params, response: { 200: MachineMetrics, ...errors(404, 409) } } },
    async (req) => opts.services.machineMetrics.get(req.params.id),
  );

  app.patch(
    "/v1/machines/:id",
    { config: { auth: "key" }, schema: { tags, summary: "Update a machine; timeout_s restarts its clock from now", params: Params, body: UpdateMachine, response: { 200: Machine, ...errors(400, 404, 409) } } },
    async (req) => machines.update(req.params.id, req.body),
  );

  app.delete("/v1/machines/:id", { config: { auth: "key" }, schema: { tags, summary: "Destroy a machine", params: Params, response: { 200: Machine, ...errors(404) } } }, async (req) =>
    machines.destroy(req.params.id),
  );

  app.post(
    "/v1/machines/:id/hibernate",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Hibernate a running machine: freeze its processes (default), stop them keeping its disk, or save them with its memory",
        params: Params,
        body: Type.Object(
          {
            memory: Type.Optional(Type.Boolean({ description: "true: save its processes to disk and release their memory (gVisor; 400 with the reason elsewhere); false: stop them, keep the disk" })),
            mode: Type.Optional(Type.Enum(HIBERNATE_MODES, { description: "freeze (default): processes frozen in memory; disk; memory. Agrees with memory when both are given" })),
          },
          { additionalProperties: false, description: "Optional: no body is `{}`" },
        ),
        response: { 200: Machine, ...errors(400, 404, 409) },
      },
      preValidation: emptyBodyIsEmptyObject,
    },
    async (req) => {
      const { memory, mode } = req.body ?? {};
      const fromMemory = memory === undefined ? undefined : memory ? "memory" : "disk";
      if (mode && fromMemory && mode !== fromMemory) throw new KilnError("invalid_request", `mode ${mode} contradicts memory ${memory}`);
      return machines.hibernate(req.params.id, mode ?? fromMemory ?? "freeze");
    },
  );

  app.post(
    "/v1/machines/:id/resume",
    { config: { auth: "key" }, schema: { tags, summary: "Resume a hibernated machine", params: Params, response: { 200: Machine, ...errors(404, 409) } } },
    async (req) => machines.resume(req.params.id),
  );

  app.post(
    "/v1/machines/:id/exec",
    { config: { auth: "key" }, schema: { tags, summary: "Run a command and wait for it", params: Params, body: ExecRequest, response: { 200: ExecResult, ...errors(400, 404, 409, 504) } } },
    async (req) => exec.exec(req.params.id, req.body),
  );
}
