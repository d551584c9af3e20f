// Deployment envs at rest: each server seals with its data dir's own key, unless the operator gives every server of a
// store one key file (KILN_DEPLOYMENT_ENVS_KEY_FILE) — then any of them opens what another sealed, and what a server
// sealed before under its own key still opens. A key file that is missing, open to others or not a key is refused,
// naming the variable and the path, never the contents.

import { test } from "node:test";
import assert from "node:assert/strict";
import { chmod, mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import { loadEnvSealer } from "../../src/deployments/sealed-envs.ts";
import { loadConfig } from "../../src/config.ts";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { request } from "undici";
import { startTestKiln } from "../support/kiln.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

test("a shared envs key file: servers open each other's sealed envs, a server still opens what its own key sealed", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-envs-key-"));
  try {
    const [dirA, dirB, dirC] = [join(root, "a"), join(root, "b"), join(root, "c")];
    const shared = join(root, "shared.key");
    await writeFile(shared, randomBytes(32).toString("hex") + "\n", { mode: 0o600 });
    const envs = { GREETING: "hello", TOKEN: "s3cret" };

    // Per data dir (the default): another server cannot open them.
    const aAlone = await loadEnvSealer(dirA);
    const sealedByAOwn = aAlone.seal(envs);
    const bAlone = await loadEnvSealer(dirB);
    assert.throws(() => bAlone.open(sealedByAOwn));

    // Shared: what a seals, b opens (and the other way round); c, without the file, does not.
    const a = await loadEnvSealer(dirA, shared);
    const b = await loadEnvSealer(dirB, shared);
    const sealed = a.seal(envs);
    assert.deepEqual(b.open(sealed), envs);
    assert.deepEqual(a.open(b.seal({ X: "1" })), { X: "1" });
    const c = await loadEnvSealer(dirC);
    assert.throws(() => c.open(sealed));
    // What a sealed under its own key before the file was configured still opens on a; b cannot open it.
    assert.deepEqual(a.open(sealedByAOwn), envs);
    assert.throws(() => b.open(sealedByAOwn));
    assert.ok(!sealed.includes("s3cret"));
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

test("a shared envs key file that is missing, readable by others, not a file or not a key is refused by name", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-envs-key-"));
  try {
    const dir = join(root, "data");
    const missing = join(root, "nope.key");
    await assert.rejects(loadEnvSealer(dir, missing), (err: Error) => err.message.includes("KILN_DEPLOYMENT_ENVS_KEY_FILE") && err.message.includes(missing));
    const open = join(root, "open.key");
    const secret = randomBytes(32).toString("hex");
    await writeFile(open, secret, { mode: 0o600 });
    await chmod(open, 0o644);
    await assert.rejects(loadEnvSealer(dir, open), (err: Error) => /others may read/.test(err.message) && !err.message.includes(secret));
    const notKey = join(root, "bad.key");
    await writeFile(notKey, "not-a-key-at-all", { mode: 0o600 });
    await assert.rejects(loadEnvSealer(dir, notKey), (err: Error) => /64 hex characters/.test(err.message) && !err.message.includes("not-a-key-at-all"));
    const aDir = join(root, "a-dir");
    await mkdir(aDir, { mode: 0o700 });
    await assert.rejects(loadEnvSealer(dir, aDir), /not a regular file/);
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

test("KILN_DEPLOYMENT_ENVS_KEY_FILE is read as an absolute path; unset, each server keeps its own key", () => {
  assert.equal(loadConfig({}).deploymentEnvsKeyFile, undefined);
  assert.equal(loadConfig({ KILN_DEPLOYMENT_ENVS_KEY_FILE: "/etc/kiln/envs.key" }).deploymentEnvsKeyFile, "/etc/kiln/envs.key");
  assert.equal(loadConfig({ KILN_DEPLOYMENT_ENVS_KEY_FILE: "rel/envs.key" }).deploymentEnvsKeyFile, join(process.cwd(), "rel/envs.key"));
});

test("the shared envs key itself is never written: not in the data dir, the store or the logs, while deployments with envs run", async () => {
  const root = await mkdtemp(join(tmpdir(), "kiln-envs-key-"));
  const keyFile = join(root, "envs.key");
  const key = randomBytes(32);
  const hex = key.toString("hex");
  await writeFile(keyFile, hex + "\n", { mode: 0o600 });
  const k = await startTestKiln({ env: { KILN_DEPLOYMENT_ENVS_KEY_FILE: keyFile } });
  try {
    const marker = `envs-key-${Date.now()}-${Math.random().toString(36).slice(2)}`;
    const dep = await createDeployment(k, { name: "sealed-by-file", command: appCommand(8087), port: 8087, envs: { KEY_MARKER: marker }, readiness: { interval_s: 0.2, timeout_s: 1, path: "/health" } });
    const [svc] = await services(k, dep.id);
    const ready = await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    // The envs reached the process: the server opened what it sealed with the file's key.
    assert.equal(await (await request(ready.public_url.replace("/?", "/env/KEY_MARKER?"))).body.text(), marker);
    // A restart takes request-only envs beside them; a new version carries them over, sealed again.
    const restarted = await k.call("POST", `/v1/agent-deployments/${dep.id}/services/${svc.id}/restart`, { body: { reason: "key check", envs: { RESTART_MARKER: marker } } });
    assert.ok(restarted.status < 300, restarted.text);
    await waitService(k, dep.id, svc.id, (s) => s.status === "ready");
    const updated = await k.call("PATCH", `/v1/agent-deployments/${dep.id}`, { body: { readiness: { interval_s: 0.2, timeout_s: 2, path: "/health" } } });
    assert.equal(updated.status, 200, updated.text);

    // Sealed with the file's key: another data dir given the same file opens what the store holds.
    const rows = await k.kiln.services.store.db.selectFrom("deployment_versions").select("envs_sealed").execute();
    assert.equal(rows.length, 2, "both versions are stored");
    const other = await loadEnvSealer(join(root, "other-data"), keyFile);
    for (const r of rows) assert.equal(other.open(r.envs_sealed).KEY_MARKER, marker);

    // The key, in any of the forms it could be written in, is nowhere Kiln writes.
    const forms = [hex, key.toString("base64"), key.toString("base64url")];
    for (const file of filesUnder(k.dataDir)) {
      const bytes = readFileSync(file);
      assert.ok(!bytes.includes(key), `${file} holds the envs key's bytes`);
      for (const form of forms) assert.ok(!bytes.includes(form), `${file} holds the envs key`);
    }
    const logs = k.logs.join("");
    assert.ok(logs.length > 0, "the server logged");
    for (const form of forms) assert.ok(!logs.includes(form), "the server's log holds the envs key");
    await k.call("DELETE", `/v1/agent-deployments/${dep.id}`);
  } finally {
    await k.close();
    await rm(root, { recursive: true, force: true });
  }
});

/** Every regular file under a data dir but machines' filesystems, the template cache and disk images (as services.test.ts greps). */
function filesUnder(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    let st;
    try {
      st = statSync(p);
    } catch {
      continue;
    }
    if (st.isDirectory()) {
      if (name === "machines" || name === "cache" || name === "disks") continue;
      out.push(...filesUnder(p));
    } else if (st.isFile() && !["disk.img", "image.ext4", "disks.xfs"].includes(name)) out.push(p);
  }
  return out;
}
