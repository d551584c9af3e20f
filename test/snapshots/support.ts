// What the snapshot suites share: one Kiln per file without a warm pool, stopped with every snapshot deleted and
// proof that nothing of its data dir stays mounted or on a loop device; machines made and commands run through it.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";

export function startSnapshotKiln(): Promise<TestKiln> {
  return startTestKiln({ env: { KILN_WARM_POOL: "0" } });
}

export async function stopSnapshotKiln(k: TestKiln | undefined): Promise<void> {
  if (!k) return;
  const dataDir = k.dataDir;
  const snaps = await k.call("GET", "/v1/snapshots?limit=100");
  for (const s of snaps.body?.snapshots ?? []) await k.call("DELETE", `/v1/snapshots/${s.id}`);
  await k.close();
  assert.ok(!readFileSync("/proc/self/mountinfo", "utf8").includes(dataDir), "nothing of the data dir stays mounted");
  assert.ok(!execFileSync("losetup", ["-a"], { encoding: "utf8" }).includes(dataDir), "no loop device on a file of the data dir");
}

export async function createMachine(k: TestKiln, body: Record<string, unknown> = {}) {
  const res = await k.call("POST", "/v1/machines", { body });
  // A failed start says why only in the server's log: carry its errors into the failure.
  const errors = () => k.logs.join("").split("\n").filter((l) => /"level":(50|60)/.test(l)).slice(-3).join("\n");
  assert.equal(res.status, 201, res.status === 201 ? "" : `${res.text}\n${errors()}`);
  return res.body;
}

/** A command's stdout, asserting the exec itself answered. */
export async function stdoutOf(k: TestKiln, id: string, cmd: string): Promise<string> {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd } });
  assert.equal(res.status, 200, res.text);
  return res.body.stdout as string;
}
