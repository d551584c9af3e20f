// A real PostgreSQL for tests: a database in KILN_TEST_DATABASE_URL when set, else a throwaway cluster from
// Debian's PostgreSQL binaries on a free loopback port, run as the postgres OS user (initdb refuses root).

import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, rmSync, chownSync } from "node:fs";
import { createServer } from "node:net";
import { join } from "node:path";
import pg from "pg";

function pgBin(name: string): string {
  const root = "/usr/lib/postgresql";
  const versions = existsSync(root) ? readdirSync(root).sort((a, b) => Number(b) - Number(a)) : [];
  for (const v of versions) if (existsSync(join(root, v, "bin", name))) return join(root, v, "bin", name);
  throw new Error(`PostgreSQL's ${name} was not found under ${root}: apt-get install postgresql (scripts/up.sh does)`);
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
    s.on("error", reject);
  });
}

export async function startPostgres(): Promise<{ url: string; stop(): Promise<void> }> {
  const external = process.env.KILN_TEST_DATABASE_URL;
  if (external) {
    const name = `kiln_test_${process.pid}_${Date.now()}`;
    const admin = new pg.Client({ connectionString: external });
    await admin.connect();
    await admin.query(`create database ${name}`);
    await admin.end();
    const url = new URL(external);
    url.pathname = `/${name}`;
    return {
      url: url.toString(),
      async stop() {
        const c = new pg.Client({ connectionString: external });
        await c.connect();
        await c.query(`drop database if exists ${name} with (force)`);
        await c.end();
      },
    };
  }
  const initdb = pgBin("initdb");
  const pgCtl = pgBin("pg_ctl");
  const dir = mkdtempSync("/tmp/kiln-pg-");
  const pw = execFileSync("getent", ["passwd", "postgres"], { encoding: "utf8" }).split(":");
  chownSync(dir, Number(pw[2]), Number(pw[3]));
  const asPostgres = (args: string[]) => {
    const r = spawnSync("runuser", ["-u", "postgres", "--", ...args], { encoding: "utf8" });
    if (r.status !== 0) throw new Error(`${args[0]} failed: ${r.stderr || r.stdout}`);
  };
  const port = await freePort();
  asPostgres([initdb, "-D", join(dir, "data"), "-A", "trust", "-U", "postgres", "--no-sync"]);
  asPostgres([pgCtl, "-D", join(dir, "data"), "-l", join(dir, "log"), "-w", "-o", `-c listen_addresses=127.0.0.1 -c port=${port} -k ${dir} -c fsync=off -c synchronous_commit=off -c full_page_writes=off`, "start"]);
  return {
    url: `postgres://postgres@127.0.0.1:${port}/postgres`,
    async stop() {
      try {
        asPostgres([pgCtl, "-D", join(dir, "data"), "-m", "immediate", "stop"]);
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
  };
}
