// E2B's control plane (the API the SDK reaches at E2B_API_URL) as a translation onto Kiln's machine service:
// sandboxes are machines, templates are Kiln template refs, pause/connect are hibernate/resume.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import { MACHINE_LIMITS } from "../../machines/service.ts";
import type { CreateMachineInput, MachineView } from "../../machines/service.ts";
import type { MachineMetrics } from "../../machines/metrics.ts";
import { checkOpenings } from "../../machines/create.ts";
import { KilnError } from "../../errors.ts";
import { ENVD_VERSION } from "./envd.ts";
import { CODE_INTERPRETER_TEMPLATE } from "../../builder/code-interpreter-template.ts";
import { CODE_INTERPRETER_REF } from "../../templates/code-interpreter.ts";
import { findTemplate, parseTemplateRef } from "../../templates/resolver.ts";
import { E2bUnserved } from "./errors.ts";
import { machineIdOf, sandboxIdOf } from "./ids.ts";
import { requestHost } from "./ports.ts";
import { keepsMemory, snapshotOfTemplateId, snapshotRoutes } from "./snapshots.ts";
import { E2bNetwork, egressOf } from "./network.ts";
import type { E2bNetworkBody } from "./network.ts";
import { E2bVolumeMount, volumeMountsOf, volumeRoutes } from "./volumes.ts";
import { volumeContentRoutes } from "./volume-content.ts";
import { templateCatalogRoutes } from "./template-catalog.ts";

export interface ControlDeps {
  services: Services;
  /** The sandbox's envd access token for the key this request was authenticated with. */
  tokenOf: (sandboxId: string, keyId: string) => string;
  /** E2B's per-volume token for the volume content API (token.ts). */
  volumeTokenOf: (volumeId: string, keyId: string) => string;
  /** The domain sandboxes are reached under (the host of KILN_PUBLIC_URL); undefined: the Host the client used. */
  domain: string | undefined;
}

/** The template `@e2b/code-interpreter`'s Sandbox.create() names by default. */
/** The names E2B programs give @e2b/code-interpreter's default template (a tag only as the default one). */
const CODE_INTERPRETER_NAMES = new Set([CODE_INTERPRETER_TEMPLATE, CODE_INTERPRETER_REF, `${CODE_INTERPRETER_TEMPLATE}:default`, `${CODE_INTERPRETER_REF}:default`]);

/** E2B's default sandbox timeout when a create names none (seconds). */
const E2B_DEFAULT_TIMEOUT_S = 15;
const STATES = ["running", "paused"] as const;

function bad(message: string): never {
  throw new KilnError("invalid_request", message);
}

const StringMap = Type.Record(Type.String(), Type.String());
const Timeout = Type.Integer({ minimum: 1, maximum: MACHINE_LIMITS.maxTimeoutS });

/**
 * E2B's NewSandbox body as the SDK sends it. Fields Kiln does not serve are accepted only at their defaults (see
 * create): refused when set, never silently ignored. Unknown fields are refused.
 */
const NewSandbox = Type.Object(
  {
    templateID: Type.String({ minLength: 1, maxLength: 256 }),
    timeout: Type.Optional(Timeout),
    metadata: Type.Optional(StringMap),
    envVars: Type.Optional(StringMap),
    allow_internet_access: Type.Optional(Type.Boolean()),
    secure: Type.Optional(Type.Boolean()),
    autoPause: Type.Optional(Type.Boolean()),
    autoPauseMemory: Type.Optional(Type.Boolean()),
    autoResume: Type.Optional(Type.Unknown()),
    network: Type.Optional(Type.Union([E2bNetwork, Type.Null()])),
    volumeMounts: Type.Optional(Type.Array(E2bVolumeMount, { maxItems: 16 })),
    mcp: Type.Optional(Type.Unknown()),
    iam: Type.Optional(Type.Unknown()),
  },
  { additionalProperties: false },
);
const TimeoutBody = Type.Object({ timeout: Timeout }, { additionalProperties: false });
const ConnectBody = Type.Object({ timeout: Type.Optional(Timeout), memory: Type.Optional(Type.Boolean()) }, { additionalProperties: false });
const PauseBody = Type.Union([Type.Object({ memory: Type.Optional(Type.Boolean()) }, { additionalProperties: false }), Type.Null()]);
const ListQuery = Type.Object(
  {
    state: Type.Optional(Type.String({ pattern: "^(running|paused)(,(running|paused))*$" })),
    metadata: Type.Optional(Type.String({ maxLength: 4096 })),
    limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 100 })),
    nextToken: Type.Optional(Type.String({ maxLength: 512 })),
    startedAfter: Type.Optional(Type.String()),
    template: Type.Optional(Type.String()),
    order: Type.Optional(Type.String()),
  },
  { additionalProperties: false },
);
const Params = Type.Object({ id: Type.String({ minLength: 1, maxLength: 64 }) });

