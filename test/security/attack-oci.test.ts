// A key holder naming a registry (OCI import `base_image`), and the registry it names, against the server's own
// network: no fetch of an import — the registry, its token realm, a redirect — reaches loopback or a private range
// unless KILN_INSECURE_REGISTRIES lists that host, nor a link-local or metadata address ever. Driven through
// POST /v1/templates/build; a plain TCP canary on loopback counts every connection it is sent (TLS attempts too).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";
import type { AddressInfo, Server, Socket } from "node:net";
import { request } from "undici";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startHostileRegistry } from "../support/hostile-registry.ts";
import type { HostileRegistry } from "../support/hostile-registry.ts";

let k: TestKiln;
let bad: HostileRegistry;
let canary: Server;
let canaryPort: number;
let connections = 0;
const sockets = new Set<Socket>();

before(async () => {
  canary = createServer((s) => {
    connections++;
    sockets.add(s);
    s.on("close", () => sockets.delete(s));
    s.on("error", () => undefined);
    s.end("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n{\"token\":\"stolen\"}");
  });
  await new Promise<void>((r) => canary.listen(0, "127.0.0.1", r));
  canaryPort = (canary.address() as AddressInfo).port;
  bad = await startHostileRegistry();
  k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: bad.host }, waitForBase: false });
});

after(async () => {
  await k?.close();
  await bad?.stop();
  for (const s of sockets) s.destroy();
  await new Promise((r) => canary?.close(r));
});

/** One build from `base_image`, its SSE stream read to the end: the terminal entry's verdict. */
async function importBuild(name: string, image: string): Promise<{ ok: boolean; message: string; code?: string }> {
  const res = await request(`${k.url}/v1/templates/build`, {
    method: "POST",
    headers: { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ name, base_image: image }),
  });
  const text = await res.body.text();
  if (res.statusCode !== 200) return { ok: false, message: text, code: JSON.parse(text).code };
  const last = text.split("\n\n").filter((b) => b.includes("data: ")).at(-1)!;
  const data = JSON.parse(/^data: (.*)$/m.exec(last)![1]);
  return { ok: /^event: end$/m.test(last), message: data.message ?? "", code: data.error_detail?.code };
}

test("base_image naming an unlisted loopback registry, in any spelling, is refused before a connection is made", async () => {
  const spellings = [`127.0.0.1:${canaryPort}`, `localhost:${canaryPort}`, `2130706433:${canaryPort}`, `0x7f.1:${canaryPort}`, `127.1:${canaryPort}`];
  for (const [i, host] of spellings.entries()) {
    const out = await importBuild(`ssrf-direct-${i}`, `${host}/x/y:v1`);
    assert.equal(out.ok, false, `${host}: ${JSON.stringify(out)}`);
    assert.equal(out.code, "build_error", `${host}: ${out.message}`);
    assert.match(out.message, /private or loopback.*KILN_INSECURE_REGISTRIES/, host);
  }
  assert.equal(connections, 0, "the canary was never connected to");
});

test("a listed registry cannot send the server to loopback, private or metadata addresses through a token realm or a redirect", async () => {
  const challenge = (realm: string) => (_req: unknown, res: import("node:http").ServerResponse) => res.writeHead(401, { "www-authenticate": `Bearer realm="${realm}",service="x"` }).end();
  const redirect = (to: string) => (_req: unknown, res: import("node:http").ServerResponse) => res.writeHead(302, { location: to }).end();
  const cases: [string, Parameters<HostileRegistry["manifest"]>[2], RegExp][] = [
    ["realm-loopback", challenge(`http://127.0.0.1:${canaryPort}/token`), /private or loopback/],
    ["realm-name", challenge(`http://localhost:${canaryPort}/token`), /private or loopback/],
    ["realm-metadata", challenge("http://169.254.169.254/latest/meta-data/"), /never allowed/],
    ["realm-mapped", challenge(`http://[::ffff:127.0.0.1]:${canaryPort}/token`), /private or loopback/],
    ["redirect-loopback", redirect(`http://127.0.0.1:${canaryPort}/v2/x/manifests/v1`), /private or loopback/],
    ["redirect-metadata", redirect("http://169.254.169.254/v2/x/manifests/v1"), /never allowed/],
  ];
  for (const [repo, handler, why] of cases) {
    bad.manifest(`evil/${repo}`, "v1", handler);
    const started = Date.now();
    const out = await importBuild(`ssrf-${repo}`, `${bad.host}/evil/${repo}:v1`);
    assert.equal(out.ok, false, repo);
    assert.equal(out.code, "build_error", `${repo}: ${out.message}`);
    assert.match(out.message, why, `${repo}: ${out.message}`);
    assert.ok(Date.now() - started < 10_000, `${repo} was refused at once, not after a connect timeout`);
  }
  assert.equal(connections, 0, "the canary was never connected to");
  const ready = await k.call("GET", "/health");
  assert.equal(ready.status, 200);
});
