// Machine create: input checks, admission, a warm machine of the same shape or a fresh boot (or a gVisor restore of
// the template's start checkpoint), volumes, the user, envs and start command, and cleanup when any of it fails.

import { metricEvents } from "../metrics/events.ts";
import type { MachineRow } from "../store/schema.ts";
import { newId } from "../store/ids.ts";
import { KilnError } from "../errors.ts";
import type { EgressRules } from "../runtime/driver.ts";
import { parseCidr } from "../runtime/cidr.ts";
import { refusedRangeMet } from "../net/addresses.ts";
import { AgentError } from "../runtime/agent-client.ts";
import type { TemplateService } from "../templates/service.ts";
import type { VolumeMountRequest, VolumeService } from "../volumes/service.ts";
import { runStartCommand } from "../builder/start-command.ts";
import type { Admission } from "./admission.ts";
import type { WarmPool } from "./warm-pool.ts";
import type { HotPools } from "./hot-pools.ts";
import { DEFAULT_WORKDIR } from "./paths.ts";
import { templateConfig } from "../templates/code-interpreter.ts";
import type { BootQueue } from "./boot-queue.ts";
import { checkEnvs, checkMetadata } from "./input-limits.ts";
import { MACHINE_DEFAULTS, machineView } from "./records.ts";
import type { MachineView, OnTimeout } from "./records.ts";
import type { MachineContext } from "./context.ts";

export interface CreateMachineInput {
  template?: string;
  name?: string;
  cwd?: string;
  user?: string;
  envs?: Record<string, string>;
  metadata?: Record<string, string>;
  timeout_s?: number;
  vcpus?: number;
  memory_mb?: number;
  disk_mb?: number;
  internet?: boolean;
  /** Volumes mounted at boot (room: volumes). */
  volumes?: VolumeMountRequest[];
  network?: { allow_out?: string[]; deny_out?: string[] };
  on_timeout?: OnTimeout;
  auto_resume?: boolean;
}

/**
 * A snapshot a machine is made from (room: snapshots resolves and checks it): the machine's disk is a copy of the
 * snapshot's, and with `memory` its processes continue from the snapshot instead of the template's start command.
 */
export interface SnapshotOrigin {
  id: string;
  artifactId: string;
  disk: string;
  memory: string | null;
  diskMb: number;
  /** A memory snapshot restores its saved network stack: the machine takes the snapshot's network setting. */
  internet: boolean;
}

/** Validated CIDR lists in canonical form; 400 naming the first bad entry. */
export function egressRules(network: CreateMachineInput["network"]): EgressRules | undefined {
  if (!network) return undefined;
  const canonical = (field: "allow_out" | "deny_out") =>
    (network[field] ?? []).map((text, i) => {
      const parsed = parseCidr(text);
      if ("error" in parsed) throw new KilnError("invalid_request", `network.${field}[${i}]: ${parsed.error}`);
      return parsed.cidr;
    });
  return { allowOut: canonical("allow_out"), denyOut: canonical("deny_out") };
}

/**
 * Opening what the default refuses (the host's other addresses, private networks, cloud metadata) is the operator's
 * call, as webhook `allow_private` is: any other key asking `allow_out` to reach into such a range is 403.
 */
export function checkOpenings(network: CreateMachineInput["network"], operator: boolean): void {
  if (operator || !network?.allow_out?.length) return;
  for (const [i, text] of network.allow_out.entries()) {
    const parsed = parseCidr(text);
    if ("error" in parsed) continue; // egressRules answers 400 for it
    if (refusedRangeMet(parsed.cidr, parsed.family)) throw new KilnError("forbidden", `network.allow_out[${i}] (${parsed.cidr}) opens a range machines may not reach by default (the host, private, link-local or metadata addresses): only the operator's key may open it`);
  }
}

export interface CreateDeps {
  templates: TemplateService;
  baseTemplateRef: string;
  pool?: WarmPool;
  /** Pools of the templates other than the base that are created often (hot-pools.ts). */
  hotPools?: HotPools;
  volumes?: VolumeService;
  admission?: Admission;
  /** Cold boots a few at a time, creates in arrival order (boot-queue.ts); without it every boot starts at once. */
  boots?: BootQueue;
}