export async function controlRoutes(app: FastifyInstance, deps: ControlDeps) {
  const { machines } = deps.services;
  const route = { config: { e2b: "control", auth: "key" as const }, schema: { hide: true, params: Params } };
  const withBody = (body: unknown) => ({ config: { e2b: "control", auth: "key" as const }, schema: { hide: true, params: Params, body } });

  /** A machine that is gone (destroyed, failed) is, to E2B clients, a sandbox that does not exist. */
  async function live(id: string): Promise<MachineView> {
    const machineId = machineIdOf(id);
    if (!machineId) throw new KilnError("not_found", `sandbox "${id}" not found`);
    const m = await machines.get(machineId).catch((err: unknown) => {
      if (err instanceof KilnError && err.code === "not_found") throw new KilnError("not_found", `sandbox "${id}" not found`);
      throw err;
    });
    if (m.status !== "running" && m.status !== "hibernated" && m.status !== "creating") throw new KilnError("not_found", `sandbox "${id}" not found`);
    return m;
  }

  const state = (m: MachineView) => (m.status === "hibernated" ? "paused" : "running");

  const domainFor = (req: FastifyRequest) => deps.domain ?? requestHost(req) ?? "localhost";

  // E2B hands out a traffic token for a sandbox's non-public ports (getHost). Kiln's port route takes the sandbox's
  // envd token there, so both fields carry it: the SDK's `sbx.trafficAccessToken` is set as E2B sets it.
  const tokens = (m: MachineView, req: FastifyRequest) => {
    const token = deps.tokenOf(m.id, req.apiKeyId!); // of the machine id: the same token for either spelling
    return { envdAccessToken: token, trafficAccessToken: token };
  };

  function created(m: MachineView, req: FastifyRequest) {
    return { sandboxID: sandboxIdOf(m.id), templateID: m.template_id, clientID: "kiln", envdVersion: ENVD_VERSION, ...tokens(m, req), domain: domainFor(req) };
  }

  /** E2B's `volumeMounts` ({name, path}) of machines: their Kiln volume mounts, named by the volume's name. */
  async function volumeMountsOfMachines(ms: MachineView[]) {
    const mounts = await deps.services.volumes.mountsOf(ms.map((m) => m.id));
    return (m: MachineView) => (mounts.get(m.id) ?? []).map((v) => ({ name: v.name, path: v.path }));
  }

  function listed(m: MachineView, volumeMounts: { name: string; path: string }[]) {
    return {
      sandboxID: sandboxIdOf(m.id),
      templateID: m.template_id,
      ...(m.name ? { alias: m.name } : {}),
      clientID: "kiln",
      startedAt: m.created_at,
      endAt: m.expires_at ?? m.created_at,
      cpuCount: m.vcpus,
      memoryMB: m.memory_mb,
      diskSizeMB: m.disk_mb,
      metadata: m.metadata,
      state: state(m),
      envdVersion: ENVD_VERSION,
      volumeMounts,
    };
  }

  async function detail(m: MachineView, req: FastifyRequest) {
    const volumeMounts = (await volumeMountsOfMachines([m]))(m);
    const network = m.network.allow_out.length + m.network.deny_out.length > 0 ? { network: { allowOut: m.network.allow_out, denyOut: m.network.deny_out } } : {};
    return { ...listed(m, volumeMounts), allowInternetAccess: m.internet, ...network, lifecycle: { onTimeout: m.on_timeout === "hibernate" ? "pause" : "kill", autoResume: m.auto_resume }, ...tokens(m, req), domain: domainFor(req) };
  }

  /** E2B's lifecycle (`onTimeout: "pause"`, `autoResume`) onto Kiln's `on_timeout` and `auto_resume`. */
  function lifecycleOf(body: Static<typeof NewSandbox>): Pick<CreateMachineInput, "on_timeout" | "auto_resume"> {
    const autoResume = body.autoResume as { enabled?: unknown } | null | undefined;
    if (autoResume !== undefined && autoResume !== null && (typeof autoResume !== "object" || typeof autoResume.enabled !== "boolean")) bad("autoResume must be {enabled: boolean}");
    if (autoResume?.enabled && body.autoPause !== true) bad("autoResume needs autoPause (onTimeout: pause)");
    // Kiln hibernates at the timeout with memory where the runtime can, else the disk: there is no per-sandbox choice.
    if (body.autoPauseMemory === false) bad("autoPauseMemory false (a filesystem-only pause at the timeout) is not supported by Kiln: a timed-out sandbox keeps its memory where the runtime can");
    return { on_timeout: body.autoPause ? "hibernate" : undefined, auto_resume: autoResume ? autoResume.enabled === true : undefined };
  }

  async function create(req: FastifyRequest) {
    const body = req.body as Static<typeof NewSandbox>;
    let template = body.templateID;
    // The templateID a sandbox reports (a tpl_ id) is accepted back, as E2B's are.
    if (template.startsWith("tpl_")) template = (await deps.services.templateCatalog.get(template)).canonical_ref;
    const lifecycle = lifecycleOf(body);
    if (body.mcp !== undefined && body.mcp !== null) bad("mcp is not supported by Kiln");
    if (body.iam !== undefined && body.iam !== null) bad("iam is not supported by Kiln");
    const input: CreateMachineInput = { metadata: body.metadata, envs: body.envVars, timeout_s: body.timeout ?? E2B_DEFAULT_TIMEOUT_S, internet: body.allow_internet_access, network: egressOf(body.network), volumes: await volumeMountsOf(deps.services, body.volumeMounts), ...lifecycle };
    if (input.network?.allow_out?.length) checkOpenings(input.network, await deps.services.keys.isOperator(req.apiKeyId));
    // A snapshot is an E2B templateID too: by its `snp_` id, or by its name when no template has that name.
    const fromSnapshot = (s: { id: string }) => deps.services.snapshots.createMachine(s.id, input);
    const snapshot = template.startsWith("snp_") ? await snapshotOfTemplateId(deps.services, template) : undefined;
    const m = await (snapshot ? fromSnapshot(snapshot) : machines.create({ ...input, template }))
      .catch(async (err: unknown) => {
        if (!snapshot && err instanceof KilnError && err.code === "not_found") {
          const named = await snapshotOfTemplateId(deps.services, template);
          if (named) return fromSnapshot(named);
        }
        throw err;
      })
      .catch((err: unknown) => {
        // @e2b/code-interpreter's default template: made by Kiln on its first use (503, retryable, meanwhile).
        if (err instanceof KilnError && err.code === "not_found" && CODE_INTERPRETER_NAMES.has(template)) throw deps.services.codeInterpreterTemplate.notReady();
        throw err;
      });
    return created(m, req);
  }

  const createRoute = { config: { e2b: "control", auth: "key" as const }, schema: { hide: true, body: NewSandbox } };
  app.post("/sandboxes", createRoute, async (req, reply) => reply.code(201).send(await create(req)));
  app.post("/v2/sandboxes", createRoute, async (req, reply) => reply.code(201).send(await create(req)));

  app.get("/sandboxes/:id", route, async (req) => detail(await live((req.params as { id: string }).id), req));

  app.delete("/sandboxes/:id", route, async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    await machines.destroy(m.id);
    return reply.code(204).send();
  });

  app.post("/sandboxes/:id/timeout", withBody(TimeoutBody), async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    await machines.update(m.id, { timeout_s: (req.body as Static<typeof TimeoutBody>).timeout });
    return reply.code(204).send();
  });

  app.post("/sandboxes/:id/pause", withBody(PauseBody), async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    if (m.status === "hibernated") throw new KilnError("conflict", `sandbox "${sandboxIdOf(m.id)}" is already paused`);
    // keepMemory (the default) saves the processes and releases their memory where the runtime can (gVisor), else
    // freezes them in place; keepMemory false stops them and keeps the disk (connect boots it again).
    const memory = (req.body as Static<typeof PauseBody>)?.memory;
    await machines.hibernate(m.id, memory === false ? "disk" : keepsMemory(deps.services) ? "memory" : "freeze");
    // E2B keeps a paused sandbox until it is resumed; Kiln's clock runs on through hibernation, so a paused
    // sandbox gets Kiln's longest timeout (connect sets the caller's again).
    await machines.update(m.id, { timeout_s: MACHINE_LIMITS.maxTimeoutS });
    return reply.code(204).send();
  });

  /** connect: 200 with a running sandbox, 201 after resuming a paused one; the timeout is renewed either way. */
  async function connect(req: FastifyRequest, opts: { mustBePaused: boolean }) {
    const m = await live((req.params as { id: string }).id);
    const { timeout, memory } = (req.body as Static<typeof ConnectBody> | undefined) ?? {};
    let status = 200;
    if (m.status === "hibernated") {
      // onResume "reboot": Kiln resumes a sandbox as it was paused; only a disk pause comes back as a fresh boot.
      if (memory === false && m.hibernate_mode !== "disk") bad(`sandbox "${sandboxIdOf(m.id)}" was paused with its memory; Kiln resumes it as it was (onResume "reboot" needs pause({keepMemory: false}))`);
      await machines.resume(m.id);
      status = 201;
    } else if (opts.mustBePaused) {
      throw new KilnError("conflict", `sandbox "${sandboxIdOf(m.id)}" is already running`);
    }
    // E2B's connect only ever lengthens a running sandbox's life (setTimeout is the call that can shorten it);
    // a resumed sandbox gets the asked timeout, as a new start does.
    const longer = timeout !== undefined && (status === 201 || !m.expires_at || Date.now() + timeout * 1000 > Date.parse(m.expires_at));
    const after = longer ? await machines.update(m.id, { timeout_s: timeout }) : await machines.get(m.id);
    return { status, body: created(after, req) };
  }
  for (const path of ["/sandboxes/:id/connect", "/v2/sandboxes/:id/connect"]) {
    app.post(path, withBody(ConnectBody), async (req, reply) => {
      const { status, body } = await connect(req, { mustBePaused: false });
      return reply.code(status).send(body);
    });
  }
  app.post("/sandboxes/:id/resume", withBody(ConnectBody), async (req, reply) => {
    const { status, body } = await connect(req, { mustBePaused: true });
    return reply.code(status).send(body);
  });

  /** Sandboxes newest first, filtered by state and metadata; nextToken is the key of the last machine looked at. */
  async function list(q: Record<string, unknown>, defaultStates: readonly string[]) {
    const states = typeof q.state === "string" && q.state ? q.state.split(",") : [...defaultStates];
    const metadata = typeof q.metadata === "string" && q.metadata ? Object.fromEntries(new URLSearchParams(q.metadata)) : {};
    const startedAfter = typeof q.startedAfter === "string" ? Date.parse(q.startedAfter) : undefined;
    if (startedAfter !== undefined && Number.isNaN(startedAfter)) bad("startedAfter must be an ISO timestamp");
    if (q.order !== undefined && q.order !== "desc") bad("only order=desc (newest first) is served");
    const limit = typeof q.limit === "number" ? q.limit : 100;
    let after: [string, string] | undefined;
    if (typeof q.nextToken === "string" && q.nextToken) {
      try {
        after = JSON.parse(Buffer.from(q.nextToken, "base64url").toString()) as [string, string];
        if (!Array.isArray(after) || after.length !== 2 || !after.every((x) => typeof x === "string")) throw new Error();
      } catch {
        bad("nextToken is not one this server gave");
      }
    }
    const out: MachineView[] = [];
    let next: string | undefined;
    for (;;) {
      // Store pages of at least 100: a filter that matches few machines reads the records in few queries, not one
      // query per machine for limit=1.
      const page = await machines.list({ limit: Math.max(limit, 100), after });
      for (const m of page.machines) {
        // Newest first: once one is too old, all the rest are.
        if (startedAfter !== undefined && Date.parse(m.created_at) <= startedAfter) {
          page.more = false;
          break;
        }
        if (!states.includes(state(m)) || m.status === "creating") continue;
        if (!Object.entries(metadata).every(([k, v]) => m.metadata[k] === v)) continue;
        if (typeof q.template === "string" && q.template !== m.template_id) continue;
        out.push(m);
        if (out.length === limit) {
          next = Buffer.from(JSON.stringify([m.created_at, m.id])).toString("base64url");
          break;
        }
      }
      if (out.length === limit || !page.more || !page.last) break;
      after = page.last;
    }
    const mountsOf = await volumeMountsOfMachines(out);
    return { items: out.map((m) => listed(m, mountsOf(m))), next };
  }

  const listRoute = { config: { e2b: "control", auth: "key" as const }, schema: { hide: true, querystring: ListQuery } };
  app.get("/v2/sandboxes", listRoute, async (req, reply) => {
    const { items, next } = await list(req.query as Record<string, unknown>, STATES);
    if (next) reply.header("x-next-token", next);
    return items;
  });
  app.get("/sandboxes", listRoute, async (req) => (await list(req.query as Record<string, unknown>, ["running"])).items);

  // E2B APIs Kiln does not serve yet answer 501 in E2B's shape (the SDK then raises a clear error), not a 404
  // that would read as "no such sandbox".
  const unserved = { config: { e2b: "control", auth: "key" as const }, schema: { hide: true } };
  const notYet = (what: string) => async () => {
    throw new E2bUnserved(`${what} is not supported by Kiln's E2B API yet (see docs/e2b.md)`);
  };
  // Metrics: a sandbox's series is its machine's ring of samples (src/machines/metrics.ts: every 5 s, the last hour).
  // A paused sandbox has no running counters: an empty series (E2B reports none while paused either).
  async function metricOf(m: MachineView) {
    return e2bMetric(await deps.services.machineMetrics.get(m.id));
  }
  function e2bMetric(x: MachineMetrics) {
    const at = new Date(x.timestamp);
    return {
      timestamp: x.timestamp,
      timestampUnix: Math.floor(at.getTime() / 1000),
      cpuCount: x.cpu_count,
      cpuUsedPct: x.cpu_used_pct ?? 0,
      memUsed: x.mem_used_bytes ?? 0,
      memTotal: x.mem_total_bytes,
      memCache: x.mem_cache_bytes ?? 0,
      diskUsed: x.disk_used_bytes ?? 0,
      diskTotal: x.disk_total_bytes ?? 0,
    };
  }
  const MetricsQuery = Type.Object({ start: Type.Optional(Type.Integer({ minimum: 0 })), end: Type.Optional(Type.Integer({ minimum: 0 })) }, { additionalProperties: false });
  app.get("/sandboxes/:id/metrics", { config: { e2b: "control", auth: "key" as const }, schema: { hide: true, params: Params, querystring: MetricsQuery } }, async (req) => {
    const m = await live((req.params as { id: string }).id);
    const { start, end } = req.query as Static<typeof MetricsQuery>;
    if (start !== undefined && end !== undefined && start > end) bad("start is after end");
    // The machine's ring of samples (every 5 s, the last hour), oldest first; a sandbox too young for its first
    // sample gets one taken now when the range holds now.
    const kept = deps.services.machineMetrics.history(m.id, { start: start === undefined ? undefined : start * 1000, end: end === undefined ? undefined : end * 1000 + 999 });
    if (kept.length > 0) return kept.map(e2bMetric);
    const nowS = Date.now() / 1000;
    if (m.status !== "running" || (start !== undefined && start > nowS) || (end !== undefined && end < Math.floor(nowS))) return [];
    return [await metricOf(m)];
  });
  // Comma-separated as E2B documents, or repeated (sandbox_ids=a&sandbox_ids=b) as an OpenAPI client sends arrays.
  const Ids = Type.String({ minLength: 1, maxLength: 100 * 40 });
  const ManyQuery = Type.Object({ sandbox_ids: Type.Union([Ids, Type.Array(Ids, { maxItems: 100 })]) }, { additionalProperties: false });
  app.get("/sandboxes/metrics", { config: { e2b: "control", auth: "key" as const }, schema: { hide: true, querystring: ManyQuery } }, async (req) => {
    const asked = (req.query as Static<typeof ManyQuery>).sandbox_ids;
    const ids = [...new Set((Array.isArray(asked) ? asked : [asked]).flatMap((x) => x.split(",")).map((x) => x.trim()).filter(Boolean))];
    if (ids.length > 100) bad("sandbox_ids names at most 100 sandboxes");
    const sandboxes: Record<string, Awaited<ReturnType<typeof metricOf>>> = {};
    // Unknown or paused sandboxes are left out (E2B answers with the running ones).
    await Promise.all(
      ids.map(async (id) => {
        const m = await live(id).catch(() => undefined);
        if (m?.status !== "running") return;
        const metric = await metricOf(m).catch(() => undefined);
        if (metric) sandboxes[id] = metric;
      }),
    );
    return { sandboxes };
  });
  const { deleteSnapshot } = await snapshotRoutes(app, { services: deps.services, live, created, defaultTimeoutS: E2B_DEFAULT_TIMEOUT_S });
  const { deleteTemplate } = await templateCatalogRoutes(app, deps.services);
  // E2B deletes a snapshot as a template: DELETE /templates/{id} names a template (removed as DELETE
  // /v1/templates/{ref} removes it) or a snapshot (its id, or its name when no template has it, as at create).
  app.delete("/templates/:id", { ...unserved, schema: { hide: true, params: Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }) }) } }, async (req, reply) => {
    const { id } = req.params as { id: string };
    const missing = (err: unknown) => {
      if (err instanceof KilnError && err.code === "not_found") return undefined;
      throw err;
    };
    const template = id.startsWith("snp_") ? undefined : await deps.services.templateCatalog.get(id).catch(missing);
    if (template) {
      await deleteTemplate(template.template_id);
      return reply.code(204).send();
    }
    return deleteSnapshot(req, reply, () => Promise.reject(new KilnError("not_found", `No template or snapshot ${JSON.stringify(id)}`)));
  });
  // E2B replaces the whole egress config: omitted fields are cleared.
  app.put("/sandboxes/:id/network", withBody(E2bNetwork), async (req, reply) => {
    const m = await live((req.params as { id: string }).id);
    const network = egressOf(req.body as E2bNetworkBody) ?? { allow_out: [], deny_out: [] };
    if (network.allow_out.length) checkOpenings(network, await deps.services.keys.isOperator(req.apiKeyId));
    await machines.updateNetwork(m.id, network);
    return reply.code(204).send();
  });
  await volumeRoutes(app, deps.services, deps.volumeTokenOf);
  await volumeContentRoutes(app, deps.services);
  // Sandbox logs, refreshes and teams: Kiln keeps no sandbox log stream and has no teams (the SDK calls none of them).
  for (const url of ["/sandboxes/:id/logs", "/v2/sandboxes/:id/logs", "/sandboxes/:id/refreshes"]) {
    app.route({ method: ["GET", "POST"], url, ...unserved, handler: notYet(`${url.replace("/:id", "/{id}")} (Kiln keeps no sandbox log stream; use setTimeout to extend a sandbox)`) });
  }
  // Template.exists / aliasExists: a Kiln template (by its name or one of its aliases; a tag, when named, must be
  // one of its tags) is an E2B alias. `public` is false: Kiln's templates belong to the server, not to the world.
  app.get("/templates/aliases/:alias", { ...unserved, schema: { hide: true, params: Type.Object({ alias: Type.String({ minLength: 1, maxLength: 256 }) }) } }, async (req) => {
    const { alias } = req.params as { alias: string };
    const { canonicalRef, tag } = parseTemplateRef(alias);
    const t = await findTemplate(deps.services.store.db, canonicalRef);
    const tags = t ? (await deps.services.store.db.selectFrom("artifact_tags").select("tag").where("template_id", "=", t.id).execute()).map((r) => r.tag) : [];
    if (!t || (tag !== undefined && !tags.includes(tag))) throw new KilnError("not_found", `No template ${JSON.stringify(alias)}`);
    return { templateID: t.id, public: false };
  });
  // The template builder's routes are templates.ts, the catalog and tag moves template-catalog.ts; the rest of E2B's
  // template API (its deprecated build requests, PATCH of a template), secrets and teams are not served.
  // E2B's timestamp-cursor build log API (the SDK has its type, never calls it): the status route carries the log.
  app.get("/templates/:id/builds/:buildId/logs", { ...unserved, handler: notYet("GET /templates/{id}/builds/{buildID}/logs (E2B's timestamp-cursor build log; the build log is served by GET /templates/{id}/builds/{buildID}/status?logsOffset=, which the SDK polls)") });
  const UNSERVED_METHODS: Record<string, ("GET" | "POST" | "PUT" | "PATCH" | "DELETE")[]> = { "/templates": ["POST", "PUT", "PATCH", "DELETE"], "/v3/templates": ["GET", "PUT", "PATCH", "DELETE"] };
  for (const prefix of ["/templates", "/v2/templates", "/v3/templates", "/secrets", "/teams"]) {
    const what = `${prefix.replace(/^\/v\d/, "")} (E2B's deprecated template build requests and template updates, secrets and teams APIs)`;
    app.route({ method: UNSERVED_METHODS[prefix] ?? ["GET", "POST", "PUT", "PATCH", "DELETE"], url: prefix, ...unserved, handler: notYet(what) });
    app.route({ method: ["GET", "POST", "PUT", "PATCH", "DELETE"], url: `${prefix}/*`, ...unserved, handler: notYet(what) });
  }
}
