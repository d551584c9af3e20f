// The store on both dialects, one suite: migrations, every table, constraints, transactions, cursor pagination.

import { describe, test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { sql } from "kysely";
import { openStore } from "../../src/store/db.ts";
import type { Store } from "../../src/store/db.ts";
import { appliedMigrations } from "../../src/store/migrations.ts";
import { newId } from "../../src/store/ids.ts";
import { decodeCursor, encodeCursor, InvalidCursorError } from "../../src/store/cursor.ts";
import { createKeyService } from "../../src/keys/service.ts";
import { createTemplateService } from "../../src/templates/service.ts";
import { startPostgres } from "../support/postgres.ts";

const now = () => new Date().toISOString();

function machineRow(id = newId("mch")) {
  return {
    id,
    template_id: "tpl_x",
    artifact_id: "art_x",
    name: null,
    status: "running",
    cwd: null,
    user: "user",
    metadata_json: "{}",
    vcpus: 1,
    memory_mb: 512,
    internet: 1,
    timeout_s: 300,
    expires_at: now(),
    created_at: now(),
    updated_at: now(),
    destroyed_at: null,
    failure_reason: null,
  };
}

for (const dialect of ["sqlite", "postgres"] as const) {
  describe(`store on ${dialect}`, () => {
    let store: Store;
    let reopen: () => Promise<Store>;
    let cleanup: () => Promise<void>;

    before(async () => {
      if (dialect === "sqlite") {
        const dir = mkdtempSync(join(tmpdir(), "kiln-store-"));
        reopen = () => openStore({ dataDir: dir });
        cleanup = async () => rmSync(dir, { recursive: true, force: true });
      } else {
        const pg = await startPostgres();
        reopen = () => openStore({ dataDir: "/nonexistent", databaseUrl: pg.url });
        cleanup = pg.stop;
      }
      store = await reopen();
    });
    after(async () => {
      await store?.close();
      await cleanup?.();
    });

    test("migrations apply, and reopening is a no-op", async () => {
      assert.equal(store.dialect, dialect);
      const first = await appliedMigrations(store.db);
      const again = await reopen();
      assert.deepEqual(await appliedMigrations(again.db), first);
      await again.close();
      await store.ping();
    });

    test("api keys: insert, hash unique, verify and revoke through the key service", async () => {
      const keys = createKeyService(store.db);
      const made = await keys.create("t");
      assert.equal(await keys.verify(made.key), made.id);
      assert.equal(await keys.verify(made.key + "x"), null);
      await assert.rejects(
        store.db.insertInto("api_keys").values({ id: newId("key"), name: "dup", prefix: "p", hash: (await store.db.selectFrom("api_keys").select("hash").where("id", "=", made.id).executeTakeFirstOrThrow()).hash, created_at: now(), last_used_at: null, revoked_at: null }).execute(),
      );
      await keys.revoke(made.id);
      assert.equal(await keys.verify(made.key), null);
    });

    test("templates, aliases, artifacts and tags: canonical_ref unique, resolve by ref, tag and artifact id", async () => {
      const templates = createTemplateService(store.db);
      const base = await templates.registerBase("/layers/one", "sha256:1");
      assert.equal(base.template.canonical_ref, "local/base");
      assert.deepEqual(base.layers, ["/layers/one"]);
      assert.equal((await templates.registerBase("/layers/one", "sha256:1")).artifact.id, base.artifact.id, "same layer: same artifact");
      const moved = await templates.registerBase("/layers/two", "sha256:2");
      assert.notEqual(moved.artifact.id, base.artifact.id, "a new base moves the default tag");
      assert.equal((await templates.resolve("base")).artifact.id, moved.artifact.id);
      assert.equal((await templates.resolve("local/base:default")).artifact.id, moved.artifact.id);
      assert.equal((await templates.resolve(base.artifact.id)).artifact.id, base.artifact.id);
      await store.db.insertInto("template_aliases").values({ alias_ref: "local/py", template_id: base.template.id, created_at: now() }).execute();
      assert.equal((await templates.resolve("py")).template.id, base.template.id);
      await assert.rejects(store.db.insertInto("templates").values({ id: newId("tpl"), namespace: "local", name: "base", canonical_ref: "local/base", created_at: now(), updated_at: now() }).execute());
      await assert.rejects(templates.resolve("local/none"), /No template/);
    });

    test("machines and events: events.seq increases; a transaction that throws writes nothing", async () => {
      const id = newId("mch");
      await store.db.insertInto("machines").values(machineRow(id)).execute();
      for (const op of ["create", "hibernate"]) {
        await store.db.insertInto("events").values({ id: newId("evt"), operation: op, machine_id: id, payload_json: "{}", occurred_at: now() }).execute();
      }
      const seqs = (await store.db.selectFrom("events").select("seq").where("machine_id", "=", id).orderBy("seq").execute()).map((r) => r.seq);
      assert.equal(seqs.length, 2);
      assert.equal(typeof seqs[0], "number");
      assert.ok(seqs[1] > seqs[0]);
      await assert.rejects(
        store.db.transaction().execute(async (tx) => {
          await tx.updateTable("machines").set({ status: "destroyed" }).where("id", "=", id).execute();
          await tx.insertInto("events").values({ id: newId("evt"), operation: "destroy", machine_id: id, payload_json: "{}", occurred_at: now() }).execute();
          throw new Error("boom");
        }),
        /boom/,
      );
      assert.equal((await store.db.selectFrom("machines").select("status").where("id", "=", id).executeTakeFirstOrThrow()).status, "running");
      assert.equal((await store.db.selectFrom("events").select("id").where("machine_id", "=", id).execute()).length, 2);
    });

    test("cursor pagination by id is stable when rows are inserted between pages", async () => {
      await store.db.deleteFrom("machines").execute();
      const ids: string[] = [];
      for (let i = 0; i < 5; i++) {
        ids.push(newId("mch"));
        await store.db.insertInto("machines").values(machineRow(ids[i])).execute();
      }
      const page = async (after?: string) => {
        let q = store.db.selectFrom("machines").select("id").orderBy("id", "desc").limit(3);
        if (after) q = q.where("id", "<", after);
        return (await q.execute()).map((r) => r.id);
      };
      const p1 = await page();
      assert.deepEqual(p1, [ids[4], ids[3], ids[2]]);
      await store.db.insertInto("machines").values(machineRow()).execute();
      const p2 = await page(decodeCursor(encodeCursor([p1[2]]), 1)[0]);
      assert.deepEqual(p2, [ids[1], ids[0]]);
    });

    if (dialect === "sqlite") {
      test("the SQLite file is in WAL mode", async () => {
        const r = await sql<{ journal_mode: string }>`pragma journal_mode`.execute(store.db);
        assert.equal(r.rows[0].journal_mode, "wal");
      });
    }
  });
}

test("an unsupported database URL is refused with a clear message", async () => {
  await assert.rejects(openStore({ dataDir: "/tmp", databaseUrl: "mysql://u:hunter2@h/db" }), (err: Error) => /mysql/.test(err.message) && !err.message.includes("hunter2"));
});

test("ids are unique, prefixed and sortable by creation", () => {
  const ids = Array.from({ length: 2000 }, () => newId("evt"));
  assert.equal(new Set(ids).size, ids.length);
  assert.deepEqual([...ids].sort(), ids);
  assert.match(ids[0], /^evt_[0-9a-z]{26}$/);
});

test("garbage cursors are refused", () => {
  for (const bad of ["garbage", "", encodeCursor(["x"]), encodeCursor([""]), Buffer.from('{"v":1,"after":"mch_00000000000000000000000000"}').toString("base64url")]) {
    assert.throws(() => decodeCursor(bad, 2), InvalidCursorError);
  }
  assert.deepEqual(decodeCursor(encodeCursor(["2026-01-01T00:00:00.000Z", "mch_x"]), 2), ["2026-01-01T00:00:00.000Z", "mch_x"]);
});
