// E2B's snapshots, fork and pause onto Kiln's snapshots service (src/snapshots/, docs/snapshots.md): a snapshot is a
// Kiln snapshot (`snp_…`, its name among its `names`), a sandbox made from one is a machine made from it, a fork is
// Kiln's fork, and deleting a snapshot (E2B's `DELETE /templates/{id}`) removes it. E2B keeps memory in all of these;
// Kiln does where its runtime can (gVisor), else the disk alone (runc: CRIU fails on this host's kernel).

import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import type { MachineView } from "../../machines/service.ts";
import { MACHINE_LIMITS } from "../../machines/service.ts";
import type { SnapshotView } from "../../snapshots/views.ts";
import { SNAPSHOT_LIMITS } from "../../snapshots/service.ts";
import { KilnError } from "../../errors.ts";
import { machineIdOf } from "./ids.ts";

export interface SnapshotKit {
  services: Services;
  /** The running or paused machine a sandbox id names; 404 in E2B's words otherwise. */
  live(id: string): Promise<MachineView>;
  /** A sandbox as create and connect answer it (ids, tokens, domain). */
  created(m: MachineView, req: FastifyRequest): Record<string, unknown>;
  /** E2B's default timeout of a new sandbox (seconds). */
  defaultTimeoutS: number;
}

const SNAPSHOT_ID = /^snp_[0-9a-z]{26}$/;
const Params = Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }) });
const SnapshotBody = Type.Union([Type.Object({ name: Type.Optional(Type.String({ minLength: 1, maxLength: 128 })) }, { additionalProperties: false }), Type.Null()]);
const ForkBody = Type.Union([
  Type.Object(
    {
      count: Type.Optional(Type.Integer({ minimum: 1, maximum: SNAPSHOT_LIMITS.maxForkCount })),
      timeout: Type.Optional(Type.Integer({ minimum: 1, maximum: MACHINE_LIMITS.maxTimeoutS })),
    },
    { additionalProperties: false },
  ),
  Type.Null(),
]);
const ListQuery = Type.Object(
  {
    sandboxID: Type.Optional(Type.String({ minLength: 1, maxLength: 64 })),
    name: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
    limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 100 })),
    nextToken: Type.Optional(Type.String({ maxLength: 512 })),
  },
  { additionalProperties: false },
);

/** E2B's SnapshotInfo: the id a create takes back, and its names (Kiln has no team namespace or tags). */
const info = (s: SnapshotView) => ({ snapshotID: s.id, names: s.name ? [s.name] : [] });

/** The newest ready snapshot with this name (E2B moves a name to its newest snapshot), scanning at most one host's bound. */
async function snapshotNamed(services: Services, name: string): Promise<SnapshotView | undefined> {
  let after: [string, string] | undefined;
  for (let seen = 0; seen < SNAPSHOT_LIMITS.defaultMaxPerHost * 2; ) {
    const page = await services.snapshots.list({ limit: 100, after });
    seen += page.snapshots.length;
    const hit = page.snapshots.find((s) => s.name === name && s.status === "ready");
    if (hit) return hit;
    if (!page.more || !page.last) return undefined;
    after = page.last;
  }
  return undefined;
}

/** The snapshot a create's templateID names — `snp_…` or a snapshot's name — or undefined when it names none. */
export async function snapshotOfTemplateId(services: Services, templateId: string): Promise<SnapshotView | undefined> {
  if (SNAPSHOT_ID.test(templateId)) {
    const s = await services.snapshots.get(templateId).catch(() => undefined);
    if (!s || s.status !== "ready") throw new KilnError("not_found", `snapshot "${templateId}" not found`);
    return s;
  }
  return snapshotNamed(services, templateId);
}

/** Memory goes into snapshots, forks and pauses where the runtime can keep it. */
export const keepsMemory = (services: Services) => services.driver.memorySnapshotsUnsupported() === undefined;

export async function snapshotRoutes(app: FastifyInstance, kit: SnapshotKit) {
  const { services } = kit;
  const config = { e2b: "control", auth: "key" as const };

  app.post("/sandboxes/:id/snapshots", { config, schema: { hide: true, params: Params, body: SnapshotBody } }, async (req, reply) => {
    const m = await kit.live((req.params as { id: string }).id);
    const name = (req.body as Static<typeof SnapshotBody>)?.name;
    // A paused (stopped) sandbox's memory is not there to save: its disk is.
    const memory = keepsMemory(services) && m.status === "running";
    const s = await services.snapshots.create(m.id, { name, memory });
    return reply.code(201).send(info(s));
  });

  app.get("/snapshots", { config, schema: { hide: true, querystring: ListQuery } }, async (req, reply) => {
    const q = req.query as Static<typeof ListQuery>;
    const machineId = q.sandboxID === undefined ? undefined : machineIdOf(q.sandboxID);
    if (q.sandboxID !== undefined && !machineId) return [];
    const limit = q.limit ?? 100;
    let after: [string, string] | undefined;
    if (q.nextToken) {
      try {
        after = JSON.parse(Buffer.from(q.nextToken, "base64url").toString()) as [string, string];
        if (!Array.isArray(after) || after.length !== 2 || !after.every((x) => typeof x === "string")) throw new Error();
      } catch {
        throw new KilnError("invalid_request", "nextToken is not one this server gave");
      }
    }
    const out: ReturnType<typeof info>[] = [];
    for (;;) {
      const page = await services.snapshots.list({ limit, after, machineId });
      let last: SnapshotView | undefined;
      for (const s of page.snapshots) {
        last = s;
        if (s.status !== "ready") continue;
        if (q.name !== undefined && s.name !== q.name && s.id !== q.name) continue;
        out.push(info(s));
        if (out.length === limit) break;
      }
      if (out.length === limit && last && (page.more || last !== page.snapshots.at(-1))) {
        reply.header("x-next-token", Buffer.from(JSON.stringify([last.created_at, last.id])).toString("base64url"));
        break;
      }
      if (!page.more || !page.last) break;
      after = page.last;
    }
    return out;
  });

  // E2B deletes a snapshot as the template it is there. Kiln's templates are not served through this API (see
  // docs/e2b.md), so a template id that is no snapshot is refused as unserved by the caller's fallback.
  async function deleteSnapshot(req: FastifyRequest, reply: FastifyReply, fallback: () => Promise<never>) {
    const id = (req.params as { id: string }).id;
    const s = SNAPSHOT_ID.test(id) ? await services.snapshots.get(id).catch(() => undefined) : await snapshotNamed(services, id);
    if (!s) {
      if (SNAPSHOT_ID.test(id)) throw new KilnError("not_found", `snapshot "${id}" not found`);
      return fallback();
    }
    if (s.status === "deleted" || s.status === "failed") throw new KilnError("not_found", `snapshot "${id}" not found`);
    await services.snapshots.remove(s.id);
    return reply.code(204).send();
  }

  app.post("/sandboxes/:id/fork", { config, schema: { hide: true, params: Params, body: ForkBody } }, async (req, reply) => {
    const m = await kit.live((req.params as { id: string }).id);
    const body = (req.body as Static<typeof ForkBody>) ?? {};
    const { machines } = await services.snapshots.fork(m.id, {
      count: body.count ?? 1,
      timeout_s: body.timeout ?? kit.defaultTimeoutS,
      memory: keepsMemory(services) && m.status === "running",
    });
    return reply.code(201).send(machines.map((child) => ({ sandbox: kit.created(child, req) })));
  });

  return { deleteSnapshot };
}
