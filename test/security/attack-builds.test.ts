// A template author against the native (step) builder, and a template's history against its deletion: a `run` step
// that never ends is stopped at KILN_BUILD_STEP_TIMEOUT_S, a build of many slow steps at KILN_BUILD_TIMEOUT_S (as
// Dockerfile builds are), leaving no build machine; and a template with more builds than the store takes bound
// variables in one statement is deleted whole.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { join } from "node:path";
import { DatabaseSync } from "node:sqlite";
import { startTestKiln } from "../support/kiln.ts";
import { TEST_RUNTIME } from "../support/paths.ts";
import { build } from "../builds/support.ts";

/** Containers the server's runtime still has (build machines included). */
function containers(dataDir: string): string[] {
  const out = execFileSync(TEST_RUNTIME, ["--root", join(dataDir, "oci-state", TEST_RUNTIME), "list", "--quiet"], { encoding: "utf8" });
  return out.split("\n").filter(Boolean);
}

test("a native build step that never ends is stopped at the step timeout, a slow build at the build timeout; no build machine is left", { timeout: 240_000 }, async () => {
  const k = await startTestKiln({ env: { KILN_WARM_POOL: "0", KILN_BUILD_STEP_TIMEOUT_S: "6", KILN_BUILD_TIMEOUT_S: "25" } });
  try {
    const started = Date.now();
    const step = await build(k, { name: "native-step-timeout", steps: [{ type: "run", command: "sleep 600" }], skip_cache: true });
    const last = step.events.at(-1)!;
    assert.equal(last.event, "error", JSON.stringify(last));
    assert.match(last.data.message, /ran longer than 6 s and was stopped/);
    assert.ok(Date.now() - started < 90_000, `the build ended at its step timeout (${Date.now() - started} ms), not after the hour`);
    assert.deepEqual(containers(k.dataDir), [], "the build machine was destroyed");

    // Each step under the step timeout, together over the build's. (The build timeout leaves a loaded host room to
    // boot the first build machine before its step timeout.)
    const steps = ["a", "b", "c", "d", "e", "f", "g", "h"].map((s) => ({ type: "run", command: `sleep 4; echo ${s}` }));
    const whole = await build(k, { name: "native-build-timeout", steps, skip_cache: true });
    assert.equal(whole.events.at(-1)!.event, "error");
    assert.match(whole.events.at(-1)!.data.message, /the build ran longer than 25 s and was stopped/);
    assert.deepEqual(containers(k.dataDir), [], "the build machine was destroyed");
    const { build_id, template_id } = whole.events[0].data;
    const record = (await k.call("GET", `/v1/templates/${template_id}/builds/${build_id}`)).body;
    assert.equal(record.status, "error", JSON.stringify(record));
  } finally {
    await k.close();
  }
});

test("a template with more builds than one SQL statement may bind is deleted with all its builds and logs", { timeout: 240_000 }, async () => {
  let k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
  const dataDir = k.dataDir;
  try {
    const first = await build(k, { name: "long-history", steps: [{ type: "write_file", path: "/srv/x", content: "x" }] });
    assert.equal(first.events.at(-1)!.event, "end", JSON.stringify(first.events.at(-1)));
    const templateId = first.events[0].data.template_id as string;
    await k.stop();

    // A year of CI: 40,000 builds of this template (SQLite binds at most 32,766 variables in one statement).
    const db = new DatabaseSync(join(dataDir, "kiln.db"));
    const model = db.prepare("SELECT * FROM builds WHERE template_id = ? LIMIT 1").get(templateId) as Record<string, unknown>;
    const columns = Object.keys(model);
    const insert = db.prepare(`INSERT INTO builds (${columns.join(", ")}) VALUES (${columns.map(() => "?").join(", ")})`);
    const log = db.prepare("INSERT INTO build_logs (build_id, seq, kind, entry_json) VALUES (?, 1, 'message', '{}')");
    db.exec("BEGIN");
    for (let i = 0; i < 40_000; i++) {
      const id = `bld_history${String(i).padStart(15, "0")}`;
      insert.run(...(columns.map((c) => (c === "id" ? id : model[c])) as never[]));
      log.run(id);
    }
    db.exec("COMMIT");
    db.close();

    k = await startTestKiln({ dataDir, env: { KILN_WARM_POOL: "0" } });
    const gone = await k.call("DELETE", `/v1/templates/${templateId}`);
    assert.equal(gone.status, 200, gone.text);
    const check = new DatabaseSync(join(dataDir, "kiln.db"), { readOnly: true });
    try {
      assert.equal(check.prepare("SELECT count(*) AS n FROM builds WHERE template_id = ?").get(templateId)!.n, 0);
      assert.equal(check.prepare("SELECT count(*) AS n FROM build_logs WHERE build_id LIKE 'bld_history%'").get()!.n, 0);
    } finally {
      check.close();
    }
    assert.equal((await k.call("GET", "/health")).status, 200);
  } finally {
    await k.close();
  }
});
