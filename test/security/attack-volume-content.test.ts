// Attacks on E2B's volume content API (`/volumecontent/{volumeID}/…`, docs/e2b.md), driven from outside with raw
// requests and the volume's own token, against a volume a real machine mounts and plants things in (machine root):
// deep directory chains, symlinks, FIFOs, path spellings, modes and owners out of bounds, concurrent replaces.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { request } from "undici";
import { Volume } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let key: string;
let volumeId: string;
let token: string;
let machineId: string;

before(async () => {
  key = generateKeyIn("e2b");
  k = await startTestKiln({ env: { KILN_API_KEY: key } });
  const vol = await Volume.create("attack-content", { apiKey: key, apiUrl: k.url, requestTimeoutMs: 30_000 });
  volumeId = vol.volumeId;
  token = vol.token!;
  const m = await k.call("POST", "/v1/machines", { key, body: { volumes: [{ volume_id: volumeId, path: "/mnt/vol" }] } });
  assert.equal(m.status, 201, m.text);
  machineId = m.body.id;
});
after(async () => k?.close());

/** A command as machine root, in the machine that mounts the volume at /mnt/vol. */
async function inMachine(cmd: string) {
  const res = await k.call("POST", `/v1/machines/${machineId}/exec`, { key, body: { cmd, user: "root", timeout_s: 120 } });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.body.exit_code, 0, `${cmd}: ${res.body.stderr}`);
  return res.body.stdout as string;
}

async function content(method: "GET" | "POST" | "PUT" | "PATCH" | "DELETE", route: string, opts: { body?: string | Buffer; headers?: Record<string, string> } = {}) {
  const res = await request(`${k.url}/volumecontent/${volumeId}/${route}`, {
    method,
    headers: { authorization: `Bearer ${token}`, ...(opts.body !== undefined ? { "content-type": typeof opts.body === "string" && opts.body.startsWith("{") ? "application/json" : "application/octet-stream" } : {}), ...opts.headers },
    body: opts.body,
  });
  const text = await res.body.text();
  return { status: res.statusCode, text, json: () => JSON.parse(text) };
}

const q = (path: string) => `path=${encodeURIComponent(path)}`;

test("removing a directory chain deeper than the server's open-file limit: the tree goes, the server keeps its descriptors", async () => {
  // Machine root builds a chain deeper than the descriptors the server may hold (lowered here so the chain stays small;
  // a real host's limit is reached the same way by a deeper one). The remove must not hold one fd per level.
  const depth = 1500;
  await inMachine(`python3 -c "
import os
os.chdir('/mnt/vol'); os.mkdir('deep'); os.chdir('deep')
for i in range(${depth}):
    os.mkdir('d'); os.chdir('d')
open('leaf', 'w').write('x')
"`);
  const limit = spawnSync("prlimit", ["--pid", String(process.pid), "--nofile=1024:"], { encoding: "utf8" });
  assert.equal(limit.status, 0, limit.stderr);
  try {
    const removed = await content("DELETE", `path?${q("/deep")}`);
    assert.equal(removed.status, 204, removed.text);
  } finally {
    spawnSync("prlimit", ["--pid", String(process.pid), "--nofile=20000:"]);
  }
  assert.equal((await content("GET", `path?${q("/deep")}`)).status, 404);
});

test("path spellings stay inside the volume: dot segments, encoded dots, NUL, overlong names and paths", async () => {
  const volDir = join(k.dataDir, "volumes", volumeId);
  const before = readdirSync(volDir).sort();
  // `..` stops at the volume's root, as in a machine: `/../../` is the root itself, which cannot be removed.
  const root = await content("GET", `path?${q("/../../")}`);
  assert.equal(root.status, 200, root.text);
  assert.equal(root.json().path, "/");
  assert.equal((await content("DELETE", `path?${q("/../../")}`)).status, 400);
  for (const path of ["/../image.ext4", "/../../mnt", "/%2e%2e/image.ext4", "/..%2fimage.ext4", "/./../mnt/../image.ext4"]) {
    const info = await content("GET", `path?${q(path)}`);
    assert.ok(info.status === 404 || info.status === 400, `${path}: ${info.status} ${info.text}`);
    const del = await content("DELETE", `path?${q(path)}`);
    assert.ok(del.status === 404 || del.status === 400, `${path}: ${del.status} ${del.text}`);
  }
  // Double-encoded dots are a name, not a parent: written inside the volume.
  const odd = await content("PUT", `file?path=${encodeURIComponent("/%2e%2e")}&force=true`, { body: "odd" });
  assert.equal(odd.status, 201, odd.text);
  assert.equal(odd.json().path, "/%2e%2e");
  assert.deepEqual(readdirSync(volDir).sort(), before, "nothing appeared or went beside the volume's mount");
  assert.equal((await content("GET", `path?path=/a%00b`)).status, 400);
  assert.equal((await content("GET", `path?${q("/" + "n".repeat(300))}`)).status, 400, "a name longer than 255 bytes");
  const long = await content("GET", `path?${q("/x".repeat(2100))}`);
  assert.ok(long.status === 400 || long.status === 414, `a path past 4096: ${long.status} ${long.text}`);
  assert.ok(statSync(join(volDir, "image.ext4")).isFile());
});

