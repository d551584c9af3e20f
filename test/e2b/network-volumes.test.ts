// E2B's network rules and volumes through the published `e2b` SDK against a real Kiln: allowOut/denyOut onto Kiln's
// egress policy (checked with a listener on the host's own address, which Kiln's default egress closes), and
// `Volume` plus `volumeMounts` onto Kiln volumes shared by two sandboxes.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, Volume, SandboxError, SandboxNotFoundError } from "e2b";
import type { SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { hostAddress, listenCounting } from "../support/net.ts";

let k: TestKiln;
let key: string;
let opts: SandboxOpts;

before(async () => {
  k = await startTestKiln();
  key = (await k.kiln.services.keys.create("e2b-network", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000, timeoutMs: 300_000 };
});
after(async () => k?.close());

/** A TCP connect from inside the sandbox (bash's /dev/tcp): "ok" or "refused"/"timeout". */
async function connectFrom(sbx: Sandbox, host: string, port: number): Promise<string> {
  const r = await sbx.commands.run(`timeout 5 bash -c 'exec 3<>/dev/tcp/${host}/${port} && echo ok' 2>&1; echo "exit=$?"`);
  if (r.stdout.includes("ok\n")) return "ok";
  return /exit=124/.test(r.stdout) ? "timeout" : /refused/i.test(r.stdout) ? "refused" : `other: ${r.stdout.trim()}`;
}

test("network allowOut opens what Kiln's egress closes; denyOut closes a public address; allowOut wins over denyOut", async () => {
  const addr = hostAddress();
  const l = await listenCounting(addr);
  const plain = await Sandbox.create("base", opts);
  const sandboxes = [plain];
  try {
    assert.equal(await connectFrom(plain, addr, l.port), "refused", "the host's address is closed by default");
    const mirror = (await plain.commands.run("getent hosts deb.debian.org")).stdout.trim().split(/\s+/)[0];
    assert.ok(mirror, "DNS answers");
    assert.equal(await connectFrom(plain, mirror, 80), "ok");

    const ruled = await Sandbox.create("base", { ...opts, network: { allowOut: [addr], denyOut: [`${mirror}/32`] } });
    sandboxes.push(ruled);
    assert.equal(await connectFrom(ruled, addr, l.port), "ok", "allowOut opens the host's address");
    assert.equal(l.accepted(), 1);
    assert.equal(await connectFrom(ruled, mirror, 80), "refused", "denyOut closes the mirror");
    assert.deepEqual((await k.call("GET", `/v1/machines/mch_${ruled.sandboxId}`)).body.network, { allow_out: [`${addr}/32`], deny_out: [`${mirror}/32`] });

    // An allow list, E2B's way: deny everything, allow one address.
    const only = await Sandbox.create("base", { ...opts, network: { denyOut: ["0.0.0.0/0"], allowOut: [addr] } });
    sandboxes.push(only);
    assert.equal(await connectFrom(only, addr, l.port), "ok");
    assert.equal(await connectFrom(only, mirror, 80), "refused");
  } finally {
    for (const s of sandboxes) await s.kill().catch(() => undefined);
    l.server.close();
  }
});

/** Sandbox.updateNetwork, with the server's logged errors when it fails. */
async function updateNetwork(s: Sandbox, network: Parameters<Sandbox["updateNetwork"]>[0]) {
  await s.updateNetwork(network).catch((err: unknown) => {
    throw new Error(`updateNetwork failed: ${String(err)}; server errors: ${k.logs.filter((l) => /"level":50/.test(l)).join("").slice(-3000)}`);
  });
}

test("updateNetwork (PUT …/network) replaces a running sandbox's egress lists at once, also while it is paused; omitted fields clear them", async () => {
  const addr = hostAddress();
  const l = await listenCounting(addr);
  const s = await Sandbox.create("base", opts);
  try {
    assert.equal(await connectFrom(s, addr, l.port), "refused");
    await updateNetwork(s, { allowOut: [addr] });
    assert.equal(await connectFrom(s, addr, l.port), "ok", "opened without a restart");
    assert.deepEqual((await s.getInfo()).network?.allowOut, [`${addr}/32`]);
    const mirror = (await s.commands.run("getent hosts deb.debian.org")).stdout.trim().split(/\s+/)[0];
    await updateNetwork(s, { allowInternetAccess: false, allowOut: [addr] });
    assert.equal(await connectFrom(s, mirror, 80), "refused", "allowInternetAccess false denies everything else");
    assert.equal(await connectFrom(s, addr, l.port), "ok", "allowOut still wins");
    await updateNetwork(s, {});
    assert.equal(await connectFrom(s, addr, l.port), "refused", "an empty update clears the lists");
    assert.equal(await connectFrom(s, mirror, 80), "ok");
    assert.equal((await s.getInfo()).network, undefined);

    await s.pause();
    await updateNetwork(s, { allowOut: [addr] });
    await Sandbox.connect(s.sandboxId, opts);
    assert.equal(await connectFrom(s, addr, l.port), "ok", "lists set while paused hold after connect");
    await assert.rejects(s.updateNetwork({ allowOut: ["example.com"] }), /domain names/);
    assert.equal(await connectFrom(s, addr, l.port), "ok", "a refused update changes nothing");
  } finally {
    await s.kill();
    l.server.close();
  }
  await assert.rejects(Sandbox.updateNetwork("00000000000000000000000000", {}, opts), SandboxNotFoundError);
});

test("network settings Kiln cannot serve are refused with the reason, and create nothing", async () => {
  const before = (await k.call("GET", "/v1/machines")).body.machines.length;
  const refused: [object, RegExp][] = [
    [{ allowOut: ["example.com"] }, /not an IP address or CIDR.*domain names/],
    [{ allowPublicTraffic: true }, /allowPublicTraffic/],
    [{ maskRequestHost: "x.example" }, /maskRequestHost/],
    [{ allowOut: ["10.0.0.0/33"] }, /not an IP address or CIDR/],
  ];
  for (const [network, message] of refused) {
    await assert.rejects(Sandbox.create("base", { ...opts, network }), (err: unknown) => err instanceof SandboxError && message.test(String(err)), JSON.stringify(network));
  }
  assert.equal((await k.call("GET", "/v1/machines")).body.machines.length, before);
});

test("Volume.create, list, getInfo and destroy are Kiln volumes; volumeMounts share one between two sandboxes", async () => {
  const name = `e2b-vol-${Date.now()}`;
  const vol = await Volume.create(name, opts);
  assert.match(vol.volumeId, /^vol_/);
  assert.equal(vol.name, name);
  assert.equal((await k.call("GET", `/v1/volumes/${vol.volumeId}`)).body.name, name);
  assert.ok((await Volume.list(opts)).some((v) => v.volumeId === vol.volumeId && v.name === name));
  assert.equal((await Volume.getInfo(vol.volumeId, opts)).name, name);
  await assert.rejects(Volume.create(name, opts), /already exists/);

  const a = await Sandbox.create("base", { ...opts, volumeMounts: { "/mnt/shared": vol } });
  const b = await Sandbox.create("base", { ...opts, volumeMounts: { "/data": name } });
  try {
    await a.files.write("/mnt/shared/from-a.txt", "written in a");
    assert.equal(await b.files.read("/data/from-a.txt"), "written in a");
    await b.commands.run("echo from b > /data/from-b.txt", { user: "root" });
    assert.equal(await a.files.read("/mnt/shared/from-b.txt"), "from b\n");
    await assert.rejects(Sandbox.create("base", { ...opts, volumeMounts: { "/x": "no-such-volume" } }), /volume "no-such-volume" not found/);
  } finally {
    await a.kill();
    await b.kill();
  }
  // E2B's volume content API is not served: a clear 501, not a silent answer.
  const content = await request(`${k.url}/volumecontent/${vol.volumeId}/dir?path=/`);
  assert.equal(content.statusCode, 501);
  assert.match(await content.body.text(), /volume content API/);
  // It is public (its token is not Kiln's): a stranger's upload is answered without being read, a JSON body past a
  // token's size is refused.
  const upload = await request(`${k.url}/volumecontent/${vol.volumeId}/file?path=/x`, { method: "PUT", headers: { "content-type": "application/octet-stream" }, body: Buffer.alloc(1024 * 1024) });
  assert.equal(upload.statusCode, 501);
  await upload.body.dump();
  const json = await request(`${k.url}/volumecontent/${vol.volumeId}/file?path=/x`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ pad: "x".repeat(64 * 1024) }) });
  assert.equal(json.statusCode, 413);
  await json.body.dump();
  assert.equal(await Volume.destroy(vol.volumeId, opts), true);
  assert.equal(await Volume.destroy(vol.volumeId, opts), false);
});
