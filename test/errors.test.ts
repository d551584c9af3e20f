// The error catalogue, pinned (as Fastify's test/internals/errors.test.js pins its own): every code with its status
// as DESIGN.md §3 and SPEC.md say, where each is raised, the envelope toEnvelope() makes, and where a plain Error may
// still be thrown (a seam that maps it once).

import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";
import { ERROR_CATALOGUE, KilnError, toEnvelope } from "../src/errors.ts";

const SRC = join(import.meta.dirname, "..", "src");

/** DESIGN.md §3 "Status ↔ code", and SPEC.md's build_error (the terminal entry of a failed build). */
const PINNED: Record<string, number> = {
  invalid_request: 400,
  unauthorized: 401,
  forbidden: 403,
  not_found: 404,
  method_not_allowed: 405,
  conflict: 409,
  machine_not_running: 409,
  payload_too_large: 413,
  unsupported_media_type: 415,
  git_error: 422,
  build_rejected: 422,
  build_error: 422,
  rate_limited: 429,
  internal: 500,
  unavailable: 503,
  timeout: 504,
};

/** Codes the catalogue keeps for DESIGN.md §3 that no Kiln code raises yet. */
const RESERVED = new Set<string>([]);

/**
 * Files that may throw a plain Error, and the one place each is mapped: a failure of the host (driver, store,
 * sandbox) becomes a 500 `internal` without its text in toEnvelope() (a failed machine create records "the machine
 * failed to start"); a refusal to start stops the process before anything is served; the rest are caught where
 * they are thrown. A new file here needs a reason, not a plain Error.
 */
const PLAIN_ERROR_SEAMS: Record<string, string> = {
  "api/auth.ts": "refuses to start a server whose route declares no auth",
  "builder/backends/isolation/runtime-shim.ts": "the builder's sandbox: a BuildFailure at the backend seam",
  "builder/backends/isolation/sandbox.ts": "the builder's sandbox: a BuildFailure at the backend seam",
  "builder/log.ts": "a programming error (appending to a closed log): internal",
  "builder/oci/confined-root.ts": "the confined unpack: mapped to build_rejected by the importer",
  "builder/sources/dockerfile.ts": "a programming error (a non-Dockerfile build at buildkit): internal",
  "compat/e2b/connect.ts": "caught where thrown (a malformed Connect frame)",
  "compat/e2b/control.ts": "caught where thrown (a malformed nextToken)",
  "compat/e2b/snapshots.ts": "caught where thrown (a malformed nextToken)",
  "console/bundle.ts": "the console's build step: refuses a broken bundle, before any request",
  "deployments/key-files.ts": "refuses to start with a damaged key file",
  "deployments/sealed-envs.ts": "damaged sealed envs: the replica fails with its reason",
  "hosts/layers/service.ts": "caught where thrown (a peer that answers other than 200: the next holder is tried, every reason goes in the 503)",
  "machines/create.ts": "caught in create: the machine fails with 'the machine failed to start'",
  "machines/hot-pools.ts": "a pooled machine whose kernel did not start: the warm pool's boot handler logs it and destroys the machine",
  "runtime/guest-runtime.ts": "the MachineDriver seam: internal",
  "runtime/host-commands-child.ts": "the host command helper: answered to the driver as a failed command",
  "runtime/oci/build-steps.ts": "the MachineDriver seam: internal",
  "runtime/oci/cgroups.ts": "the MachineDriver seam: internal",
  "runtime/oci/disk-pool.ts": "the MachineDriver seam: internal",
  "runtime/oci/disk.ts": "the MachineDriver seam: internal",
  "runtime/oci/driver.ts": "the MachineDriver seam: internal",
  "runtime/oci/egress.ts": "the MachineDriver seam: internal",
  "runtime/oci/id-ranges.ts": "the MachineDriver seam: internal",
  "runtime/oci/identity.ts": "the MachineDriver seam: internal",
  "runtime/oci/idmap.ts": "the MachineDriver seam: internal",
  "runtime/oci/network.ts": "the MachineDriver seam: internal",
  "runtime/oci/snapshot.ts": "the MachineDriver seam: internal",
  "runtime/oci/runtime-cli.ts": "the MachineDriver seam: internal",
  "store/db.ts": "refuses to start on a store it cannot open",
  "store/migrations.ts": "refuses to start on a failed migration",
  "volumes/storage.ts": "the volume storage seam (host mounts): internal",
};

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) => (e.isDirectory() ? sources(join(dir, e.name)) : e.name.endsWith(".ts") ? [join(dir, e.name)] : []));
}

