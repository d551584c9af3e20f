// envd tokens' secret lives in the store, so every server of a cluster issues and checks the same tokens; a secret an
// older Kiln kept in its data dir is taken over, so the tokens it issued stay good.

import { test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openStore } from "../../src/store/db.ts";
import { createTokens, loadTokenSecret } from "../../src/compat/e2b/token.ts";

test("the secret is made once and read back by every server of the store", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-token-"));
  const other = await mkdtemp(join(tmpdir(), "kiln-token-other-"));
  const store = await openStore({ dataDir: dir });
  try {
    const first = await loadTokenSecret(store.db, dir);
    assert.equal(first.length, 32);
    // Another server on the same store (its own data dir): the same secret, so the same tokens.
    const second = await loadTokenSecret(store.db, other);
    assert.ok(first.equals(second));
    assert.equal(createTokens(first).tokenOf("mch_x", "key_a"), createTokens(second).tokenOf("mch_x", "key_a"));
  } finally {
    await store.close();
    await rm(dir, { recursive: true, force: true });
    await rm(other, { recursive: true, force: true });
  }
});

test("a secret an older Kiln wrote to the data dir is taken over: its tokens stay good", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-token-legacy-"));
  const legacy = randomBytes(32);
  await writeFile(join(dir, "e2b-envd-secret"), legacy.toString("hex") + "\n", { mode: 0o600 });
  const store = await openStore({ dataDir: dir });
  try {
    const secret = await loadTokenSecret(store.db, dir);
    assert.ok(secret.equals(legacy));
    const issued = createTokens(legacy).tokenOf("mch_y", "key_b");
    assert.equal(createTokens(secret).verify("mch_y", issued), "key_b");
    // The store's copy wins from then on, whatever the file says.
    await writeFile(join(dir, "e2b-envd-secret"), randomBytes(32).toString("hex") + "\n");
    assert.ok((await loadTokenSecret(store.db, dir)).equals(legacy));
  } finally {
    await store.close();
    await rm(dir, { recursive: true, force: true });
  }
});
