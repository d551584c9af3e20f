// E2B's control plane (the API the SDK reaches at E2B_API_URL) as a translation onto Kiln's machine service:
// sandboxes are machines, templates are Kiln template refs, pause/connect are hibernate/resume.

import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import { MACHINE_LIMITS } from "../../services/machines.ts";
import type { MachineView } from "../../services/machines.ts";
import { KilnError } from "../../errors.ts";
import { ENVD_VERSION } from "./envd.ts";

export interface ControlDeps {
  services: Services;
  tokenOf: (sandboxId: string) => string;
  /** The domain sandboxes are reached under (the host of KILN_PUBLIC_URL); undefined: the Host the client used. */
  domain: string | undefined;
  /** Told about every sandbox this API made or resumed (envd warms its per-machine state). */
  sandboxReady: (id: string) => void;
}

/** E2B's default sandbox timeout when a create names none (seconds). */
const E2B_DEFAULT_TIMEOUT_S = 15;
const STATES = ["running", "paused"] as const;

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

function bad(message: string): never {
  throw new KilnError("invalid_request", message);
}

function stringMap(v: unknown, name: string): Record<string, string> | undefined {
  if (v === undefined || v === null) return undefined;
  if (!isObj(v) || !Object.values(v).every((x) => typeof x === "string")) bad(`${name} must map names to strings`);
  return v as Record<string, string>;
}

function timeoutOf(v: unknown): number | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > MACHINE_LIMITS.maxTimeoutS) bad(`timeout must be whole seconds from 0 to ${MACHINE_LIMITS.maxTimeoutS}`);
  return v;
}

/** Only these body fields are understood; anything else set to a non-default value is refused, never ignored. */
const CREATE_FIELDS = new Set(["templateID", "timeout", "metadata", "envVars", "allow_internet_access", "autoPause", "secure", "network", "volumeMounts", "mcp", "iam", "autoPauseMemory", "autoResume"]);