const files = sources(SRC).map((f) => ({ path: relative(SRC, f), text: readFileSync(f, "utf8") }));

test("every code has the status DESIGN.md §3 and SPEC.md give it, and the catalogue has no other code", () => {
  const statuses = Object.fromEntries(Object.entries(ERROR_CATALOGUE).map(([code, e]) => [code, e.status]));
  assert.deepEqual(statuses, PINNED);
  for (const [code, e] of Object.entries(ERROR_CATALOGUE)) assert.ok(e.message.length > 0, `${code} has a default message`);
});

test("every code is raised somewhere in Kiln, except the ones reserved for later", () => {
  const raisers = (code: string) =>
    files.filter((f) => f.path !== "errors.ts" && (f.text.includes(`KilnError("${code}"`) || f.text.includes(`super("${code}"`))).map((f) => f.path);
  const fastifyMapped = readFileSync(join(SRC, "errors.ts"), "utf8");
  for (const code of Object.keys(PINNED)) {
    const where = raisers(code);
    const mapped = new RegExp(`FST_ERR_\\w+: "${code}"`).test(fastifyMapped);
    if (RESERVED.has(code)) assert.equal(where.length, 0, `${code} is raised (${where.join(", ")}): take it out of RESERVED`);
    else assert.ok(where.length > 0 || mapped, `${code} is raised nowhere`);
  }
});

test("a KilnError becomes its envelope with the request id; its detail keeps the request id too", () => {
  const err = new KilnError("machine_not_running", "Machine mch_1 is hibernated", { detail: { code: "machine_not_running", retryable: true } });
  const { status, body } = toEnvelope(err, "req_1");
  assert.equal(status, 409);
  assert.deepEqual(body, { error: "Machine mch_1 is hibernated", code: "machine_not_running", request_id: "req_1", error_detail: { code: "machine_not_running", retryable: true, request_id: "req_1" } });
  assert.equal(toEnvelope(new KilnError("build_rejected", "no", { buildId: "bld_1" }), "req_2").body.build_id, "bld_1");
});

test("anything else is a 500 internal that carries neither its message nor its cause", () => {
  const secret = "host path /var/lib/kiln/secret-marker";
  const { status, body } = toEnvelope(new Error(secret, { cause: new Error(secret) }), "req_3");
  assert.equal(status, 500);
  assert.deepEqual(body, { error: ERROR_CATALOGUE.internal.message, code: "internal", request_id: "req_3" });
  assert.ok(!JSON.stringify(body).includes("secret-marker"));
});

test("Fastify's own errors speak the catalogue's codes", () => {
  assert.equal(toEnvelope({ code: "FST_ERR_CTP_INVALID_JSON_BODY", message: "x" }, "r").body.code, "invalid_request");
  assert.equal(toEnvelope({ code: "FST_ERR_CTP_BODY_TOO_LARGE", message: "x" }, "r").status, 413);
  assert.equal(toEnvelope({ code: "FST_ERR_CTP_INVALID_MEDIA_TYPE", message: "x" }, "r").body.code, "unsupported_media_type");
  assert.equal(toEnvelope({ statusCode: 405, message: "x" }, "r").body.code, "method_not_allowed");
});

test("a plain Error is thrown only at a seam that maps it once (the guest agent and the CLI have their own)", () => {
  const plain = files.filter((f) => !f.path.startsWith("agent/") && !f.path.startsWith("cli/") && f.text.includes("throw new Error(")).map((f) => f.path).sort();
  assert.deepEqual(plain, Object.keys(PLAIN_ERROR_SEAMS).sort());
});