export function createMachineCreator(ctx: MachineContext, deps: CreateDeps): (input: CreateMachineInput, from?: SnapshotOrigin) => Promise<MachineView> {
  const { db, driver, log, hostId, records, agents, locks } = ctx;
  const { templates } = deps;
  async function create(input: CreateMachineInput, from?: SnapshotOrigin): Promise<MachineView> {
    // Each step's end, in ms from the request's arrival here: `machine created` (debug) logs them, so a slow create
    // (a burst above all) says where its time went: admission, the lock, the boot queue, the boot, set-up, record.
    const t0 = performance.now();
    const phases: Record<string, number> = {};
    const phase = (name: string) => (phases[name] = Math.round((performance.now() - t0) * 10) / 10);
    checkEnvs(input.envs);
    checkMetadata(input.metadata);
    if (from) {
      if (input.disk_mb !== undefined && input.disk_mb !== from.diskMb) throw new KilnError("invalid_request", `disk_mb must be the snapshot's (${from.diskMb}): its disk is copied as it is`);
      if (from.memory && input.internet !== undefined && input.internet !== from.internet) {
        throw new KilnError("invalid_request", `internet must be the snapshot's (${from.internet}): a memory snapshot restores its saved network stack`);
      }
      input = { ...input, disk_mb: from.diskMb, internet: from.memory ? from.internet : input.internet };
    }
    const resolved = await templates.resolve(from ? from.artifactId : (input.template ?? deps.baseTemplateRef), { local: true });
    // A built template's image config gives the defaults: its envs, working directory and user.
    const image = templateConfig(resolved);
    const now = new Date();
    const timeoutS = input.timeout_s ?? MACHINE_DEFAULTS.timeoutS;
    const vcpus = input.vcpus ?? MACHINE_DEFAULTS.vcpus;
    const memoryMb = input.memory_mb ?? MACHINE_DEFAULTS.memoryMb;
    const diskMb = input.disk_mb ?? MACHINE_DEFAULTS.diskMb;
    const network = egressRules(input.network);
    const hasRules = Boolean(network && (network.allowOut.length || network.denyOut.length));
    await deps.admission?.admit({ vcpus, memoryMb, diskMb });
    phase("admitted_ms");
    // A machine already booted (any size where the driver resizes live ones) answers at once; its id is the one it was booted with.
    // One with volumes boots fresh: warm machines have no mounts (room: volumes).
    // gVisor: continue the build machine saved once start_cmd was ready, where this machine can take it (same
    // network setting, same guest runtime, image still on disk); otherwise start_cmd starts here and create waits for
    // its readiness.
    const saved = from ? undefined : image.checkpoint;
    const restore = saved && saved.internet === (input.internet !== false) && driver.canRestore?.(saved) ? saved : undefined;
    // From a disk snapshot too, where the driver can give a running machine the snapshot's disk (runc): the base
    // template's warm machine takes a copy of it at handout instead of a cold boot from it.
    const poolable = !restore && !input.volumes?.length && (!from || (!from.memory && driver.takeSnapshotDisk !== undefined));
    const want = { artifactId: resolved.artifact.id, vcpus, memoryMb, diskMb, internet: input.internet !== false, network: hasRules };
    // A template other than the base counts toward its own pool's demand (its config says whether its pooled
    // machines have the default kernel started).
    if (poolable && !from && deps.hotPools && resolved.template.canonical_ref !== deps.baseTemplateRef) {
      deps.hotPools.note({ artifactId: resolved.artifact.id, ref: resolved.template.canonical_ref, layers: resolved.layers, vcpus: MACHINE_DEFAULTS.vcpus, memoryMb: MACHINE_DEFAULTS.memoryMb, config: image });
    }
    // Hot machines may hold files of their root open (a started kernel): a snapshot's disk goes to a plain warm one.
    const hot = poolable && !from ? deps.hotPools?.take(want) : undefined;
    // A machine from a snapshot often comes with others (a fork's children): the pool refills once they are handed out.
    const resumeRefills = poolable && from ? deps.pool?.pause() : undefined;
    const warm = hot?.live ?? (poolable ? deps.pool?.take(want) : undefined);
    if (poolable) metricEvents.warmPoolTake({ hit: warm !== undefined });
    const row = {
      id: warm?.id ?? newId("mch"),
      template_id: resolved.template.id,
      artifact_id: resolved.artifact.id,
      name: input.name ?? null,
      status: "creating",
      cwd: input.cwd ?? image.image.workingDir ?? null,
      user: input.user ?? image.image.user ?? MACHINE_DEFAULTS.user,
      metadata_json: JSON.stringify(input.metadata ?? {}),
      vcpus,
      memory_mb: memoryMb,
      disk_mb: diskMb,
      internet: input.internet === false ? 0 : 1,
      network_json: hasRules ? JSON.stringify(network) : null,
      timeout_s: timeoutS,
      expires_at: new Date(now.getTime() + timeoutS * 1000).toISOString(),
      created_at: now.toISOString(),
      updated_at: now.toISOString(),
      destroyed_at: null,
      failure_reason: null,
      host_id: hostId,
      on_timeout: input.on_timeout ?? "destroy",
      auto_resume: input.auto_resume ? 1 : 0,
      snapshot_id: from?.id ?? null,
    };
    // Volumes (room: volumes): checked and recorded before the row, so a racing volume delete already sees this machine.
    const mounts = input.volumes?.length && deps.volumes ? await deps.volumes.attach(row.id, input.volumes) : [];
    await db
      .insertInto("machines")
      .values(row)
      .execute()
      .catch((err: unknown) => {
        resumeRefills?.();
        throw err;
      });
    phase("inserted_ms");
    return locks.run(row.id, async () => {
      phase("locked_ms");
      try {
        // A machine that waited in the pool may have lost a host-side part meanwhile (its network helper).
        if (warm) {
          const health = await driver.heal(warm.id);
          if (!health.ok) throw new Error(health.reason);
          // Booted in the pool's size: given this create's (its cgroup caps) before anything runs in it for the caller.
          await driver.resize?.(warm.id, { vcpus: row.vcpus, memoryMb: row.memory_mb });
        }
        // The snapshot's disk swapped in under the warm machine's running processes; where that fails, the warm
        // machine goes and one boots from the snapshot as without a warm machine (same id: nobody has seen it yet).
        let taken = warm;
        if (warm && from) {
          try {
            await driver.takeSnapshotDisk!(warm.id, from.disk);
          } catch (err) {
            log.warn({ err, machine_id: warm.id, snapshot_id: from.id }, "a warm machine could not take the snapshot's disk: booting from it instead");
            await agents.detach(warm.id);
            await driver.destroy(warm.id);
            taken = undefined;
          }
        }
        const boot = (run: () => ReturnType<typeof driver.create>) =>
          deps.boots
            ? deps.boots.run("create", () => {
                phase("boot_slot_ms");
                return run();
              })
            : run();
        const live =
          taken ??
          (await boot(() => driver.create({
          id: row.id,
          layers: resolved.layers,
          hostname: row.id.replaceAll("_", "-"),
          vcpus: row.vcpus,
          memoryMb: row.memory_mb,
          diskMb,
          internet: row.internet === 1,
          network: hasRules ? network : undefined,
          mounts,
          restore,
          fromSnapshot: from ? { disk: from.disk, memory: from.memory } : undefined,
        })));
        phase("booted_ms");
        const agent = agents.attach(live);
        // The user must exist in the machine's own /etc/passwd; envs live in the agent, never in a record.
        const userChecked = agent.user(row.user).catch((err: unknown) => {
          throw err instanceof AgentError && err.code === "not_found" ? new KilnError("invalid_request", `No user ${JSON.stringify(row.user)} in template ${resolved.template.canonical_ref}`) : err;
        });
        // The start command sees the template's envs only; create-time envs apply to what runs after it.
        // A memory snapshot's processes already run (and its agent still holds the envs it was given): the start command
        // is not run again, and the envs are set anew so the parent's create-time envs never reach new processes here.
        // Without a start command the envs are set once, while the user is looked up (each agent call is a round trip
        // every fork child and snapshot restore waits for).
        const continued = Boolean(restore || from?.memory);
        const starts = !continued && Boolean(image.startCmd);
        const createEnvs = input.envs && Object.keys(input.envs).length > 0 ? input.envs : undefined;
        const firstEnvs = starts || !createEnvs ? image.image.env : { ...image.image.env, ...createEnvs };
        const envsSet = Object.keys(firstEnvs).length > 0 || from?.memory ? agent.setEnvs(firstEnvs) : undefined;
        envsSet?.catch(() => undefined);
        // A pooled kernel, started before this create: kept for the create's user and cwd, with its envs set in it —
        // asked alongside the calls above (it sets its own envs; a user that does not exist fails both).
        const adopt = () => agent.codeAdopt({ user: row.user, cwd: row.cwd ?? DEFAULT_WORKDIR, envs: input.envs ?? {} });
        const adopted = hot?.kernel && !starts ? adopt() : undefined;
        adopted?.catch(() => undefined);
        // The machine's cwd is where its commands start: made, owned by the machine's user, alongside the calls above
        // where nothing runs first (a start command may make or own it itself). A user that does not exist fails
        // this too; the user's own error is the one reported.
        const cwdMade = row.cwd && !starts ? agent.mkdir(row.cwd, { user: row.user }) : undefined;
        cwdMade?.catch(() => undefined);
        await userChecked;
        await envsSet;
        if (starts) {
          await runStartCommand(agent, image, row.user);
          if (createEnvs) await agent.setEnvs({ ...image.image.env, ...createEnvs });
        }
        if (hot?.kernel) await (adopted ?? adopt());
        if (row.cwd) await (cwdMade ?? agent.mkdir(row.cwd, { user: row.user }));
        // A machine restored from another's memory is handed out only once it has its own hostname (its rename
        // overlapped the calls above).
        await live.renamed;
        phase("set_up_ms");
        const view = machineView(await records.transition(row.id, { status: "running" }, "create"));
        phase("recorded_ms");
        log.debug({ machine_id: row.id, warm: taken !== undefined, ...phases }, "machine created");
        return view;
      } catch (err) {
        await agents.detach(row.id);
        await driver.destroy(row.id).catch((e: unknown) => log.error({ err: e, machine_id: row.id }, "cleanup after a failed create failed"));
        const reason = err instanceof KilnError ? err.message : "the machine failed to start";
        await records.transition(row.id, { status: "failed", failure_reason: reason, destroyed_at: new Date().toISOString() }, null);
        if (err instanceof KilnError) throw err;
        log.error({ err, machine_id: row.id }, "machine create failed");
        throw new KilnError("internal", "The machine failed to start", { cause: err });
      } finally {
        resumeRefills?.();
      }
    });
  }

  return create;
}
