// What envd 0.6.2–0.6.4 adds, through the real `e2b` SDK against a real Kiln: file metadata written with the file
// and read back through getInfo/list, watch events carrying their entry (includeEntry), allowNetworkMounts.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { request } from "undici";
import { Sandbox, FilesystemEventType, CommandExitError } from "e2b";
import type { FilesystemEvent, SandboxOpts } from "e2b";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { generateKeyIn } from "../../src/keys/service.ts";

let k: TestKiln;
let opts: SandboxOpts;
let sbx: Sandbox;

before(async () => {
  k = await startTestKiln();
  const key = (await k.kiln.services.keys.create("e2b-envd064", generateKeyIn("e2b"))).key;
  opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
  sbx = await Sandbox.create("base", opts);
});
after(async () => k?.close());

function waitFor(events: FilesystemEvent[], pred: (e: FilesystemEvent) => boolean, what: string): Promise<FilesystemEvent> {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    const tick = () => {
      const hit = events.find(pred);
      if (hit) return resolve(hit);
      if (Date.now() - started > 10_000) return reject(new Error(`no ${what} in 10 s; got ${JSON.stringify(events)}`));
      setTimeout(tick, 25);
    };
    tick();
  });
}

test("Sandbox.create and connect report envd 0.6.4", async () => {
  assert.equal((sbx as unknown as { envdApi: { version: string } }).envdApi.version, "0.6.4");
  const again = await Sandbox.connect(sbx.sandboxId, opts);
  assert.equal((again as unknown as { envdApi: { version: string } }).envdApi.version, "0.6.4");
});

test("files.write with metadata stores it with the file: write, getInfo and list return it; a rename keeps it", async () => {
  // Keys travel as HTTP header names, which are case-insensitive: they come back lowercased.
  const [written] = await sbx.files.write([{ path: "meta/a.txt", data: "hello" }], { metadata: { Author: "kiln-test", "build.id": "b-42" } });
  const meta = { author: "kiln-test", "build.id": "b-42" };
  assert.deepEqual(written.metadata, meta);
  assert.deepEqual((await sbx.files.getInfo("meta/a.txt")).metadata, meta);
  const listed = await sbx.files.list("meta");
  assert.deepEqual(listed.find((e) => e.name === "a.txt")?.metadata, meta);
  await sbx.files.rename("meta/a.txt", "meta/b.txt");
  assert.deepEqual((await sbx.files.getInfo("meta/b.txt")).metadata, meta);
  // An octet-stream upload carries it too.
  const [streamed] = await sbx.files.write([{ path: "meta/c.txt", data: "x" }], { metadata: { k: "v" }, useOctetStream: true });
  assert.deepEqual(streamed.metadata, { k: "v" });
  assert.deepEqual((await sbx.files.getInfo("meta/c.txt")).metadata, { k: "v" });
  // A file written without metadata has none; rewriting one without metadata replaces it with a new file.
  await sbx.files.write("meta/plain.txt", "x");
  assert.equal((await sbx.files.getInfo("meta/plain.txt")).metadata, undefined);
  await sbx.files.write("meta/b.txt", "new");
  assert.equal((await sbx.files.getInfo("meta/b.txt")).metadata, undefined);
});

test("file metadata is the file's user.e2b.* xattrs, as envd stores it: set inside the sandbox it is surfaced, written through files.write it is readable there", async () => {
  await sbx.files.write("xattr/set-inside.txt", "x");
  // A program in the sandbox sets metadata the way envd keeps it; other user.* attributes are not metadata.
  const set = await sbx.commands
    .run(`python3 -c "import os; p='xattr/set-inside.txt'; os.setxattr(p, 'user.e2b.origin', b'inside'); os.setxattr(p, 'user.other', b'not-metadata'); os.setxattr(p, 'user.e2b.bin', bytes([0xff, 0xfe]))"`)
    .catch((err: CommandExitError) => err);
  if (process.env.KILN_OCI_RUNTIME === "runsc") {
    // gVisor's root keeps no user xattrs (docs/e2b.md): the sandbox cannot set them, and Kiln keeps written metadata
    // in its records instead (the test above).
    assert.match(set.stderr, /Errno 95/);
    return;
  }
  assert.equal(set.exitCode, 0, set.stderr);
  // A value that is not UTF-8 is skipped, as envd does.
  assert.deepEqual((await sbx.files.getInfo("xattr/set-inside.txt")).metadata, { origin: "inside" });
  assert.deepEqual((await sbx.files.list("xattr")).find((e) => e.name === "set-inside.txt")?.metadata, { origin: "inside" });
  // What files.write stores is there for the sandbox's own tools.
  await sbx.files.write("xattr/written.txt", "y", { metadata: { owner: "kiln" } });
  const read = await sbx.commands.run(`python3 -c "import os; print(sorted(a for a in os.listxattr('xattr/written.txt')), os.getxattr('xattr/written.txt', 'user.e2b.owner').decode())"`);
  assert.equal(read.stdout.trim(), "['user.e2b.owner'] kiln");
  // A symlink shows its target's metadata (envd reads it through the link).
  await sbx.commands.run("ln -s written.txt xattr/link");
  assert.deepEqual((await sbx.files.getInfo("xattr/link")).metadata, { owner: "kiln" });
  // What the sandbox sets beyond the 4 KiB envd allows a write is not surfaced past that budget.
  // (Each set may fail once the filesystem's own xattr space is full: what was set is what counts.)
  await sbx.commands.run(`python3 -c "
import os
for i in range(8):
    try: os.setxattr('xattr/set-inside.txt', 'user.e2b.k%02d' % i, b'v' * 1000)
    except OSError: pass"`);
  const surfaced = (await sbx.files.getInfo("xattr/set-inside.txt")).metadata ?? {};
  const bytes = Object.entries(surfaced).reduce((n, [key, v]) => n + "user.e2b.".length + key.length + v.length, 0);
  assert.ok(bytes <= 4096 && Object.keys(surfaced).length >= 1, `surfaced ${bytes} bytes: ${JSON.stringify(Object.keys(surfaced))}`);
});

