// E2B's network rules and volumes through the published `e2b` SDK against a real Kiln: allowOut/denyOut onto Kiln's
// egress policy (checked with a listener on the host's own address, which Kiln's default egress closes), and
// `Volume` plus `volumeMounts` onto Kiln volumes shared by two sandboxes.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, Volume, SandboxError, SandboxNotFoundError, VolumePathNotFoundError } from "e2b";
import type { SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";
import { hostAddress, listenCounting } from "../support/net.ts";
import { filesWithContents } from "../support/files.ts";

let k: TestKiln;
let key: string;
let opts: SandboxOpts;

before(async () => {
  // The operator's key (KILN_API_KEY, here in E2B's format): opening the host's own address with allowOut is the
  // operator's call (docs/security/api.md); a lesser key's attempt is test/security/attack-egress-keys.test.ts.
  key = generateKeyIn("e2b");
  k = await startTestKiln({ env: { KILN_API_KEY: key } });
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 60_000, timeoutMs: 300_000 };
  // The SDK's volume content calls go to E2B_VOLUME_API_URL (else https://api.<domain>), as sandbox calls to E2B_SANDBOX_URL.
  process.env.E2B_VOLUME_API_URL = k.url;
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
    assert.deepEqual((await k.call("GET", `/v1/machines/mch_${ruled.sandboxId}`, { key })).body.network, { allow_out: [`${addr}/32`], deny_out: [`${mirror}/32`] });

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
  const before = (await k.call("GET", "/v1/machines", { key })).body.machines.length;
  const refused: [object, RegExp][] = [
    [{ allowOut: ["example.com"] }, /not an IP address or CIDR.*domain names/],
    [{ allowPublicTraffic: true }, /allowPublicTraffic/],
    [{ maskRequestHost: "x.example" }, /maskRequestHost/],
    [{ allowOut: ["10.0.0.0/33"] }, /not an IP address or CIDR/],
  ];
  for (const [network, message] of refused) {
    await assert.rejects(Sandbox.create("base", { ...opts, network }), (err: unknown) => err instanceof SandboxError && message.test(String(err)), JSON.stringify(network));
  }
  assert.equal((await k.call("GET", "/v1/machines", { key })).body.machines.length, before);
});

test("Volume.create, list, getInfo and destroy are Kiln volumes; volumeMounts share one between two sandboxes", async () => {
  const name = `e2b-vol-${Date.now()}`;
  const vol = await Volume.create(name, opts);
  assert.match(vol.volumeId, /^vol_/);
  assert.equal(vol.name, name);
  assert.equal((await k.call("GET", `/v1/volumes/${vol.volumeId}`, { key })).body.name, name);
  assert.ok((await Volume.list(opts)).some((v) => v.volumeId === vol.volumeId && v.name === name));
  assert.equal((await Volume.getInfo(vol.volumeId, opts)).name, name);
  await assert.rejects(Volume.create(name, opts), /already exists/);

  const a = await Sandbox.create("base", { ...opts, volumeMounts: { "/mnt/shared": vol } });
  const b = await Sandbox.create("base", { ...opts, volumeMounts: { "/data": name } });
  try {
    // getInfo and list report each sandbox's volumes by name and path.
    assert.deepEqual((await a.getInfo()).volumeMounts, [{ name, path: "/mnt/shared" }]);
    assert.deepEqual((await Sandbox.getInfo(b.sandboxId, opts)).volumeMounts, [{ name, path: "/data" }]);
    const listed = await Sandbox.list({ ...opts, query: { metadata: {} } }).nextItems();
    assert.deepEqual(listed.find((x) => x.sandboxId === b.sandboxId)?.volumeMounts, [{ name, path: "/data" }]);
    await a.files.write("/mnt/shared/from-a.txt", "written in a");
    assert.equal(await b.files.read("/data/from-a.txt"), "written in a");
    await b.commands.run("echo from b > /data/from-b.txt", { user: "root" });
    assert.equal(await a.files.read("/mnt/shared/from-b.txt"), "from b\n");
    // The volume content API reaches the same files without a sandbox, with the volume's token.
    const v = await Volume.connect(vol.volumeId, opts);
    assert.ok(v.token, "Volume.connect hands out the volume's token");
    assert.equal(await v.readFile("/from-b.txt"), "from b\n");
    const written = await v.writeFile("/api/new.txt", "from the volume API", { force: true, mode: 0o640 });
    assert.equal(written.path, "/api/new.txt");
    assert.equal(written.type, "file");
    assert.equal(written.size, "from the volume API".length);
    assert.equal(written.mode & 0o777, 0o640);
    assert.equal(written.uid, 1000);
    assert.equal(await b.files.read("/data/api/new.txt"), "from the volume API");
    await assert.rejects(Sandbox.create("base", { ...opts, volumeMounts: { "/x": "no-such-volume" } }), /volume "no-such-volume" not found/);
  } finally {
    await a.kill();
    await b.kill();
  }
  await volumeContent(vol, name);
  assert.equal(await Volume.destroy(vol.volumeId, opts), true);
  assert.equal(await Volume.destroy(vol.volumeId, opts), false);
});

