// Declarative steps → Dockerfile: one golden text per variant, determinism, and quoting no argument can break out of.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { Value } from "typebox/value";
import { planSteps, Step, STEP_TYPES } from "../../src/builder/steps/index.ts";
import type { StepT } from "../../src/builder/steps/index.ts";
import { assembleDockerfile, shellQuote } from "../../src/builder/dockerfile.ts";

const text = (step: StepT, user = "root") => planSteps([step], user)[0].text;

const GOLDEN: [StepT, string][] = [
  [{ type: "run", command: "make all" }, `RUN ["/bin/sh","-c","make all"]`],
  [{ type: "run", command: "whoami", user: "user" }, `USER user\nRUN ["/bin/sh","-c","whoami"]\nUSER root`],
  [{ type: "env", envs: { B: "2", A: "one two" } }, `ENV A="one two" B="2"`],
  [{ type: "workdir", path: "/srv/app" }, `WORKDIR /srv/app`],
  [{ type: "user", user: "user" }, `USER user`],
  [{ type: "copy", src: "app/", dest: "/app/", mode: "0755", owner: "user" }, `COPY --chmod=0755 --chown=user ["app/","/app/"]`],
  [{ type: "apt_install", packages: ["jq", "curl"] }, `RUN ["/bin/sh","-c","apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends 'jq' 'curl' && rm -rf /var/lib/apt/lists/*"]`],
  [{ type: "pip_install", packages: ["requests==2.31.0"] }, `RUN ["/bin/sh","-c","python3 -m pip install --no-cache-dir --break-system-packages --disable-pip-version-check 'requests==2.31.0'"]`],
  [{ type: "npm_install", packages: ["left-pad"], global: true }, `RUN ["/bin/sh","-c","npm install --no-audit --no-fund --global 'left-pad'"]`],
  [{ type: "git_clone", url: "https://example.com/r.git", dest: "/src", branch: "main", depth: 1 }, `RUN ["/bin/sh","-c","git clone --depth 1 --branch 'main' -- 'https://example.com/r.git' '/src'"]`],
  [
    { type: "download", url: "http://example.com/f", dest: "/opt/f", sha256: "a".repeat(64), mode: "0755" },
    `RUN ["/bin/sh","-c","mkdir -p \\"$(dirname -- '/opt/f')\\" && curl -fsSL --retry 2 -o '/opt/f' -- 'http://example.com/f' && echo '${"a".repeat(64)}  /opt/f' | sha256sum -c - && chmod 0755 '/opt/f'"]`,
  ],
  [{ type: "write_file", path: "/etc/motd", content: "hi\n", mode: "0644" }, `RUN ["/bin/sh","-c","mkdir -p \\"$(dirname -- '/etc/motd')\\" && printf '%s' 'aGkK' | base64 -d > '/etc/motd' && chmod 0644 '/etc/motd'"]`],
  [{ type: "mkdir", path: "/data", mode: "0700" }, `RUN ["/bin/sh","-c","mkdir -p -m 0700 -- '/data'"]`],
  [{ type: "remove", path: "/tmp/x", recursive: true }, `RUN ["/bin/sh","-c","rm -fr -- '/tmp/x'"]`],
  [{ type: "rename", src: "/a", dest: "/b/c" }, `RUN ["/bin/sh","-c","mkdir -p \\"$(dirname -- '/b/c')\\" && mv -- '/a' '/b/c'"]`],
  [{ type: "symlink", target: "/usr/bin/python3", path: "/usr/local/bin/py" }, `RUN ["/bin/sh","-c","mkdir -p \\"$(dirname -- '/usr/local/bin/py')\\" && ln -sfn -- '/usr/bin/python3' '/usr/local/bin/py'"]`],
];

test("every one of the 15 declarative step variants has a golden Dockerfile text", () => {
  const covered = new Set(GOLDEN.map(([s]) => s.type));
  assert.deepEqual([...covered].sort(), [...STEP_TYPES].sort());
  for (const [step, expected] of GOLDEN) {
    assert.ok(Value.Check(Step, step), `${step.type} is a valid step`);
    assert.equal(text(step), expected, step.type);
  }
});

