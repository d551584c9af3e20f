// Users and groups as the machine itself knows them: parsed from its own /etc/passwd and /etc/group,
// re-read only when those files change.

import { statSync, readFileSync } from "node:fs";
import type { UserInfo } from "./protocol.ts";

interface Table<T> {
  mtimeMs: number;
  size: number;
  rows: T[];
}

const cache = new Map<string, Table<string[]>>();

function readTable(file: string): string[][] {
  let st;
  try {
    st = statSync(file);
  } catch {
    return [];
  }
  const hit = cache.get(file);
  if (hit && hit.mtimeMs === st.mtimeMs && hit.size === st.size) return hit.rows;
  const rows = readFileSync(file, "utf8")
    .split("\n")
    .filter((l) => l && !l.startsWith("#"))
    .map((l) => l.split(":"));
  cache.set(file, { mtimeMs: st.mtimeMs, size: st.size, rows });
  return rows;
}

/** A user by name (or, failing that, by numeric uid). Root exists even in a rootfs whose passwd forgot it. */
export function lookupUser(name: string): UserInfo | undefined {
  const rows = readTable("/etc/passwd");
  const row = rows.find((r) => r[0] === name) ?? (/^\d+$/.test(name) ? rows.find((r) => r[2] === name) : undefined);
  if (!row) return name === "root" || name === "0" ? { name: "root", uid: 0, gid: 0, home: "/root", shell: "/bin/sh" } : undefined;
  return { name: row[0], uid: Number(row[2]), gid: Number(row[3]), home: row[5] || "/", shell: row[6] || "/bin/sh" };
}

export function userName(uid: number): string {
  return readTable("/etc/passwd").find((r) => Number(r[2]) === uid)?.[0] ?? String(uid);
}

export function groupName(gid: number): string {
  return readTable("/etc/group").find((r) => Number(r[2]) === gid)?.[0] ?? String(gid);
}
