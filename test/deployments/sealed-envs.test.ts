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