test("the same steps give the same bytes, and env key order does not matter", () => {
  const steps: StepT[] = GOLDEN.map(([s]) => s);
  const a = assembleDockerfile("local/base", planSteps(steps, "root").map((s) => s.text));
  const b = assembleDockerfile("local/base", planSteps(structuredClone(steps), "root").map((s) => s.text));
  assert.equal(a, b);
  assert.equal(text({ type: "env", envs: { A: "1", B: "2" } }), text({ type: "env", envs: { B: "2", A: "1" } }));
  assert.ok(a.startsWith("FROM local/base\n"));
});

test("the user in force flows from a user step into later steps", () => {
  const plan = planSteps([{ type: "user", user: "user" }, { type: "apt_install", packages: ["jq"] }, { type: "run", command: "id" }], "root");
  assert.match(plan[1].text, /^USER root\nRUN .*\nUSER user$/);
  assert.equal(plan[2].text, `RUN ["/bin/sh","-c","id"]`);
});

const NASTY = `a'b"c$(touch /tmp/pwned)\`id\`\\n\\\\ \n;rm -rf / #`;

test("quoting: quotes, newlines, $() and backslashes stay data in every string field", () => {
  // Every RUN line is one line of JSON whose script the shell reads with the argument single-quoted.
  const quoted = shellQuote(NASTY);
  const echoed = execFileSync("/bin/sh", ["-c", `printf '%s' ${quoted}`]).toString();
  assert.equal(echoed, NASTY, "the shell gets the argument back byte for byte");
  const steps: StepT[] = [
    { type: "run", command: NASTY },
    { type: "write_file", path: `/tmp/${NASTY.replace(/[\x00-\x1f]/g, "")}`, content: NASTY },
    { type: "mkdir", path: `/x/${NASTY.replace(/[\x00-\x1f]/g, "")}` },
    { type: "remove", path: `/x/${NASTY.replace(/[\x00-\x1f]/g, "")}` },
    { type: "rename", src: `/x/${NASTY.replace(/[\x00-\x1f]/g, "")}`, dest: "/y" },
    { type: "symlink", target: NASTY.replace(/[\x00-\x1f]/g, ""), path: "/l" },
  ];
  for (const s of planSteps(steps, "root")) {
    for (const line of s.text.split("\n")) {
      if (!line.startsWith("RUN ")) continue;
      const argv = JSON.parse(line.slice(4)) as string[];
      assert.equal(argv.length, 3);
      assert.equal(argv[0], "/bin/sh");
    }
    assert.ok(!s.text.includes("\n") || s.text.split("\n").every((l) => /^(RUN|USER) /.test(l)), "no instruction spills onto a new line");
  }
  // write_file content reaches the file exactly (run the generated script on the host in a temp dir).
  const dir = execFileSync("mktemp", ["-d"]).toString().trim();
  const plan = planSteps([{ type: "write_file", path: `${dir}/out`, content: NASTY }], "root")[0];
  const script = (JSON.parse(plan.text.slice(4)) as string[])[2];
  execFileSync("/bin/sh", ["-c", script]);
  assert.equal(execFileSync("cat", [`${dir}/out`]).toString(), NASTY);
  execFileSync("rm", ["-rf", dir]);
  // ENV and WORKDIR: escaped, and line breaks refused by the schema.
  assert.equal(text({ type: "env", envs: { V: `a"b$c\\d` } }), `ENV V="a\\"b\\$c\\\\d"`);
  assert.equal(Value.Check(Step, { type: "env", envs: { V: "a\nENV X=1" } }), false);
  assert.equal(Value.Check(Step, { type: "workdir", path: "/a\nRUN x" }), false);
  assert.equal(Value.Check(Step, { type: "user", user: "root\nRUN x" }), false);
  assert.equal(Value.Check(Step, { type: "apt_install", packages: ["--allow-unauthenticated"] }), false, "no package can read as an option");
});
