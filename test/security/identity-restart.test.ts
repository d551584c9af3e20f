// Machines' uid ranges across a kill -9 of the server: the next server adopts a live machine with its range, frees
// the range of one that died meanwhile and claims a killed server left behind, and never hands a range out twice.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startServerProcess, createMachine } from "../webhooks/server-process.ts";
import type { ServerProcess } from "../webhooks/server-process.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { containerName } from "../../src/runtime/oci/driver.ts";
import { ID_POOL_LAST, rangeBase } from "../../src/runtime/oci/idmap.ts";

const RANGES = "/var/lib/kiln/id-ranges";

function runtimeCall(dataDir: string, ...args: string[]): string {
  return execFileSync(TEST_RUNTIME, ["--root", join(dataDir, "oci-state", TEST_RUNTIME), ...args], { encoding: "utf8" });
}

/** The machine's host uid base as the kernel has it (its first process's uid_map), and the range it holds. */
function hostRange(dataDir: string, id: string): { base: number; range: number } {
  const pid = JSON.parse(runtimeCall(dataDir, "state", containerName(TEST_RUNTIME, id))).pid as number;
  const base = Number(readFileSync(`/proc/${pid}/uid_map`, "utf8").trim().split(/\s+/)[1]);
  const range = (JSON.parse(readFileSync(join(dataDir, "machines", id, "identity.json"), "utf8")) as { range: number }).range;
  return { base, range };
}

function claimOf(range: number): string | undefined {
  const file = join(RANGES, String(range));
  return existsSync(file) ? (JSON.parse(readFileSync(file, "utf8")) as { machine_dir: string }).machine_dir : undefined;
}

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

test("after a kill -9 the next server keeps a live machine's range, frees a dead one's and stale claims, and hands none out twice", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-ids-restart-"));
  let server: ServerProcess | undefined;
  // A claim a server killed mid-destroy left: its machine dir is gone and no process runs on its ids.
  const free = new Set(await readdir(RANGES).catch(() => [] as string[]));
  let stale = ID_POOL_LAST;
  while (free.has(String(stale))) stale--;
  try {
    server = await startServerProcess(dataDir);
    const live = await createMachine(server);
    const dying = await createMachine(server);
    const before = { live: hostRange(dataDir, live), dying: hostRange(dataDir, dying) };
    assert.equal(before.live.base, rangeBase(before.live.range));
    assert.equal(claimOf(before.live.range), join(dataDir, "machines", live));
    assert.equal(claimOf(before.dying.range), join(dataDir, "machines", dying));
    await writeFile(join(RANGES, String(stale)), JSON.stringify({ machine_dir: join(dataDir, "machines", "mch_gone"), claimed_at: new Date().toISOString(), pid: 1 }), { flag: "wx" });

    server.child.kill("SIGKILL");
    await server.exited;
    // While no server runs, one machine dies.
    runtimeCall(dataDir, "kill", containerName(TEST_RUNTIME, dying), "KILL");
    await until("the machine to die", () => !/"status":\s*"running"/.test(runtimeCall(dataDir, "state", containerName(TEST_RUNTIME, dying))));

    server = await startServerProcess(dataDir);
    await until("the dead machine to be destroyed", async () => (await server!.call("GET", `/v1/machines/${dying}`)).body.status === "destroyed");
    assert.equal((await server.call("GET", `/v1/machines/${live}`)).body.status, "running");
    assert.deepEqual(hostRange(dataDir, live), before.live, "the adopted machine keeps its range");
    assert.equal(claimOf(before.live.range), join(dataDir, "machines", live), "and its claim");
    assert.notEqual(claimOf(before.dying.range), join(dataDir, "machines", dying), "the dead machine's range is free again");
    const exec = await server.call("POST", `/v1/machines/${live}/exec`, { cmd: "id -un; stat -c %U /home/user" });
    assert.equal(exec.body.stdout, "user\nuser\n", "the adopted machine still runs and sees its files");

    const fresh = [await createMachine(server), await createMachine(server), await createMachine(server)];
    const ranges = fresh.map((id) => hostRange(dataDir, id));
    const all = [before.live.range, ...ranges.map((r) => r.range)];
    assert.equal(new Set(all).size, all.length, `no range is handed out twice: ${all.join(", ")}`);
    for (const [i, id] of fresh.entries()) {
      assert.equal(ranges[i].base, rangeBase(ranges[i].range));
      assert.equal(claimOf(ranges[i].range), join(dataDir, "machines", id));
    }
    // The pool is host-wide: a range set free may be claimed at once by another server's machine, never by this one.
    assert.notEqual(claimOf(stale), join(dataDir, "machines", "mch_gone"), "the stale claim was swept at the first claim after the start");

    for (const id of [live, ...fresh]) assert.equal((await server.call("DELETE", `/v1/machines/${id}`)).status, 200);
    // DELETE answers before the machine's remains (its range among them) are removed: released right behind it.
    for (const r of [before.live, ...ranges]) await until("destroy to release the range", () => !claimOf(r.range)?.startsWith(dataDir));
  } finally {
    if (server && server.child.exitCode === null && server.child.signalCode === null) {
      const left = (await server.call("GET", "/v1/machines").catch(() => undefined))?.body?.machines ?? [];
      for (const m of left) await server.call("DELETE", `/v1/machines/${m.id}`).catch(() => undefined);
      await server.stop();
    }
    if (claimOf(stale)?.startsWith(dataDir)) await rm(join(RANGES, String(stale)), { force: true });
    await rm(dataDir, { recursive: true, force: true });
  }
});

