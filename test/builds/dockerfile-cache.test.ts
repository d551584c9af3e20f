// Dockerfile builds as fast as native ones (issue 22): a Dockerfile whose one stage stands on a Kiln template runs
// an instruction a step on the template's own layers, each step cached like a declarative step (parent key,
// instruction text, copied files' digests, build args as HMACs). A rebuild reuses the layers (same digests); a
// changed line re-runs only from there; the log shows each instruction as a step. Anything else goes to the
// Dockerfile builder, and the log says why.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { join } from "node:path";
import { DatabaseSync } from "node:sqlite";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { filesHolding } from "../security/build-support.ts";
import { buildOk, machineFrom, putBlob, sh } from "./support.ts";
import type { SseEvent } from "./support.ts";
import { planDockerfile } from "../../src/builder/sources/dockerfile-plan.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

/** The artifact's layer digests, as recorded. */
function layerDigests(artifactId: string): string[] {
  const db = new DatabaseSync(join(k.dataDir, "kiln.db"), { readOnly: true });
  try {
    const row = db.prepare("SELECT config_json FROM artifacts WHERE id = ?").get(artifactId) as { config_json: string };
    return JSON.parse(row.config_json).layerDigests;
  } finally {
    db.close();
  }
}

const outcomes = (events: SseEvent[]) =>
  events.filter((e) => e.data.cache_layer === "layer" && e.data.cache_outcome !== "stored").map((e) => `${e.data.step_index}:${e.data.cache_outcome}`);
const ran = (events: SseEvent[]) => events.filter((e) => e.event === "message" && /^step \d+\/\d+: /.test(e.data.message)).map((e) => e.data.step_index);

test("a Dockerfile on a Kiln template: each instruction a cached step on the template's own layers; an appended line runs alone; same digests", { timeout: 300_000 }, async () => {
  const tag = randomBytes(4).toString("hex");
  const file = await putBlob(k, `hello ${tag}\n`);
  const dockerfile = [
    "FROM local/base",
    "ARG GREETING=hi",
    "ENV APP_HOME=/srv/app",
    "WORKDIR /srv/app",
    "COPY conf/hello.txt ./hello.txt",
    `RUN echo "$GREETING $APP_HOME ${tag} $(whoami)" > built.txt \\`,
    "  && cat hello.txt >> built.txt",
    "LABEL purpose=test",
  ].join("\n");
  const body = { name: `df-cache-${tag}`, dockerfile, build_args: { GREETING: "howdy" }, context: { files: [{ path: "conf/hello.txt", sha256: file }] } };
  const first = await buildOk(k, body);
  const start = first.events.find((e) => e.event === "start")!;
  assert.match(start.data.message, /with 6 steps/, "the start line counts the instructions");
  assert.deepEqual(ran(first.events), [3, 4, 5], "the instructions that touch files ran as steps 3–5 of 6 (ARG, ENV, LABEL change no file)");
  for (const e of first.events.filter((e) => e.event === "message" && e.data.step_index !== undefined)) assert.ok(["step", "vm_create", "snapshot"].includes(e.data.phase), `phase ${e.data.phase} for ${e.data.message}`);
  assert.ok(first.events.some((e) => e.data.phase === "step" && /^step 5\/6: RUN echo/.test(e.data.message)), "the RUN step is named with its index and count");
  assert.ok(!first.events.some((e) => /FROM local\/base: Kiln template/.test(e.data.message ?? "")), "the template was not copied into a builder");
  const digests = layerDigests(first.artifactId);

  const m = await machineFrom(k, body.name);
  const out = await sh(k, m, "cat /srv/app/built.txt; pwd; echo $APP_HOME");
  assert.equal(out.stdout, `howdy /srv/app ${tag} root\nhello ${tag}\n/srv/app\n/srv/app\n`);
  assert.equal((await k.call("DELETE", `/v1/machines/${m}`)).status < 300, true);

  // The same Dockerfile with one line appended: every earlier step is a hit, only the new one runs.
  const second = await buildOk(k, { ...body, dockerfile: `${dockerfile}\nRUN echo extra > /extra` });
  assert.deepEqual(outcomes(second.events), ["1:hit", "2:hit", "3:hit", "4:hit", "5:hit", "6:hit", "7:miss"]);
  assert.deepEqual(ran(second.events), [7]);
  const again = layerDigests(second.artifactId);
  assert.deepEqual(again.slice(0, digests.length), digests, "the cached layers are the same layers");
  assert.equal(again.length, digests.length + 1);

  // A changed build arg changes the key of its ARG step and so of every step after it.
  const third = await buildOk(k, { ...body, build_args: { GREETING: "hey" } });
  assert.deepEqual(outcomes(third.events), ["1:miss", "2:miss", "3:miss", "4:miss", "5:miss", "6:miss"], "from the ARG on, every key is new");
});

