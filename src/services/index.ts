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
import { createDeploymentService } from "./deployments.ts";
import type { DeploymentOptions } from "./deployments.ts";

export function createServices(deps: { store: Store; driver: MachineDriver; log: Logger; warmPoolSize: number; deployments: DeploymentOptions }) {
  const { store, driver, log } = deps;
  const pool = createWarmPool({ driver, size: deps.warmPoolSize, log });
  const keys = createKeyService(store.db);
  const templates = createTemplateService(store.db);
  const machines = createMachineService({ db: store.db, driver, templates, log, baseTemplateRef: BASE_TEMPLATE_REF, pool });
  const deployments = createDeploymentService({ db: store.db, machines, templates, log, options: deps.deployments });
  return {
    store,
    driver,
    keys,
    templates,
    pool,
    machines,
    exec: createExecService(machines),
    files: createFileService(machines),
    deployments,
  };
}

export type Services = ReturnType<typeof createServices>;
