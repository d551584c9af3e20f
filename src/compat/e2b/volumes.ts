// E2B's volumes onto Kiln's volumes service (src/volumes/): `Volume.create/getInfo/list/destroy` are Kiln volumes
// (`vol_…` ids, E2B's names), and a sandbox's `volumeMounts` ({name, path}) are Kiln volume mounts at create.
// A volume's `token` is for its content API (volume-content.ts): per volume and API key, derived, never stored.

import { Type } from "typebox";
import type { Static } from "typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import type { Services } from "../../services/index.ts";
import type { VolumeMountRequest, VolumeView } from "../../volumes/service.ts";
import { VOLUME_LIMITS } from "../../volumes/service.ts";
import { KilnError } from "../../errors.ts";

export const E2bVolumeMount = Type.Object({ name: Type.String({ minLength: 1, maxLength: 256 }), path: Type.String({ minLength: 1, maxLength: 4096 }) }, { additionalProperties: false });

const VOLUME_ID = /^vol_[0-9a-z]{26}$/;
/** Volumes looked through to find one by name: more than a host keeps in practice, a bound on the scan. */
const MAX_SCAN = 10_000;

async function* allVolumes(services: Services): AsyncGenerator<VolumeView> {
  let after: [string, string] | undefined;
  for (let seen = 0; seen < MAX_SCAN; ) {
    const page = await services.volumes.list({ limit: 100, after });
    seen += page.volumes.length;
    yield* page.volumes;
    if (!page.more || !page.last) return;
    after = page.last;
  }
}

/** The volume an E2B name or id names: a `vol_` id, else the newest ready volume with that name. */
async function volumeNamed(services: Services, nameOrId: string): Promise<VolumeView | undefined> {
  if (VOLUME_ID.test(nameOrId)) return services.volumes.get(nameOrId).catch(() => undefined);
  for await (const v of allVolumes(services)) if (v.name === nameOrId && v.status === "ready") return v;
  return undefined;
}

/** Kiln mount requests for E2B's `volumeMounts`; 404 naming a volume that does not exist. */
export async function volumeMountsOf(services: Services, mounts: Static<typeof E2bVolumeMount>[] | undefined): Promise<VolumeMountRequest[] | undefined> {
  if (!mounts || mounts.length === 0) return undefined;
  return Promise.all(
    mounts.map(async (m) => {
      const v = await volumeNamed(services, m.name);
      if (!v) throw new KilnError("not_found", `volume "${m.name}" not found`);
      return { volume_id: v.id, path: m.path };
    }),
  );
}

const NewVolume = Type.Object({ name: Type.String({ minLength: 1, maxLength: 128, pattern: "^[A-Za-z0-9][A-Za-z0-9._-]*$" }) }, { additionalProperties: false });
const Params = Type.Object({ id: Type.String({ minLength: 1, maxLength: 256 }) });

export async function volumeRoutes(app: FastifyInstance, services: Services, volumeTokenOf: (volumeId: string, keyId: string) => string) {
  const config = { e2b: "control", auth: "key" as const };
  /** E2B's VolumeAndToken: the token of the key that asked, for the volume content API. */
  const withToken = (v: VolumeView, req: FastifyRequest) => ({ volumeID: v.id, name: v.name, token: volumeTokenOf(v.id, req.apiKeyId!) });

  app.post("/volumes", { config, schema: { hide: true, body: NewVolume } }, async (req, reply) => {
    const { name } = req.body as Static<typeof NewVolume>;
    // E2B's volume names are unique (a mount names its volume by name); Kiln's are not, so this API keeps them so.
    if (await volumeNamed(services, name)) throw new KilnError("conflict", `a volume named "${name}" already exists`);
    const v = await services.volumes.create({ name, size_mb: VOLUME_LIMITS.defaultSizeMb });
    return reply.code(201).send(withToken(v, req));
  });

  app.get("/volumes", { config, schema: { hide: true } }, async () => {
    const out: { volumeID: string; name: string }[] = [];
    for await (const v of allVolumes(services)) if (v.status === "ready") out.push({ volumeID: v.id, name: v.name });
    return out;
  });

  app.get("/volumes/:id", { config, schema: { hide: true, params: Params } }, async (req) => {
    const id = (req.params as { id: string }).id;
    const v = await volumeNamed(services, id);
    if (!v || v.status !== "ready") throw new KilnError("not_found", `volume "${id}" not found`);
    return withToken(v, req);
  });

  app.delete("/volumes/:id", { config, schema: { hide: true, params: Params } }, async (req, reply) => {
    const id = (req.params as { id: string }).id;
    const v = await volumeNamed(services, id);
    if (!v || v.status !== "ready") throw new KilnError("not_found", `volume "${id}" not found`);
    await services.volumes.remove(v.id);
    return reply.code(204).send();
  });
}
