// The services the API stands on, made once at start and handed to the routes.

import type { Store } from "../store/db.ts";
import type { MachineDriver } from "../runtime/driver.ts";
import type { Logger } from "../log.ts";
import { createKeyService } from "./keys.ts";
import { createTemplateService, BASE_TEMPLATE_REF } from "./templates.ts";
import { createMachineService } from "./machines.ts";
import { createExecService } from "./exec.ts";
import { createFileService } from "./files.ts";
import { createWarmPool } from "./warm-pool.ts";
import { createBuildService } from "./builds.ts";
import type { BuildExtensions } from "./builds.ts";
import { createTemplateCatalog } from "./template-catalog.ts";
import { createWebhookService } from "./webhooks.ts";
import { createDispatcher } from "../webhooks/dispatcher.ts";
import { createGitService } from "./git.ts";
import { createCodeService } from "./code.ts";
import { createVolumeService } from "./volumes.ts";
import { createDeploymentService } from "./deployments.ts";
import type { DeploymentOptions } from "./deployments.ts";
import { createAdmission } from "./admission.ts";
import { createMachineMetrics } from "./machine-metrics.ts";
import type { AdmissionLimits } from "./admission.ts";
import { createSnapshotService } from "../snapshots/service.ts";

export interface WebhookSettings {
  retryScheduleMs: number[];
  allowPrivate: boolean;
  rotationGraceMs: number;
}

export function createServices(deps: {
  store: Store;
  driver: MachineDriver;
  log: Logger;
  warmPoolSize: number;
  dataDir: string;
  buildRetentionS: number;
  /** KILN_BUILD_LOG_MAX_BYTES; the default when unset. */
  buildLogMaxBytes?: number;
  buildExtensions?: BuildExtensions;
  hostId: string;
  webhooks: WebhookSettings;
  deployments: DeploymentOptions;
  limits: AdmissionLimits;
  snapshots?: { maxSnapshots: number; maxHibernationS: number };
}) {
  const { store, driver, log, hostId } = deps;
  const pool = createWarmPool({ driver, size: deps.warmPoolSize, log });
  const keys = createKeyService(store.db);
  const templates = createTemplateService(store.db);
  const volumes = createVolumeService({ db: store.db, dataDir: deps.dataDir, log });
  const admission = createAdmission({ db: store.db, limits: deps.limits });
  const machines = createMachineService({ db: store.db, driver, templates, log, baseTemplateRef: BASE_TEMPLATE_REF, pool, hostId, volumes, admission, maxHibernationS: deps.snapshots?.maxHibernationS });
  const snapshots = createSnapshotService({ db: store.db, driver, machines, admission, log, hostId, maxSnapshots: deps.snapshots?.maxSnapshots });
  const builds = createBuildService({ db: store.db, driver, templates, log, dataDir: deps.dataDir, retentionS: deps.buildRetentionS, logMaxBytes: deps.buildLogMaxBytes, extensions: deps.buildExtensions });
  const templateCatalog = createTemplateCatalog({ db: store.db, templateIdOf: builds.templateIdOf });
  const dispatcher = createDispatcher({ db: store.db, dialect: store.dialect, hostId, log, scheduleMs: deps.webhooks.retryScheduleMs, allowPrivate: deps.webhooks.allowPrivate });
  const webhooks = createWebhookService({ db: store.db, allowPrivate: deps.webhooks.allowPrivate, rotationGraceMs: deps.webhooks.rotationGraceMs, wake: dispatcher.wake });
  const deployments = createDeploymentService({ db: store.db, machines, templates, log, options: deps.deployments, hostId });
  return {
    store,
    driver,
    keys,
    templates,
    pool,
    admission,
    machines,
    snapshots,
    machineMetrics: createMachineMetrics({ machines, driver }),
    exec: createExecService(machines),
    files: createFileService(machines),
    builds,
    templateCatalog,
    webhooks,
    dispatcher,
    git: createGitService(machines),
    code: createCodeService(machines),
    volumes,
    deployments,
  };
}

export type Services = ReturnType<typeof createServices>;
