// Composition and lifecycle of a Kiln server: config → logger → store → keys → guest runtime → driver →
// services → HTTP. Start adopts live machines; shutdown stops taking requests, finishes in-flight ones, closes the store.

import { join } from "node:path";
import type { Config } from "./config.ts";
import { createLogger } from "./log.ts";
import type { Logger } from "./log.ts";
import { openStore } from "./store/db.ts";
import type { Store } from "./store/db.ts";
import { createServices } from "./services/index.ts";
import { createOciImportSource } from "./builder/sources/oci-import.ts";
import { createOciCacheRetention } from "./builder/oci/cache-retention.ts";
import { createBuildkitBackend } from "./builder/sources/dockerfile.ts";
import { templateBaseSource } from "./builder/sources/template-base.ts";
import type { SourceLayers } from "./builder/sources/source.ts";
import type { Services } from "./services/index.ts";
import { buildServer } from "./api/server.ts";
import type { App } from "./api/server.ts";
import { createOciDriver } from "./runtime/oci/driver.ts";
import { prepareGuestRuntime } from "./runtime/guest-runtime.ts";
import { bundleAgent, AGENT_SOURCES } from "./agent/bundle.ts";
import { ensureBaseTemplate } from "./builder/base-template.ts";
import { MACHINE_DEFAULTS } from "./machines/service.ts";
import { ensureHostId } from "./runtime/host-id.ts";
import { GUEST_RUNTIME_DIR, preparePrivateDataDir, usePrivateUmask } from "./data-dir.ts";

export interface Kiln {
  app: App;
  services: Services;
  log: Logger;
  /** Resolves when the base template is recorded (at once when it was already cached). */
  baseReady: Promise<void>;
  url: string;
  close(): Promise<void>;
}

export async function openStoreFor(config: Config, log?: Logger): Promise<Store> {
  return openStore({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log });
}

