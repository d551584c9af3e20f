// The composition root: every domain's service made once at start, wired to the others it needs, and handed to the
// routes as one Services object. Nothing else lives here; each domain owns its story in its own folder.

import { join } from "node:path";
import type { Store } from "../store/db.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { Logger } from "../log.ts";
import { createKeyService } from "../keys/service.ts";
import { createTemplateService } from "../templates/service.ts";
import { BASE_TEMPLATE_REF } from "../templates/resolver.ts";
import { createMachineService } from "../machines/service.ts";
import { createExecService } from "../machines/exec.ts";
import { createFileService } from "../machines/files.ts";
import { MACHINE_DEFAULTS } from "../machines/records.ts";
import { createWarmPool } from "../machines/warm-pool.ts";
import { createHotPools, HOT_POOL_DEFAULTS } from "../machines/hot-pools.ts";
import type { HotPools, HotPoolSettings } from "../machines/hot-pools.ts";
import { createBuildService } from "../builder/service.ts";
import type { BuildExtensions } from "../builder/service.ts";
import { createTemplateCatalog } from "../templates/catalog.ts";
import { createWebhookService } from "../webhooks/service.ts";
import { createDispatcher } from "../webhooks/dispatcher.ts";
import { createGitService } from "../git/service.ts";
import { createCodeService } from "../code/service.ts";
import { createVolumeService } from "../volumes/service.ts";
import { createDeploymentService } from "../deployments/service.ts";
import type { DeploymentOptions } from "../deployments/service.ts";
import { createAdmission } from "../machines/admission.ts";
import { createTeardown } from "../machines/teardown.ts";
import type { Teardown } from "../machines/teardown.ts";
import { createBootQueue } from "../machines/boot-queue.ts";
import { createMachineMetrics } from "../machines/metrics.ts";
import type { AdmissionLimits } from "../machines/admission.ts";
import type { KeyService } from "../keys/service.ts";
import type { TemplateService } from "../templates/service.ts";
import type { TemplateCatalog } from "../templates/catalog.ts";
import { createCodeInterpreterTemplate } from "../templates/code-interpreter.ts";
import type { CodeInterpreterTemplate } from "../templates/code-interpreter.ts";
import type { MachineService } from "../machines/service.ts";
import type { ExecService } from "../machines/exec.ts";
import type { FileService } from "../machines/files.ts";
import type { WarmPool } from "../machines/warm-pool.ts";
import type { Admission } from "../machines/admission.ts";
import type { MachineMetricsService } from "../machines/metrics.ts";
import type { BuildService } from "../builder/service.ts";
import type { WebhookService } from "../webhooks/service.ts";
import type { Dispatcher } from "../webhooks/dispatcher.ts";
import type { GitService } from "../git/service.ts";
import type { CodeService } from "../code/service.ts";
import type { VolumeService } from "../volumes/service.ts";
import type { DeploymentService } from "../deployments/service.ts";
import { createSnapshotService } from "../snapshots/service.ts";
import type { SnapshotService } from "../snapshots/service.ts";
import { createHostService } from "../hosts/service.ts";
import { createLayerService } from "../hosts/layers/service.ts";
import type { LayerService } from "../hosts/layers/service.ts";
import type { HostService } from "../hosts/service.ts";

export interface WebhookSettings {
  retryScheduleMs: number[];
  allowPrivate: boolean;
  rotationGraceMs: number;
  /** Seconds finished deliveries and their events are kept (0: forever). */
  historyS?: number;
}

/** What the routes, the E2B layer and the server's start and stop see: one service per domain. */
export interface Services {
  store: Store;
  driver: MachineDriver;
  keys: KeyService;
  templates: TemplateService;
  pool: WarmPool;
  /** Warm pools of the often-created templates other than the base (the code interpreter's with its kernel up). */
  hotPools: HotPools;
  admission: Admission;
  /** The cleanup that runs behind a DELETE's answer (what is still being cleaned, and a wait for it). */
  teardown: Teardown;
  machines: MachineService;
  snapshots: SnapshotService;
  machineMetrics: MachineMetricsService;
  exec: ExecService;
  files: FileService;
  builds: BuildService;
  templateCatalog: TemplateCatalog;
  /** `local/code-interpreter-v1`, made on first use (E2B's default template for @e2b/code-interpreter). */
  codeInterpreterTemplate: CodeInterpreterTemplate;
  webhooks: WebhookService;
  dispatcher: Dispatcher;
  git: GitService;
  code: CodeService;
  volumes: VolumeService;
  deployments: DeploymentService;
  hosts: HostService;
  /** On a store shared by hosts: which host holds which layer, fetching and serving them (src/hosts/layers/). */
  layers?: LayerService;
}

export interface HostSettings {
  name: string;
  lostAfterS: number;
  heartbeatMs: number;
}

