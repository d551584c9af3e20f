// `kiln machines cp <src> <dst>`, as `docker cp`: one side is `<machine id>:<path>`, the other a local path or `-`
// (stdin/stdout). Regular files, byte-exact and streamed both ways over the files API; a directory destination
// takes the source's name.

import { createReadStream, createWriteStream, statSync } from "node:fs";
import { basename, join, posix } from "node:path";
import { pipeline } from "node:stream/promises";
import { chmod } from "node:fs/promises";
import { request } from "undici";
import { fail } from "./client.ts";
import type { ApiClient } from "./client.ts";

interface MachinePath {
  machine: string;
  path: string;
}

/** `mch_…:/path` (or any `id:path` whose id has no `/`); a local path otherwise, as docker cp reads its arguments. */
export function parseCopyArg(arg: string): MachinePath | null {
  const m = /^([A-Za-z0-9_-]+):(.+)$/.exec(arg);
  return m ? { machine: m[1]!, path: m[2]! } : null;
}

async function envelope(res: { statusCode: number; body: { text(): Promise<string> } }, what: string): Promise<never> {
  const text = await res.body.text();
  let env: { code?: string; error?: string; request_id?: string } = {};
  try {
    env = JSON.parse(text);
  } catch {
    // not an envelope
  }
  fail(`${what}: ${env.code ?? res.statusCode}: ${env.error ?? text}${env.request_id ? ` (request ${env.request_id})` : ""}`);
}

async function call(client: ApiClient, method: "GET" | "PUT" | "POST", path: string, body?: NodeJS.ReadableStream | string, contentType?: string) {
  return request(client.baseUrl + path, {
    method,
    headers: { authorization: `Bearer ${client.key}`, ...(contentType ? { "content-type": contentType } : {}) },
    body: body as never,
  }).catch((err: Error) => fail(`cannot reach ${client.baseUrl}: ${err.message} (is \`kiln serve\` running?)`));
}

/** The machine path's metadata, or null when nothing is there. */
async function infoOf(client: ApiClient, at: MachinePath): Promise<{ is_dir: boolean; path: string; permissions: string } | null> {
  const res = await call(client, "POST", `/v1/machines/${encodeURIComponent(at.machine)}/files/info`, JSON.stringify({ path: at.path }), "application/json");
  if (res.statusCode === 404) {
    // A missing machine is an error; a missing path is an answer.
    const text = await res.body.text();
    const error = (JSON.parse(text || "{}") as { error?: string }).error ?? "";
    if (error.startsWith("No machine ")) fail(error);
    return null;
  }
  if (res.statusCode !== 200) return envelope(res, `${at.machine}:${at.path}`);
  return (await res.body.json()) as { is_dir: boolean; path: string; permissions: string };
}

export async function copy(client: ApiClient, src: string, dst: string): Promise<void> {
  const from = parseCopyArg(src);
  const to = parseCopyArg(dst);
  if (from && to) fail("kiln machines cp copies between a machine and here: one side is <machine id>:<path>, the other a local path or -");
  if (!from && !to) fail("kiln machines cp needs <machine id>:<path> on one side (as docker cp): kiln machines cp mch_…:/etc/hostname . or kiln machines cp ./a.bin mch_…:/workspace/");

  if (from) {
    // Machine → here.
    const info = await infoOf(client, from);
    if (!info) fail(`${src}: no such file in the machine`);
    if (info.is_dir) fail(`${src} is a directory: cp copies files (for a tree: kiln machines exec ${from.machine} -- tar -C DIR -c . > tree.tar)`);
    const res = await call(client, "GET", `/v1/machines/${encodeURIComponent(from.machine)}/files?path=${encodeURIComponent(info.path)}`);
    if (res.statusCode !== 200) return envelope(res, src);
    if (dst === "-") return pipeline(res.body, process.stdout);
    let target = dst;
    try {
      if (statSync(dst).isDirectory()) target = join(dst, posix.basename(info.path));
    } catch {
      // a new file
    }
    await pipeline(res.body, createWriteStream(target));
    // The machine's permissions, as docker cp keeps them (the CLI's private umask is for Kiln's own files).
    await chmod(target, parseInt(info.permissions, 8) & 0o7777);
    return;
  }

  // Here → machine.
  let mode: string | undefined;
  let name = "stdin";
  if (src !== "-") {
    let st;
    try {
      st = statSync(src);
    } catch (err) {
      fail(`${src}: ${(err as NodeJS.ErrnoException).code === "ENOENT" ? "no such file" : (err as Error).message}`);
    }
    if (st.isDirectory()) fail(`${src} is a directory: cp copies files (for a tree: tar -c … | kiln machines exec -i ${to!.machine} -- tar -C DIR -x)`);
    mode = (st.mode & 0o7777).toString(8).padStart(4, "0");
    name = basename(src);
  }
  let path = to!.path;
  if (path.endsWith("/")) path += name;
  else {
    const existing = await infoOf(client, to!);
    if (existing?.is_dir) path = posix.join(existing.path, name);
  }
  const q = new URLSearchParams({ path, ...(mode ? { mode } : {}) });
  const res = await call(client, "PUT", `/v1/machines/${encodeURIComponent(to!.machine)}/files?${q}`, src === "-" ? process.stdin : createReadStream(src), "application/octet-stream");
  if (res.statusCode !== 200) return envelope(res, dst);
  await res.body.dump();
}
