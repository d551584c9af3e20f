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
import { createAdmission } from "./admission.ts";
import type { AdmissionLimits } from "./admission.ts";

export function createServices(deps: { store: Store; driver: MachineDriver; log: Logger; warmPoolSize: number; limits: AdmissionLimits }) {
  const { store, driver, log } = deps;
  const pool = createWarmPool({ driver, size: deps.warmPoolSize, log });
  const keys = createKeyService(store.db);
  const templates = createTemplateService(store.db);
  const admission = createAdmission({ db: store.db, limits: deps.limits });
  const machines = createMachineService({ db: store.db, driver, templates, log, baseTemplateRef: BASE_TEMPLATE_REF, pool, admission });
  return {
    store,
    driver,
    keys,
    templates,
    pool,
    admission,
    machines,
    exec: createExecService(machines),
    files: createFileService(machines),
  };
}

export type Services = ReturnType<typeof createServices>;