export function createServices(deps: {
  store: Store;
  driver: MachineDriver;
  log: Logger;
  warmPoolSize: number;
  /**
   * KILN_WARM_POOL_MAX: the base pool grows with its create rate up to this many (0 or at most the size: fixed);
   * "auto" (the default): what the admission floors allow (admission.idleBound), none when the pool's size is 0.
   */
  warmPoolMax?: number | "auto";
  /** KILN_WARM_POOL_IDLE_S: a peak of creates keeps the grown pool this long. */
  warmPoolIdleMs?: number;
  hotPools?: HotPoolSettings;
  dataDir: string;
  buildRetentionS: number;
  /** KILN_BUILD_LOG_MAX_BYTES; the default when unset. */
  buildLogMaxBytes?: number;
  buildExtensions?: BuildExtensions;
  hostId: string;
  /** KILN_CACHE_DIR: where the templates Kiln makes itself are kept. */
  cacheDir: string;
  webhooks: WebhookSettings;
  deployments: DeploymentOptions;
  limits: AdmissionLimits;
  snapshots?: { maxSnapshots: number; maxHibernationS: number };
  hosts?: HostSettings;
}): Services {
  const { store, driver, log, hostId } = deps;
  const boots = createBootQueue();
  const keys = createKeyService(store.db);
  const templates = createTemplateService(store.db);

  const teardown = createTeardown({ driver, log });
  const volumes = createVolumeService({ db: store.db, dataDir: deps.dataDir, log, hostId, machinesCleaned: (ids) => teardown.cleaned(ids) });
  const admission = createAdmission({ db: store.db, limits: deps.limits, cleaning: () => teardown.pending(), hostId });
  // Grown by demand (KILN_WARM_POOL_MAX) up to what the admission floors allow, booting only above them, as the hot pools.
  const warmMax = (deps.warmPoolMax ?? "auto") === "auto" ? (deps.warmPoolSize > 0 ? Math.min(256, admission.idleBound(MACHINE_DEFAULTS.memoryMb)) : 0) : (deps.warmPoolMax as number);
  const pool = createWarmPool({ driver, size: deps.warmPoolSize, demand: { max: warmMax, idleMs: deps.warmPoolIdleMs, room: () => admission.idleRoom(512) }, log, boots });
  // A pooled idle machine needs this much above the memory floor (a code-interpreter one holds its kernel: ≈ 150 MiB).
  const hotPools = createHotPools({ driver, log, settings: deps.hotPools ?? HOT_POOL_DEFAULTS, boots, room: () => admission.idleRoom(512) });
  // On a store shared by hosts, templates travel: layers are recorded by content digest and fetched from holders.
  const layers = store.dialect === "postgres" ? createLayerService({ db: store.db, hostId, layersDir: join(deps.dataDir, "layers"), log, admitBytes: (n) => admission.admitBytes(n) }) : undefined;
  if (layers) templates.setLocalizer(layers.localize);
  const machines = createMachineService({ db: store.db, driver, templates, log, baseTemplateRef: BASE_TEMPLATE_REF, pool, hotPools, hostId, volumes, admission, teardown, boots, maxHibernationS: deps.snapshots?.maxHibernationS });
  const snapshots = createSnapshotService({ db: store.db, driver, machines, admission, log, hostId, maxSnapshots: deps.snapshots?.maxSnapshots });
  const builds = createBuildService({ db: store.db, driver, templates, log, dataDir: deps.dataDir, retentionS: deps.buildRetentionS, logMaxBytes: deps.buildLogMaxBytes, extensions: deps.buildExtensions, snapshots, hostId, layers });
  const templateCatalog = createTemplateCatalog({ db: store.db, retentionS: deps.buildRetentionS });
  const dispatcher = createDispatcher({ db: store.db, dialect: store.dialect, hostId, log, scheduleMs: deps.webhooks.retryScheduleMs, allowPrivate: deps.webhooks.allowPrivate, historyS: deps.webhooks.historyS });
  const webhooks = createWebhookService({ db: store.db, allowPrivate: deps.webhooks.allowPrivate, rotationGraceMs: deps.webhooks.rotationGraceMs, wake: dispatcher.wake });
  const hostSettings = deps.hosts ?? { name: hostId, lostAfterS: 30, heartbeatMs: 5000 };
  const hosts = createHostService({
    db: store.db,
    log,
    hostId,
    name: hostSettings.name,
    lostAfterS: hostSettings.lostAfterS,
    heartbeatMs: hostSettings.heartbeatMs,
    onStatus: (status) => {
      pool.hold(status !== "active");
      hotPools.hold(status !== "active");
    },
    onLost: async (host, reason) => {
      const ended = await builds.recoverInterrupted([host.id], reason);
      if (ended > 0) log.warn({ host_id: host.id, builds: ended }, "builds of a lost host marked error");
      await deployments.rescheduleLost(host, reason);
    },
    capacity: async () => {
      const c = await admission.capacity();
      return {
        cores: c.host_cores,
        memory_mb: c.host_memory_mb,
        mem_available_mb: c.mem_available_mb,
        min_free_memory_mb: c.min_free_memory_mb,
        free_disk_mb: c.free_disk_mb,
        min_free_disk_mb: c.min_free_disk_mb,
        max_disk_mb: c.max_disk_mb,
        live_machines: c.live_machines,
        accepting: c.accepting,
        warm_ready: { base: pool.stats().ready, ...Object.fromEntries(hotPools.stats().templates.map((t) => [t.artifact_id, t.ready])) },
      };
    },
  });
  const deployments = createDeploymentService({ db: store.db, machines, templates, log, options: deps.deployments, hostId, rowLocks: store.dialect === "postgres" });
  return {
    store,
    driver,
    keys,
    templates,
    pool,
    hotPools,
    admission,
    teardown,
    machines,
    snapshots,
    machineMetrics: createMachineMetrics({ machines, driver }),
    exec: createExecService(machines),
    files: createFileService(machines),
    builds,
    templateCatalog,
    codeInterpreterTemplate: createCodeInterpreterTemplate({ templates, cacheDir: deps.cacheDir, log }),
    webhooks,
    dispatcher,
    git: createGitService(machines),
    code: createCodeService(machines),
    volumes,
    deployments,
    hosts,
    layers,
  };
}

