// Templates travel between hosts: each host records in the store which layers it holds, by content digest (the
// sha256 of the layer's packed tar, pack.ts), serves them to its peers only (GET /v1/cluster/layers/{digest}, cluster
// authentication), and fetches by digest from a holder what a create or build here needs and this host lacks:
// checked against the digest before it is used, counted against the disk floor, one fetch per layer however many
// creates wait for it. A peer that fails or serves other bytes is an error naming it, and the next holder is tried.

import { existsSync } from "node:fs";
import { mkdir, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import { Agent, request } from "undici";
import { KilnError } from "../../errors.ts";
import type { Logger } from "../../log.ts";
import type { ArtifactRow, Db } from "../../store/schema.ts";
import { artifactConfig } from "../../builder/artifact-config.ts";
import { unpackLayer } from "../../builder/oci/unpack.ts";
import { ByteBudget, DEFAULT_IMPORT_LIMITS } from "../../builder/oci/limits.ts";
import type { ClusterAuth } from "../cluster-auth.ts";
import { layerDigest } from "./pack.ts";

export const LAYER_DIGEST = /^sha256:[0-9a-f]{64}$/;
/** Bounds on one fetch from a peer: to its first byte, and between two chunks of the tar. */
const HEADERS_TIMEOUT_MS = 30_000;
const BODY_TIMEOUT_MS = 60_000;
const FETCHED_PREFIX = "fetched-";

export interface LayerHolder {
  host_id: string;
  dir: string;
  bytes: number;
}

export function createLayerService(deps: {
  db: Db;
  hostId: string;
  layersDir: string;
  log: Logger;
  /** Refuses (503) a fetch of this many bytes that would take the data dir under its disk floor. */
  admitBytes: (bytes: number) => Promise<void>;
}) {
  const { db, hostId, layersDir, log } = deps;
  let auth: ClusterAuth | undefined;
  let hosts: (() => Promise<Map<string, { id: string; advertise_url: string; status: string }>>) | undefined;
  const agent = new Agent({ keepAliveTimeout: 10_000, connect: { timeout: 5_000 } });
  const hashing = new Map<string, Promise<string>>();
  const fetching = new Map<string, Promise<string>>();

  /** Lets this host fetch from its peers (the cluster secret and the hosts list are known once the server starts). */
  function connect(peerAuth: ClusterAuth, hostList: NonNullable<typeof hosts>) {
    auth = peerAuth;
    hosts = hostList;
  }

  /** This host's record of a layer it holds, when its directory is still there. */
  async function own(digest: string): Promise<LayerHolder | undefined> {
    const row = await db.selectFrom("layer_holders").select(["host_id", "dir", "bytes"]).where("digest", "=", digest).where("host_id", "=", hostId).executeTakeFirst();
    return row && existsSync(row.dir) ? { ...row, bytes: Number(row.bytes) } : undefined;
  }

  async function record(digest: string, dir: string, bytes: number) {
    await db
      .insertInto("layer_holders")
      .values({ digest, host_id: hostId, dir, bytes, created_at: new Date().toISOString() })
      .onConflict((oc) => oc.columns(["digest", "host_id"]).doUpdateSet({ dir, bytes }))
      .execute();
  }

  /** The content digest of a layer directory of this host (hashed once; remembered in the store as a holding). */
  function digestOf(dir: string): Promise<string> {
    let p = hashing.get(dir);
    if (!p) {
      p = (async () => {
        const known = await db.selectFrom("layer_holders").select("digest").where("host_id", "=", hostId).where("dir", "=", dir).executeTakeFirst();
        if (known) return known.digest;
        const { digest, bytes } = await layerDigest(dir);
        await record(digest, dir, bytes);
        return digest;
      })().finally(() => hashing.delete(dir));
      hashing.set(dir, p);
    }
    return p;
  }

  /** Content digests of an artifact's layers, lowest first (recorded with the artifact on a shared store). */
  function contentOf(artifact: Pick<ArtifactRow, "config_json">): (string | null)[] | undefined {
    return artifactConfig(artifact).layerContent;
  }

  /** The digests of the layers that travel (not those every host makes itself). */
  function travelling(artifact: Pick<ArtifactRow, "config_json">): string[] | undefined {
    const content = contentOf(artifact);
    return content?.filter((d): d is string => d !== null);
  }

  /**
   * The directories of an artifact's layers on this host: each one this host holds, else fetched from a holder. An
   * artifact without content digests (recorded on a store of one host) is used as recorded.
   */
  async function localize(artifact: ArtifactRow, layers: string[]): Promise<string[]> {
    const content = contentOf(artifact);
    if (!content || content.length !== layers.length) return layers;
    const out: string[] = [];
    for (let i = 0; i < layers.length; i++) {
      const digest = content[i];
      if (digest === null || digest === undefined) {
        // A layer of a template every host makes itself (the base): here at its path, as on the host that built.
        if (!existsSync(layers[i]!)) throw new KilnError("unavailable", `This host has no copy of the built-in template layer ${layers[i]} the template builds on (is its KILN_CACHE_DIR the same as the other hosts'?)`);
        out.push(layers[i]!);
        continue;
      }
      // Only what this host holds by its own record (built or fetched here): a directory at the artifact's path that
      // is another host's (a shared file system, a test on one machine) is not this host's to use.
      const held = await own(digest);
      out.push(held ? held.dir : await fetchShared(digest));
    }
    return out;
  }

  function fetchShared(digest: string): Promise<string> {
    let p = fetching.get(digest);
    if (!p) {
      p = fetchLayer(digest).finally(() => fetching.delete(digest));
      fetching.set(digest, p);
    }
    return p;
  }

  async function fetchLayer(digest: string): Promise<string> {
    if (!auth || !hosts) throw new KilnError("unavailable", `Template layer ${digest} is not on this host, which does not share a store with other hosts`);
    const live = await hosts();
    const rows = await db.selectFrom("layer_holders").select(["host_id", "bytes"]).where("digest", "=", digest).where("host_id", "!=", hostId).execute();
    const peers = rows.map((r) => ({ host: live.get(r.host_id), bytes: Number(r.bytes) })).filter((p) => p.host && p.host.status !== "lost");
    if (peers.length === 0) throw new KilnError("unavailable", `Template layer ${digest} is not on this host and no other active host holds it`, { detail: { retryable: false } });
    const failures: string[] = [];
    for (const { host, bytes } of peers) {
      await deps.admitBytes(bytes);
      const final = join(layersDir, `${FETCHED_PREFIX}${digest.slice("sha256:".length)}`);
      const tmp = join(layersDir, `.fetching-${randomBytes(6).toString("hex")}`);
      const started = Date.now();
      try {
        await mkdir(layersDir, { recursive: true, mode: 0o700 });
        const path = `/v1/cluster/layers/${digest}`;
        const res = await request(`${host!.advertise_url}${path}`, { method: "GET", headers: auth.sign("GET", path, host!.id, undefined), dispatcher: agent, headersTimeout: HEADERS_TIMEOUT_MS, bodyTimeout: BODY_TIMEOUT_MS });
        if (res.statusCode !== 200) {
          const text = (await res.body.text().catch(() => "")).slice(0, 300);
          throw new Error(`answered ${res.statusCode} ${text}`);
        }
        // The peer's tar may be no larger than the holding it recorded: a peer that streams more is cut there.
        const limits = { ...DEFAULT_IMPORT_LIMITS, imageBytes: bytes };
        await unpackLayer(res.body, "none", tmp, { expectDiffId: digest, limits, budget: new ByteBudget(limits) });
        await rm(final, { recursive: true, force: true });
        await rename(tmp, final);
        await record(digest, final, bytes);
        log.info({ digest, from: host!.id, bytes, ms: Date.now() - started }, "fetched a template layer from a peer");
        return final;
      } catch (err) {
        await rm(tmp, { recursive: true, force: true }).catch(() => undefined);
        const why = (err as Error).message;
        failures.push(`host ${host!.id}: ${why}`);
        log.warn({ digest, from: host!.id, err: why }, "fetching a template layer from a peer failed; trying the next holder");
      }
    }
    throw new KilnError("unavailable", `Template layer ${digest} could not be fetched from any host that holds it (${failures.join("; ")})`, { detail: { retryable: true } });
  }

  /** The directory this host serves a layer from, when it holds it. */
  async function served(digest: string): Promise<LayerHolder | undefined> {
    return own(digest);
  }

  /** Hosts that hold every one of `digests` (the template-locality hint placement uses). */
  async function holdersOfAll(digests: string[]): Promise<Set<string>> {
    if (digests.length === 0) return new Set();
    const rows = await db.selectFrom("layer_holders").select(["host_id", "digest"]).where("digest", "in", [...new Set(digests)]).execute();
    const count = new Map<string, number>();
    for (const r of rows) count.set(r.host_id, (count.get(r.host_id) ?? 0) + 1);
    return new Set([...count].filter(([, n]) => n === new Set(digests).size).map(([h]) => h));
  }

  /** Whether every layer of an artifact is held by a host that is not lost (the cluster's view, not this disk's). */
  async function availableInCluster(artifact: ArtifactRow): Promise<boolean | undefined> {
    const content = travelling(artifact);
    if (!content) return undefined;
    const live = hosts ? await hosts() : new Map([[hostId, { id: hostId, advertise_url: "", status: "active" }]]);
    const rows = content.length ? await db.selectFrom("layer_holders").select(["host_id", "digest"]).where("digest", "in", [...new Set(content)]).execute() : [];
    const held = new Set(rows.filter((r) => (live.get(r.host_id)?.status ?? "lost") !== "lost").map((r) => r.digest));
    return content.every((d) => held.has(d));
  }

  /** This host's layer directories the store says it holds: retention keeps those a live artifact names. */
  async function ownHoldings(): Promise<{ digest: string; dir: string }[]> {
    return db.selectFrom("layer_holders").select(["digest", "dir"]).where("host_id", "=", hostId).execute();
  }

  /** Retention removed a directory: this host no longer holds what was in it. */
  async function forget(dir: string): Promise<void> {
    await db.deleteFrom("layer_holders").where("host_id", "=", hostId).where("dir", "=", dir).execute();
  }

  return { connect, digestOf, localize, served, holdersOfAll, availableInCluster, ownHoldings, forget, travelling, close: () => agent.close() };
}

export type LayerService = ReturnType<typeof createLayerService>;