test("metadata keys follow envd's bounds: a key past 246 bytes is refused, a repeated header keeps its first value", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  const headers = { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token, "content-type": "application/octet-stream" };
  const long = await request(`${k.url}/files?path=/tmp/longkey.txt`, { method: "POST", headers: { ...headers, [`x-metadata-${"k".repeat(247)}`]: "v" }, body: "x" });
  assert.equal(long.statusCode, 400);
  await long.body.dump();
  assert.equal(await sbx.files.exists("/tmp/longkey.txt"), false);
  const ok = await request(`${k.url}/files?path=/tmp/okkey.txt`, { method: "POST", headers: { ...headers, [`x-metadata-${"k".repeat(246)}`]: "v", "x-metadata-__proto__": "p" }, body: "x" });
  assert.equal(ok.statusCode, 200);
  const [entry] = (await ok.body.json()) as { metadata?: Record<string, string> }[];
  assert.deepEqual(entry.metadata, { ["k".repeat(246)]: "v", ["__proto__"]: "p" });
});

test("bad or oversized metadata headers are refused and write nothing", async () => {
  const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
  for (const header of [{ "x-metadata-k": "caf\u00e9" }, { "x-metadata-big": "v".repeat(5000) }]) {
    const res = await request(`${k.url}/files?path=/tmp/badmeta.txt`, {
      method: "POST",
      headers: { "e2b-sandbox-id": sbx.sandboxId, "x-access-token": token, "content-type": "application/octet-stream", ...header },
      body: "x",
    });
    assert.equal(res.statusCode, 400, JSON.stringify(Object.keys(header)));
    await res.body.dump();
    assert.equal(await sbx.files.exists("/tmp/badmeta.txt"), false);
  }
});

test("files.watchDir with includeEntry gives each event the entry's info; a removed file's event has none", async () => {
  await sbx.files.makeDir("entries");
  const events: FilesystemEvent[] = [];
  const handle = await sbx.files.watchDir("entries", (e) => void events.push(e), { includeEntry: true });
  await sbx.files.write("entries/e.txt", "12345", { metadata: { tag: "watched" } });
  const created = await waitFor(events, (e) => e.name === "e.txt" && e.type === FilesystemEventType.CREATE, "create of e.txt");
  assert.ok(created.entry, "a created file's event carries its entry");
  assert.equal(created.entry.name, "e.txt");
  assert.equal(created.entry.path, `${(await sbx.files.getInfo("entries")).path}/e.txt`);
  assert.equal(created.entry.type, "file");
  assert.equal(created.entry.size, 5);
  assert.deepEqual(created.entry.metadata, { tag: "watched" });
  await sbx.files.remove("entries/e.txt");
  const removed = await waitFor(events, (e) => e.name === "e.txt" && e.type === FilesystemEventType.REMOVE, "remove of e.txt");
  assert.equal(removed.entry, undefined);
  await handle.stop();
  // Without includeEntry events carry no entry.
  const plain: FilesystemEvent[] = [];
  const h2 = await sbx.files.watchDir("entries", (e) => void plain.push(e));
  await sbx.files.write("entries/f.txt", "x");
  const e2 = await waitFor(plain, (e) => e.name === "f.txt", "event of f.txt");
  assert.equal(e2.entry, undefined);
  await h2.stop();
});

test("files.watchDir accepts allowNetworkMounts and watches as before", async () => {
  await sbx.files.makeDir("/tmp/netmount");
  const events: FilesystemEvent[] = [];
  const handle = await sbx.files.watchDir("/tmp/netmount", (e) => void events.push(e), { allowNetworkMounts: true, includeEntry: true });
  await sbx.commands.run("echo hi > /tmp/netmount/n.txt");
  const e = await waitFor(events, (x) => x.name === "n.txt" && x.type === FilesystemEventType.CREATE, "create of n.txt");
  assert.equal(e.entry?.path, "/tmp/netmount/n.txt");
  await handle.stop();
});