export async function startKiln(config: Config, opts: { log?: Logger; listen?: boolean } = {}): Promise<Kiln> {
  const log = opts.log ?? createLogger({ level: config.logLevel });
  // Everything Kiln writes from here on is private (store, WAL, secrets, disk images, logs, caches, build scratch).
  usePrivateUmask();
  await preparePrivateDataDir(config.dataDir, config.cacheDir);
  const store = await openStoreFor(config, log);
  const guestRuntimeDir = await prepareGuestRuntime({ dir: join(config.cacheDir, GUEST_RUNTIME_DIR), agentBundle: bundleAgent, agentSources: AGENT_SOURCES });
  const machinesCaps = { pidsMax: config.machinesPidsMax, memoryBytes: config.machinesMemoryMb === undefined ? undefined : config.machinesMemoryMb * 1024 * 1024 };
  const driver = createOciDriver({
    dataDir: config.dataDir,
    runtime: config.ociRuntime,
    runscPlatform: config.runscPlatform,
    hostAccess: config.machineHostAccess,
    log,
    guestRuntimeDir,
    identity: config.machineIdentity,
    helperDir: join(config.cacheDir, "bin"),
    idRangesDir: config.idRangesDir,
    hostLimits: machinesCaps,
    diskPool: config.diskPool,
    snapshotSpares: config.snapshotSpares,
  });
  const hostId = await ensureHostId(config.dataDir, config.hostId);
  const webhooks = { retryScheduleMs: config.webhookRetryScheduleMs, allowPrivate: config.webhookAllowPrivate, rotationGraceMs: config.webhookRotationGraceMs, historyS: config.webhookHistoryS };
  const deployments = { dataDir: config.dataDir, publicUrl: config.publicUrl, maxCrashes: config.serviceMaxCrashes, backoffMs: config.serviceBackoffMs, edgeTokenTtlS: config.edgeTokenTtlS, edgeDomain: config.edgeDomain, envsKeyFile: config.deploymentEnvsKeyFile };
  const limits = { dataDir: config.dataDir, maxDiskMb: config.maxDiskMb, minFreeDiskMb: config.minFreeDiskMb, minFreeMemoryMb: config.minFreeMemoryMb, memoryOvercommit: config.memoryOvercommit };
  // Image imports and Dockerfile builds plug into the build pipeline; a Dockerfile's FROM may name a Kiln template,
  // resolved through the template service the pipeline itself is part of (bound once the services exist).
  let templateLayers: ((name: string) => Promise<SourceLayers | undefined>) | undefined;
  const buildExtensions = {
    ociImport: createOciImportSource({ ociDir: join(config.dataDir, "oci"), insecureRegistries: config.insecureRegistries, limits: config.ociLimits }),
    ociCache: createOciCacheRetention(join(config.dataDir, "oci")),
    buildkit: createBuildkitBackend({
      cacheDir: config.cacheDir,
      ociLimits: config.ociLimits,
      dataDir: config.dataDir,
      insecureRegistries: config.insecureRegistries,
      buildkitHost: config.buildkitHost,
      hostAccess: config.machineHostAccess,
      stepTimeoutMs: config.buildStepTimeoutS * 1000,
      buildTimeoutMs: config.buildTimeoutS * 1000,
      resolveTemplate: async (name) => templateLayers?.(name),
    }),
    nativeTimeouts: { stepMs: config.buildStepTimeoutS * 1000, buildMs: config.buildTimeoutS * 1000 },
  };
  const services = createServices({ store, driver, log, warmPoolSize: config.warmPool, warmPoolMax: config.warmPoolMax, warmPoolIdleMs: config.warmPoolIdleMs, hotPools: config.hotPools, dataDir: config.dataDir, cacheDir: config.cacheDir, buildRetentionS: config.buildRetentionS, buildLogMaxBytes: config.buildLogMaxBytes, hostId, webhooks, deployments, limits, buildExtensions, snapshots: { maxSnapshots: config.maxSnapshots, maxHibernationS: config.maxHibernationS }, hosts: { name: config.hostName, lostAfterS: config.hostLostAfterS, heartbeatMs: config.hostHeartbeatMs } });
  templateLayers = async (name) => {
    const resolved = await services.templates.resolve(name).catch(() => undefined);
    return resolved ? templateBaseSource(resolved) : undefined;
  };
  await services.keys.seed({ apiKey: config.apiKey, dataDir: config.dataDir, log });

  const adoption = await services.machines.adopt();
  if (adoption.adopted + adoption.lost + adoption.removed > 0) log.info(adoption, "machines reconciled after start");
  // Snapshots a crash cut short, and files no snapshot names, go before anything is served (room: snapshots).
  const snapshotCleanup = await services.snapshots.reconcile();
  if (snapshotCleanup.failed + snapshotCleanup.removed > 0) log.info(snapshotCleanup, "snapshots reconciled after start");
  services.machines.startSweeper();
  services.machineMetrics.startSampling(); // metrics over a time range: a short ring per running machine
  // Builds a previous process left running end `error` (their build machines went with adoption above); what a
  // Dockerfile build of a dead process left running or mounted is killed and removed first.
  const swept = await buildExtensions.buildkit.sweep().catch((err: unknown) => (log.error({ err }, "sweeping dead Dockerfile builds failed"), 0));
  if (swept > 0) log.warn({ builds: swept }, "what Dockerfile builds of a stopped server left was removed");
  const interrupted = await services.builds.recoverInterrupted();
  if (interrupted > 0) log.warn({ builds: interrupted }, "builds interrupted by the last stop were marked error");
  services.builds.startCollector();
  await services.dispatcher.start();
  const volumes = await services.volumes.start();
  if (volumes.mounted + volumes.cleaned > 0) log.info(volumes, "volumes restored after start");
  await services.deployments.start();

  const baseReady = ensureBaseTemplate({ cacheDir: config.cacheDir, mirror: config.debianMirror, log, onProgress: (line) => log.info({ phase: "base-template" }, line) })
    .then(async ({ layerDir, digest }) => {
      const base = await services.templates.registerBase(layerDir, digest);
      services.templates.setPending(null);
      services.pool.configure({ artifactId: base.artifact.id, layers: base.layers, vcpus: MACHINE_DEFAULTS.vcpus, memoryMb: MACHINE_DEFAULTS.memoryMb });
      // code-interpreter-v1 made earlier (by any server on this cache, or the CLI) is recorded now, not on first use.
      if (await services.codeInterpreterTemplate.registerCached()) log.info("the code-interpreter-v1 template was in the cache");
    })
    .catch((err: unknown) => {
      services.templates.setPending(`the base template could not be made: ${(err as Error).message}`);
      log.error({ err }, "making the base template failed");
    });
  services.templates.setPending("the base template is being made (first start); try again in a minute");

  const app = await buildServer({ log, services, bodyLimitBytes: config.bodyLimitBytes, wsPingIntervalMs: config.wsPingIntervalMs, volumeWatchQueue: config.volumeWatchQueue, mcpHeldMaxBytes: config.mcpHeldMaxBytes, shutdownGraceMs: config.shutdownGraceMs, publicUrl: config.publicUrl, edgeDomain: config.edgeDomain, edgeLimits: config.edgeLimits, e2b: { dataDir: config.dataDir, publicUrl: config.publicUrl, buildRetentionS: config.buildRetentionS }, cluster: { lostAfterS: config.hostLostAfterS } });
  let url = "";
  if (opts.listen !== false) url = await app.listen({ host: config.host, port: config.port });
  // Port 0 means "any free port": public URLs can name the real one only now.
  if (url && new URL(config.publicUrl).port === "0") services.deployments.setPublicUrl(url);
  // This host joins the store's hosts where its peers can reach it (port 0, too, is only known now).
  if (url) {
    await services.hosts.register(config.advertiseUrl ?? advertisedFrom(config.host, url));
    services.hosts.start();
  }

  let closing: Promise<void> | undefined;
  async function close() {
    closing ??= (async () => {
      // Running builds end first (as `error`: the server stopped), so their log streams close and app.close can finish.
      await services.builds.close();
      await services.hosts.close();
      services.machineMetrics.stopSampling();
      await app.close();
      await services.deployments.close();
      await services.pool.close();
      await services.hotPools.close();
      await services.volumes.close();
      await services.machines.close();
      await services.dispatcher.close();
      await driver.close();
      await store.close();
    })();
    return closing;
  }
  return { app, services, log, baseReady, url, close };
}

/** KILN_ADVERTISE_URL's default: the address the server listens on, with the port it got (0.0.0.0 names no host). */
function advertisedFrom(host: string, listening: string): string {
  const port = new URL(listening).port;
  const wildcard = host === "0.0.0.0" || host === "::" || host === "";
  const name = wildcard ? "127.0.0.1" : host.includes(":") ? `[${host}]` : host;
  return `http://${name}:${port}`;
}