export async function controlRoutes(app: FastifyInstance, deps: ControlDeps) {
  const { machines } = deps.services;
  const route = { config: { e2b: "control" } };

  /** A machine that is gone (destroyed, failed) is, to E2B clients, a sandbox that does not exist. */
  async function live(id: string): Promise<MachineView> {
    const m = await machines.get(id).catch((err: unknown) => {
      if (err instanceof KilnError && err.code === "not_found") throw new KilnError("not_found", `sandbox "${id}" not found`);
      throw err;
    });
    if (m.status !== "running" && m.status !== "hibernated" && m.status !== "creating") throw new KilnError("not_found", `sandbox "${id}" not found`);
    return m;
  }

  const state = (m: MachineView) => (m.status === "hibernated" ? "paused" : "running");

  const domainFor = (req: FastifyRequest) => deps.domain ?? req.headers.host ?? "localhost";

  function created(m: MachineView, req: FastifyRequest) {
    return { sandboxID: m.id, templateID: m.template_id, clientID: "kiln", envdVersion: ENVD_VERSION, envdAccessToken: deps.tokenOf(m.id), domain: domainFor(req) };
  }

  function listed(m: MachineView) {
    return {
      sandboxID: m.id,
      templateID: m.template_id,
      ...(m.name ? { alias: m.name } : {}),
      clientID: "kiln",
      startedAt: m.created_at,
      endAt: m.expires_at ?? m.created_at,
      cpuCount: m.vcpus,
      memoryMB: m.memory_mb,
      diskSizeMB: 0,
      metadata: m.metadata,
      state: state(m),
      envdVersion: ENVD_VERSION,
      volumeMounts: [],
    };
  }

  function detail(m: MachineView, req: FastifyRequest) {
    return { ...listed(m), allowInternetAccess: m.internet, envdAccessToken: deps.tokenOf(m.id), domain: domainFor(req) };
  }

  async function create(req: FastifyRequest) {
    const body = isObj(req.body) ? req.body : bad("the body must be a JSON object");
    for (const k of Object.keys(body)) if (!CREATE_FIELDS.has(k)) bad(`unknown field ${k}`);
    let template = typeof body.templateID === "string" && body.templateID ? body.templateID : bad("templateID is required");
    // The templateID a sandbox reports (a tpl_ id) is accepted back, as E2B's are.
    if (template.startsWith("tpl_")) template = (await deps.services.templateCatalog.get(template)).canonical_ref;
    if (body.autoPause === true) bad("autoPause is not supported by Kiln yet: a sandbox is killed when its timeout ends");
    if (body.volumeMounts !== undefined && !(Array.isArray(body.volumeMounts) && body.volumeMounts.length === 0)) bad("volumeMounts are not supported by Kiln's E2B API yet");
    if (isObj(body.network) && Object.keys(body.network).length > 0) bad("network rules are not supported by Kiln's E2B API yet; use allow_internet_access");
    if (body.mcp !== undefined && body.mcp !== null) bad("mcp is not supported by Kiln");
    if (body.allow_internet_access !== undefined && typeof body.allow_internet_access !== "boolean") bad("allow_internet_access must be a boolean");
    const m = await machines.create({
      template,
      metadata: stringMap(body.metadata, "metadata"),
      envs: stringMap(body.envVars, "envVars"),
      timeout_s: timeoutOf(body.timeout) ?? E2B_DEFAULT_TIMEOUT_S,
      internet: body.allow_internet_access as boolean | undefined,
    });
    deps.sandboxReady(m.id);
    return created(m, req);
  }

  app.post("/sandboxes", route, async (req, reply) => reply.code(201).send(await create(req)));
  app.post("/v2/sandboxes", route, async (req, reply) => reply.code(201).send(await create(req)));

  app.get("/sandboxes/:id", route, async (req) => detail(await live((req.params as { id: string }).id), req));

  app.delete("/sandboxes/:id", route, async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    await machines.destroy(m.id);
    return reply.code(204).send();
  });

  app.post("/sandboxes/:id/timeout", route, async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    const timeout = isObj(req.body) ? timeoutOf(req.body.timeout) : undefined;
    if (timeout === undefined) bad("timeout is required");
    await machines.update(m.id, { timeout_s: timeout });
    return reply.code(204).send();
  });

  app.post("/sandboxes/:id/pause", route, async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    if (m.status === "hibernated") throw new KilnError("conflict", `sandbox "${m.id}" is already paused`);
    await machines.hibernate(m.id);
    return reply.code(204).send();
  });

  /** connect: 200 with a running sandbox, 201 after resuming a paused one; the timeout is renewed either way. */
  async function connect(req: FastifyRequest, opts: { mustBePaused: boolean }) {
    const m = await live((req.params as { id: string }).id);
    const timeout = isObj(req.body) ? timeoutOf(req.body.timeout) : undefined;
    let status = 200;
    if (m.status === "hibernated") {
      await machines.resume(m.id);
      deps.sandboxReady(m.id);
      status = 201;
    } else if (opts.mustBePaused) {
      throw new KilnError("conflict", `sandbox "${m.id}" is already running`);
    }
    const after = timeout !== undefined ? await machines.update(m.id, { timeout_s: timeout }) : await machines.get(m.id);
    return { status, body: created(after, req) };
  }
  for (const path of ["/sandboxes/:id/connect", "/v2/sandboxes/:id/connect"]) {
    app.post(path, route, async (req, reply) => {
      const { status, body } = await connect(req, { mustBePaused: false });
      return reply.code(status).send(body);
    });
  }
  app.post("/sandboxes/:id/resume", route, async (req, reply) => {
    const { status, body } = await connect(req, { mustBePaused: true });
    return reply.code(status).send(body);
  });

  /** Sandboxes newest first, filtered by state and metadata; nextToken is the key of the last machine looked at. */
  async function list(q: Record<string, unknown>, defaultStates: readonly string[]) {
    const states = typeof q.state === "string" && q.state ? q.state.split(",") : Array.isArray(q.state) ? (q.state as string[]) : [...defaultStates];
    for (const s of states) if (!(STATES as readonly string[]).includes(s)) bad(`state must be running or paused, not ${JSON.stringify(s)}`);
    const metadata = typeof q.metadata === "string" && q.metadata ? Object.fromEntries(new URLSearchParams(q.metadata)) : {};
    const limit = q.limit === undefined ? 100 : Number(q.limit);
    if (!Number.isInteger(limit) || limit < 1 || limit > 100) bad("limit must be from 1 to 100");
    let after: [string, string] | undefined;
    if (typeof q.nextToken === "string" && q.nextToken) {
      try {
        after = JSON.parse(Buffer.from(q.nextToken, "base64url").toString()) as [string, string];
        if (!Array.isArray(after) || after.length !== 2 || !after.every((x) => typeof x === "string")) throw new Error();
      } catch {
        bad("nextToken is not one this server gave");
      }
    }
    const out: ReturnType<typeof listed>[] = [];
    let next: string | undefined;
    for (;;) {
      const page = await machines.list({ limit, after });
      for (const m of page.machines) {
        if (!states.includes(state(m)) || m.status === "creating") continue;
        if (!Object.entries(metadata).every(([k, v]) => m.metadata[k] === v)) continue;
        out.push(listed(m));
        if (out.length === limit) {
          next = Buffer.from(JSON.stringify([m.created_at, m.id])).toString("base64url");
          break;
        }
      }
      if (out.length === limit || !page.more || !page.last) break;
      after = page.last;
    }
    return { items: out, next };
  }

  app.get("/v2/sandboxes", route, async (req, reply) => {
    const { items, next } = await list(req.query as Record<string, unknown>, STATES);
    if (next) reply.header("x-next-token", next);
    return items;
  });
  app.get("/sandboxes", route, async (req) => (await list(req.query as Record<string, unknown>, ["running"])).items);
}