test("symlinks, FIFOs and sockets machine root plants are never followed or opened", async () => {
  await inMachine(
    "cd /mnt/vol && ln -sfn / rootlink && ln -sfn /etc/passwd passwd && mkfifo fifo && python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.bind('/mnt/vol/sock')\" && mkdir -p real && echo inside > real/f",
  );
  assert.equal((await content("GET", `file?${q("/rootlink/etc/passwd")}`)).status, 400, "through a symlinked directory");
  assert.equal((await content("GET", `file?${q("/passwd")}`)).status, 400, "a symlink to a file");
  assert.equal((await content("GET", `dir?${q("/rootlink")}&depth=2`)).status, 400, "listing through a symlink");
  const list = await content("GET", `dir?${q("/")}&depth=3`);
  assert.equal(list.status, 200, list.text);
  assert.ok(!list.text.includes("shadow"), "the listing did not walk through the symlink to /");
  const started = Date.now();
  assert.equal((await content("GET", `file?${q("/fifo")}`)).status, 400, "a FIFO is not read");
  assert.ok(Date.now() - started < 5000, "a FIFO does not hang the read");
  assert.equal((await content("GET", `file?${q("/sock")}`)).status, 400, "a socket is not read");
  assert.equal((await content("PATCH", `path?${q("/passwd")}`, { body: JSON.stringify({ mode: 0o777 }) })).status, 400, "a symlink's mode is not set (nor its target's)");
  assert.equal((await content("POST", `dir?${q("/rootlink/tmp/planted")}&force=true`)).status, 400, "mkdir -p through a symlink");
  const write = await content("PUT", `file?${q("/rootlink/tmp/planted")}&force=true`, { body: "x" });
  assert.equal(write.status, 400, write.text);
  // A forced write onto the symlink's own name replaces the link, never writes through it.
  assert.equal((await content("PUT", `file?${q("/passwd")}&force=true`, { body: "replaced" })).status, 201);
  assert.equal(await inMachine("readlink /mnt/vol/passwd || cat /mnt/vol/passwd"), "replaced");
  assert.equal((await content("DELETE", `path?${q("/rootlink")}`)).status, 204, "removing a symlink removes the link");
  assert.ok(statSync("/etc/passwd").isFile());
});

test("mode and owner out of bounds are refused; setuid bits set through the API do not make a setuid program anywhere", async () => {
  for (const mode of [-1, 0o10000, 1e20, 1.5]) {
    const r = await content("POST", `dir?${q("/m")}&mode=${mode}`);
    assert.equal(r.status, 400, `mode ${mode}: ${r.text}`);
  }
  for (const owner of ["uid=0", "gid=0", "uid=4294967296", "uid=-1"]) {
    const r = await content("PUT", `file?${q("/owned")}&${owner}`, { body: "x" });
    assert.equal(r.status, 400, `${owner}: ${r.text}`);
  }
  // Machine root compiles nothing here: a copy of the machine's own `id` made setuid through the API.
  await inMachine("cp /usr/bin/id /mnt/vol/id && chown 1000:1000 /mnt/vol/id");
  const set = await content("PATCH", `path?${q("/id")}`, { body: JSON.stringify({ mode: 0o4755 }) });
  assert.equal(set.status, 200, set.text);
  // The volume is bound nosuid into machines: the bit does not raise an unprivileged user to its owner.
  assert.equal((await inMachine("setpriv --reuid=65534 --regid=65534 --clear-groups /mnt/vol/id -u")).trim(), "65534");
});

test("concurrent forced replaces of one file leave one whole file and no upload remains", async () => {
  const bodies = Array.from({ length: 12 }, (_, i) => Buffer.alloc(64 * 1024, 65 + i));
  const results = await Promise.all(bodies.map((b) => content("PUT", `file?${q("/race/f")}&force=true`, { body: b })));
  for (const r of results) assert.equal(r.status, 201, r.text);
  const read = await request(`${k.url}/volumecontent/${volumeId}/file?${q("/race/f")}`, { headers: { authorization: `Bearer ${token}` } });
  const got = Buffer.from(await read.body.arrayBuffer());
  assert.ok(bodies.some((b) => b.equals(got)), "the file is one of the uploads, whole");
  assert.equal((await inMachine("ls -A /mnt/vol/race")).trim(), "f", "no .kiln-upload- temp file left");
});
