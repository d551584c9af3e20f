// npm_install builds a template whose machines see the installed package. Machines cannot reach the npm registry
// here (TLS interception), so the package is a tarball on a loopback server, and npm itself is the host's copy run by
// the Node the platform injects into every machine (/opt/kiln).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { buildOk, machineFrom, sh } from "./support.ts";
import { startFixtures } from "./fixtures.ts";
import type { Fixtures } from "./fixtures.ts";

let k: TestKiln;
let fx: Fixtures;
before(async () => {
  fx = await startFixtures({ npmCli: true });
  k = await startTestKiln({ env: { KILN_MACHINE_HOST_ACCESS: "1", KILN_WARM_POOL: "0" } });
});
after(async () => {
  await k?.close();
  await fx?.close();
});

test("npm_install installs packages globally and into the working directory", { skip: !existsSync("/usr/lib/node_modules/npm") && "no npm on this host to serve" }, async () => {
  await buildOk(k, {
    name: "with-npm",
    steps: [
      { type: "download", url: `${fx.base}/npm-cli.tgz`, dest: "/opt/npm-cli.tgz" },
      {
        type: "run",
        command: [
          "tar -xzf /opt/npm-cli.tgz -C /opt && rm /opt/npm-cli.tgz",
          "printf '#!/bin/sh\\nLD_LIBRARY_PATH=/opt/kiln/lib exec /opt/kiln/bin/node \"$@\"\\n' > /usr/local/bin/node && chmod 755 /usr/local/bin/node",
          "ln -s /opt/npm/bin/npm-cli.js /usr/local/bin/npm",
        ].join(" && "),
      },
      // npm derives its global prefix from node's location; this node lives under /opt/kiln.
      { type: "env", envs: { NPM_CONFIG_PREFIX: "/usr/local" } },
      { type: "npm_install", packages: [`${fx.base}/kiln-fixture-1.0.0.tgz`], global: true },
      { type: "workdir", path: "/srv/app" },
      { type: "npm_install", packages: [`${fx.base}/kiln-fixture-1.0.0.tgz`] },
    ],
  });
  const m = await machineFrom(k, "with-npm");
  const r = await sh(k, m, "node -e \"console.log(require('/usr/local/lib/node_modules/kiln-fixture'))\"; node -e \"console.log(require('kiln-fixture'))\"");
  assert.equal(r.stdout, "from the local tarball\nfrom the local tarball\n", r.stderr);
});