/** The volume content API's semantics (E2B's orchestrator volume service) and its checks, through `Volume`. */
async function volumeContent(vol: Volume, name: string) {
  const v = await Volume.connect(vol.volumeId, opts);
  // Without force a write creates only, in an existing directory; with it, parents are made and a file replaced.
  await assert.rejects(v.writeFile("/api/new.txt", "again"), (err: Error) => /already exists/.test(err.message));
  await assert.rejects(v.writeFile("/missing/dir/f.txt", "x"), VolumePathNotFoundError);
  await v.writeFile("/api/new.txt", "replaced", { force: true });
  assert.equal(await v.readFile("/api/new.txt"), "replaced");
  assert.deepEqual(Buffer.from(await v.readFile("/api/new.txt", { format: "bytes" })).toString(), "replaced");
  // makeDir: 409 when it exists without force, parents only with force.
  const dir = await v.makeDir("/api/sub");
  assert.equal(dir.type, "directory");
  await assert.rejects(v.makeDir("/api/sub"), (err: Error) => /already exists/.test(err.message));
  await v.makeDir("/api/sub", { force: true });
  await assert.rejects(v.makeDir("/deep/a/b"), VolumePathNotFoundError);
  assert.equal((await v.makeDir("/deep/a/b", { force: true })).path, "/deep/a/b");
  // list (depth), getInfo, exists, updateMetadata (mode), remove (recursive; 404 when missing).
  assert.deepEqual((await v.list("/api")).map((e) => e.name).sort(), ["new.txt", "sub"]);
  assert.ok((await v.list("/", { depth: 3 })).some((e) => e.path === "/deep/a/b"));
  await assert.rejects(v.list("/", { depth: 11 }), /depth/);
  const info = await v.getInfo("/api/new.txt");
  assert.equal(info.size, "replaced".length);
  assert.ok(info.mtime instanceof Date && !Number.isNaN(info.mtime.getTime()));
  assert.equal(await v.exists("/api/new.txt"), true);
  assert.equal(await v.exists("/api/nope.txt"), false);
  assert.equal((await v.updateMetadata("/api/new.txt", { mode: 0o600 })).mode & 0o777, 0o600);
  await assert.rejects(v.updateMetadata("/api/new.txt", { uid: 0 }), /machines' user/);
  await v.remove("/deep");
  assert.equal(await v.exists("/deep/a/b"), false);
  await assert.rejects(v.remove("/deep"), VolumePathNotFoundError);
  // Paths stay inside the volume: `..` stops at its root, a symlink is never followed out of it.
  assert.deepEqual((await v.getInfo("/../../api/new.txt")).path, "/api/new.txt");
  const s = await Sandbox.create("base", { ...opts, volumeMounts: { "/v": name } });
  try {
    await s.commands.run("ln -s /etc /v/escape && ln -s /etc/hostname /v/host-link", { user: "root" });
  } finally {
    await s.kill();
  }
  await assert.rejects(v.readFile("/escape/hostname"));
  await assert.rejects(v.readFile("/host-link"), /not a regular file|symbolic|symlink/i);
  await assert.rejects(v.writeFile("/escape/x", "x", { force: true }));
  assert.equal((await v.getInfo("/host-link")).type, "symlink");
  // Auth: the volume's token, for that volume only; an API key or no token is 401, and it dies with its key.
  const bare = async (path: string, headers: Record<string, string>) => {
    const res = await request(`${k.url}${path}`, { headers });
    await res.body.dump();
    return res.statusCode;
  };
  const url = `/volumecontent/${vol.volumeId}/path?path=/api/new.txt`;
  assert.equal(await bare(url, { authorization: `Bearer ${v.token}` }), 200);
  assert.equal(await bare(url, {}), 401);
  assert.equal(await bare(url, { authorization: `Bearer ${key}` }), 401);
  const other = await Volume.create(`${name}-other`, opts);
  assert.equal(await bare(`/volumecontent/${other.volumeId}/path?path=/`, { authorization: `Bearer ${v.token}` }), 401);
  assert.equal(await bare(`/volumecontent/${other.volumeId}/path?path=/`, { authorization: `Bearer ${other.token}` }), 200);
  await Volume.destroy(other.volumeId, opts);
  const second = await k.kiln.services.keys.create("e2b-volume-revoked", generateKeyIn("e2b"));
  const doomed = await Volume.connect(vol.volumeId, { ...opts, apiKey: second.key });
  assert.notEqual(doomed.token, v.token, "each key gets its own token");
  assert.equal(await bare(url, { authorization: `Bearer ${doomed.token}` }), 200);
  await k.kiln.services.keys.revoke(second.id);
  assert.equal(await bare(url, { authorization: `Bearer ${doomed.token}` }), 401);
  // The token is a secret: it reaches neither the logs nor any file of the data dir (it is derived, never stored).
  const secret = v.token!.split(".")[1];
  assert.equal(k.logs.some((l) => l.includes(secret)), false);
  for await (const f of filesWithContents(k.dataDir)) assert.equal(f.text.includes(secret), false, f.path);
  // A body past the server's limit is refused and writes nothing.
  const huge = await request(`${k.url}/volumecontent/${vol.volumeId}/file?path=/huge.bin&force=true`, {
    method: "PUT",
    headers: { authorization: `Bearer ${v.token}`, "content-type": "application/octet-stream" },
    body: Buffer.alloc((k.kiln.app.initialConfig.bodyLimit ?? 1024 * 1024) + 1),
  });
  assert.equal(huge.statusCode, 413);
  await huge.body.dump();
  assert.equal(await v.exists("/huge.bin"), false);
}

