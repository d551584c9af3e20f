// The guest agent's file routes through agent-client: binary-safe round trips, metadata in SPEC.md's words
// (mode, permissions, type from lstat, owner/group names from the machine's files), list depth, mkdir -p,
// remove, move, and clear errors for missing paths and directories.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Readable } from "node:stream";
import { chmod, chown, mkdir, stat, symlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { AgentError } from "../../src/runtime/agent-client.ts";
import { startAgent, ALL_BYTES } from "./support.ts";
import type { TestAgent } from "./support.ts";

let agent: TestAgent;
let root: string;
before(async () => {
  agent = await startAgent();
  root = join(agent.dir, "fs");
  await mkdir(root);
});
after(() => agent?.stop());

const rejectsWith = (p: Promise<unknown>, code: string, status: number) =>
  assert.rejects(p, (err: unknown) => err instanceof AgentError && err.code === code && err.status === status);

test("every byte value survives a write and a read, from a Buffer and from a stream", async () => {
  const path = join(root, "bytes.bin");
  const info = await agent.client.writeFile(path, ALL_BYTES, { mode: "0640" });
  assert.equal(info.size, 256);
  assert.equal(info.permissions, "0640");
  assert.deepEqual(await agent.client.readFileBytes(path), ALL_BYTES);
  await agent.client.writeFile(path, Readable.from([ALL_BYTES, ALL_BYTES]));
  const chunks: Buffer[] = [];
  for await (const c of await agent.client.readFile(path)) chunks.push(c as Buffer);
  assert.deepEqual(Buffer.concat(chunks), Buffer.concat([ALL_BYTES, ALL_BYTES]));
  assert.equal((await agent.client.info(path)).permissions, "0640", "an overwrite keeps the mode");
});

test("a write as a user makes missing parents owned by that user; an overwrite without one keeps the owner", async () => {
  const path = join(root, "by-nobody/a/b/file.txt");
  const info = await agent.client.writeFile(path, Buffer.from("hi"), { user: "nobody" });
  assert.equal(info.owner, "nobody");
  assert.equal((await agent.client.info(join(root, "by-nobody/a"))).owner, "nobody");
  assert.equal((await stat(join(root, "by-nobody"))).uid, 65534);
  const again = await agent.client.writeFile(path, Buffer.from("again"));
  assert.equal(again.owner, "nobody");
});

test("file info: mode is the full st_mode, permissions four octal digits, type from lstat, symlinks not followed", async () => {
  const file = join(root, "info.txt");
  await writeFile(file, "12345");
  await chmod(file, 0o644);
  const f = await agent.client.info(file);
  assert.deepEqual(
    { name: f.name, path: f.path, is_dir: f.is_dir, size: f.size, type: f.type, mode: f.mode, permissions: f.permissions, owner: f.owner, group: f.group },
    { name: "info.txt", path: file, is_dir: false, size: 5, type: "file", mode: "100644", permissions: "0644", owner: "root", group: "root" },
  );
  assert.match(f.modified_time, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
  assert.equal(f.symlink_target, undefined);

  const dir = join(root, "info-dir");
  await mkdir(dir, { mode: 0o755 });
  await chmod(dir, 0o755);
  const d = await agent.client.info(dir);
  assert.equal(d.type, "directory");
  assert.equal(d.is_dir, true);
  assert.equal(d.mode, "40755");
  assert.equal(d.permissions, "0755");

  const link = join(root, "info-link");
  await symlink("/no/such/target", link);
  const l = await agent.client.info(link);
  assert.equal(l.type, "symlink");
  assert.equal(l.mode, "120777");
  assert.equal(l.symlink_target, "/no/such/target");
  assert.equal(l.is_dir, false);

  await chmod(file, 0o4755);
  assert.equal((await agent.client.info(file)).permissions, "4755");
  await chown(file, 65534, 65534);
  const named = await agent.client.info(file);
  assert.equal(named.owner, "nobody");
  await chown(file, 54321, 54321);
  const unmapped = await agent.client.info(file);
  assert.equal(unmapped.owner, "54321");
  assert.equal(unmapped.group, "54321");
});

test("list returns direct children at depth 1 and descends with a larger depth", async () => {
  const base = join(root, "tree");
  await mkdir(join(base, "a/b/c"), { recursive: true });
  await writeFile(join(base, "top.txt"), "");
  await writeFile(join(base, "a/b/deep.txt"), "");
  const one = (await agent.client.list(base, 1)).entries.map((e) => e.path.slice(base.length + 1));
  assert.deepEqual(one, ["a", "top.txt"]);
  const three = (await agent.client.list(base, 3)).entries.map((e) => e.path.slice(base.length + 1)).sort();
  assert.deepEqual(three, ["a", "a/b", "a/b/c", "a/b/deep.txt", "top.txt"]);
  const entry = (await agent.client.list(base, 1)).entries[0];
  assert.equal(entry.type, "directory");
  await rejectsWith(agent.client.list(join(base, "top.txt"), 1), "invalid_request", 400);
  await rejectsWith(agent.client.list(join(base, "missing"), 1), "not_found", 404);
  await rejectsWith(agent.client.list(base, 0), "invalid_request", 400);
});

test("mkdir -p makes every missing parent with the mode and owner asked, and accepts an existing directory", async () => {
  const path = join(root, "mk/x/y");
  const info = await agent.client.mkdir(path, { mode: "0750", user: "nobody" });
  assert.equal(info.type, "directory");
  assert.equal(info.permissions, "0750");
  assert.equal(info.owner, "nobody");
  assert.equal((await agent.client.info(join(root, "mk"))).owner, "nobody");
  await agent.client.mkdir(path);
  await writeFile(join(root, "mk/file"), "");
  await rejectsWith(agent.client.mkdir(join(root, "mk/file/sub")), "invalid_request", 400);
});

test("remove: files, empty dirs, non-empty dirs only when recursive, missing paths 404", async () => {
  const dir = join(root, "rm");
  await mkdir(join(dir, "full"), { recursive: true });
  await mkdir(join(dir, "empty"));
  await writeFile(join(dir, "full/f"), "x");
  await rejectsWith(agent.client.remove(join(dir, "full"), false), "invalid_request", 400);
  assert.deepEqual(await agent.client.remove(join(dir, "full/f"), false), { removed: true });
  await agent.client.remove(join(dir, "empty"), false);
  await writeFile(join(dir, "full/f"), "x");
  await agent.client.remove(join(dir, "full"), true);
  await rejectsWith(agent.client.info(join(dir, "full")), "not_found", 404);
  await rejectsWith(agent.client.remove(join(dir, "full"), true), "not_found", 404);
});

test("move renames, making the destination's parents", async () => {
  const src = join(root, "mv-src.txt");
  await writeFile(src, "moved");
  const info = await agent.client.move(src, join(root, "mv/deeper/dest.txt"));
  assert.equal(info.path, join(root, "mv/deeper/dest.txt"));
  assert.equal(info.size, 5);
  await rejectsWith(agent.client.info(src), "not_found", 404);
  await rejectsWith(agent.client.move(src, join(root, "elsewhere")), "not_found", 404);
});

test("reading a missing path is 404, a directory 400, a relative path 400", async () => {
  await rejectsWith(agent.client.readFile(join(root, "nope")), "not_found", 404);
  await rejectsWith(agent.client.readFile(root), "invalid_request", 400);
  await rejectsWith(agent.client.readFile("relative/path"), "invalid_request", 400);
  await rejectsWith(agent.client.info("relative"), "invalid_request", 400);
  await rejectsWith(agent.client.writeFile(root, Buffer.from("x")), "invalid_request", 400);
  await rejectsWith(agent.client.writeFile(join(root, "bad-mode"), Buffer.from("x"), { mode: "rwx" }), "invalid_request", 400);
});

test("the keep-alive connection stays usable after an error answer", async () => {
  for (let i = 0; i < 5; i++) {
    await rejectsWith(agent.client.info(join(root, "nope")), "not_found", 404);
    assert.equal((await agent.client.health()).ok, true);
  }
});