test("a build arg's value is in no cache key, record, log or file; the arg still reaches RUN", { timeout: 300_000 }, async () => {
  const marker = `argmark-${randomBytes(12).toString("hex")}`;
  const r = await buildOk(k, { name: `df-arg-${randomBytes(3).toString("hex")}`, dockerfile: `FROM local/base\nARG TOKEN\nRUN [ "$TOKEN" = "${marker.slice(0, 8)}$(echo ${marker.slice(8)})" ] && echo arg=arrived`, build_args: { TOKEN: marker } });
  assert.ok(r.events.some((e) => e.data.message === "arg=arrived"), "the RUN had the arg");
  assert.ok(!JSON.stringify(r.events).includes(marker), "not in the build log");
  assert.deepEqual(filesHolding(k.dataDir, marker), [], "nothing in the data dir holds it (keys carry an HMAC)");
  assert.ok(!k.logs.join("").includes(marker), "nor the server's log");
});

test("what the executor does not take goes to the Dockerfile builder, and why is planned up front", () => {
  const argKey = Buffer.alloc(32, 1);
  const plan = (text: string, extra: Record<string, unknown> = {}) => planDockerfile(text, { argKey, ...extra });
  for (const [text, why] of [
    ["FROM local/base AS a\nFROM a\nRUN true", /several stages/],
    ["FROM local/base\nADD x /x", /ADD is left to the builder/],
    ["FROM local/base\nRUN --mount=type=cache,target=/c true", /RUN has flags/],
    ["FROM local/base\nENV A=${B:-x}", /ENV uses variables/],
    ["FROM local/base\nWORKDIR \\$HOME", /WORKDIR uses a variable form/],
    ["FROM local/base\nCOPY *.txt /x/", /pattern/],
    ["FROM local/base\nCOPY --from=other /x /x", /flag other than/],
    ["FROM local/base\nRUN <<EOF\necho hi\nEOF", /heredoc/],
    ["# syntax=docker/dockerfile:1\nFROM local/base", /parser directive/],
    ["FROM local/base\nCMD [\"x\"]", /CMD is left to the builder/],
    ["FROM local/base\nUSER 1000", /not a plain user name/],
    ["FROM local/base\nUSER user:staff", /not a plain user name/],
  ] as const) {
    const p = plan(text);
    assert.ok("builder" in p && why.test(p.builder), `${text}: ${JSON.stringify(p)}`);
  }
  assert.ok("builder" in plan("FROM local/base\nRUN true", { secrets: [{ id: "s", value: "v" }] }), "a build with secrets goes to the builder");
  const ok = plan("FROM local/base\n# comment\nRUN echo a \\\n  b\nRUN [\"/bin/echo\", \"it's\"]\nENV A=1 B=\"two words\"\nENV C 3 4\nUSER user");
  assert.ok("steps" in ok);
  assert.deepEqual(ok.steps.map((s) => s.instructions), [
    [{ op: "RUN", script: "echo a   b", envs: [] }],
    [{ op: "RUN", script: `exec '/bin/echo' 'it'\\''s'`, envs: [] }],
    [{ op: "ENV", envs: [["A", "1"], ["B", "two words"]] }],
    [{ op: "ENV", envs: [["C", "3 4"]] }],
    [{ op: "USER", user: "user" }],
  ]);
  // $X and ${X} expand as Docker expands them: the image's env, then the args in scope; '…' stays literal.
  const x = plan("FROM local/base\nARG DIR=/opt\nENV PATH=$DIR/bin:${PATH} LIT='$DIR'\nWORKDIR ${DIR}/app", { baseEnv: { PATH: "/usr/bin" } });
  assert.ok("steps" in x);
  assert.deepEqual(x.steps[1].instructions, [{ op: "ENV", envs: [["PATH", "/opt/bin:/usr/bin"], ["LIT", "$DIR"]] }]);
  assert.deepEqual(x.steps[2].instructions, [{ op: "WORKDIR", path: "/opt/app" }]);
  // A build arg's value changes the key inputs of the RUN steps after its ARG, never the text.
  const a = plan("FROM local/base\nARG V\nRUN echo $V", { buildArgs: { V: "1" } });
  const b = plan("FROM local/base\nARG V\nRUN echo $V", { buildArgs: { V: "2" } });
  assert.ok("steps" in a && "steps" in b);
  assert.equal(a.steps[1].text, b.steps[1].text);
  assert.notDeepEqual(a.steps[1].keyInputs, b.steps[1].keyInputs);
});