test("a machine no record knows that died with the server (a warm one) gives back its dir and its uid range at the next start", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "kiln-ids-leftover-"));
  let server: ServerProcess | undefined;
  let leftover: { id: string; range: number } | undefined;
  try {
    server = await startServerProcess(dataDir, { KILN_WARM_POOL: "1" });
    const machines = join(dataDir, "machines");
    await until("a warm machine to boot", () => {
      const id = existsSync(machines) ? execFileSync("ls", [machines], { encoding: "utf8" }).split("\n").find((n) => n.startsWith("mch_")) : undefined;
      if (!id) return false;
      const state = runtimeCallOr(dataDir, "state", containerName(TEST_RUNTIME, id));
      if (!/"status":\s*"running"/.test(state) || !existsSync(join(machines, id, "identity.json"))) return false;
      leftover = { id, range: hostRange(dataDir, id).range };
      return true;
    }, 120_000);
    const { id, range } = leftover!;
    assert.equal((await server.call("GET", `/v1/machines/${id}`)).status, 404, "a warm machine has no record");
    assert.equal(claimOf(range), join(machines, id));

    server.child.kill("SIGKILL");
    await server.exited;
    // While no server runs, the warm machine dies: nothing is left alive that names it.
    runtimeCall(dataDir, "kill", containerName(TEST_RUNTIME, id), "KILL");
    await until("the warm machine to die", () => !/"status":\s*"running"/.test(runtimeCall(dataDir, "state", containerName(TEST_RUNTIME, id))));

    server = await startServerProcess(dataDir);
    const said = () => server!.output().split("\n").filter((l) => /"level":(40|50)/.test(l)).join("\n");
    assert.equal(existsSync(join(machines, id)), false, `the dead machine's dir is removed before the server serves; the server warned:\n${said()}`);
    // (Another server on this host may have claimed the freed range since: it no longer names this machine.)
    assert.notEqual(claimOf(range), join(machines, id), "its uid range is back in the pool");
    assert.match(runtimeCallOr(dataDir, "state", containerName(TEST_RUNTIME, id)), /^$|does not exist/, "and its container is gone");
  } finally {
    if (server && server.child.exitCode === null && server.child.signalCode === null) await server.stop();
    if (leftover && claimOf(leftover.range)?.startsWith(dataDir)) await rm(join(RANGES, String(leftover.range)), { force: true });
    // Should the server have left the machine (the bug this proves), its container and mounts go here.
    if (leftover) runtimeCallOr(dataDir, "delete", "--force", containerName(TEST_RUNTIME, leftover.id));
    for (const mount of mountsUnder(dataDir)) execFileSync("umount", ["-l", mount]);
    await rm(dataDir, { recursive: true, force: true });
  }
});

/** Mount points under `dir`, deepest first. */
function mountsUnder(dir: string): string[] {
  const points = readFileSync("/proc/self/mountinfo", "utf8").split("\n").map((l) => l.split(" ")[4]).filter((p) => p?.startsWith(dir + "/"));
  return points.sort((a, b) => b.length - a.length);
}

function runtimeCallOr(dataDir: string, ...args: string[]): string {
  try {
    return execFileSync(TEST_RUNTIME, ["--root", join(dataDir, "oci-state", TEST_RUNTIME), ...args], { encoding: "utf8", stdio: "pipe" });
  } catch (err) {
    return String((err as { stderr?: string }).stderr ?? "");
  }
}
