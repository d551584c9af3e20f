// A real PostgreSQL for tests: a fresh database in KILN_TEST_DATABASE_URL when set, else a throwaway cluster from
// Debian's PostgreSQL binaries on a free loopback port, run as the postgres OS user when we are root (initdb refuses root).

import { execFileSync, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { chownSync, existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import pg from "pg";
import { freePort } from "./net.ts";

export interface TestPostgres {
  url: string;
  stop(): Promise<void>;
}

function pgBin(name: string): string {
  const root = "/usr/lib/postgresql";
  const versions = existsSync(root) ? readdirSync(root).sort((a, b) => Number(b) - Number(a)) : [];
  for (const v of versions) if (existsSync(join(root, v, "bin", name))) return join(root, v, "bin", name);
  throw new Error(
    `PostgreSQL's ${name} was not found under ${root}: the store suite runs on PostgreSQL too and is not skipped. ` +
      "Install it (apt-get install -y postgresql) or point KILN_TEST_DATABASE_URL at a server the tests may create databases in.",
  );
}

async function inExternalServer(adminUrl: string): Promise<TestPostgres> {
  const name = `kiln_test_${randomBytes(6).toString("hex")}`;
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  try {
    await admin.query(`create database ${name}`);
  } finally {
    await admin.end();
  }
  const url = new URL(adminUrl);
  url.pathname = `/${name}`;
  return {
    url: url.toString(),
    async stop() {
      const c = new pg.Client({ connectionString: adminUrl });
      await c.connect();
      try {
        await c.query(`drop database if exists ${name} with (force)`);
      } finally {
        await c.end();
      }
    },
  };
}

export async function startPostgres(): Promise<TestPostgres> {
  const external = process.env.KILN_TEST_DATABASE_URL;
  if (external) return inExternalServer(external);

  const initdb = pgBin("initdb");
  const pgCtl = pgBin("pg_ctl");
  const asRoot = process.getuid?.() === 0;
  // A short path: the socket path (dir + "/.s.PGSQL.<port>") must fit in 107 bytes.
  const dir = mkdtempSync("/tmp/kiln-pg-");
  const data = join(dir, "data");
  if (asRoot) {
    const pw = execFileSync("getent", ["passwd", "postgres"], { encoding: "utf8" }).split(":");
    chownSync(dir, Number(pw[2]), Number(pw[3]));
  }
  const run = (args: string[]) => {
    const [cmd, argv] = asRoot ? ["runuser", ["-u", "postgres", "--", ...args]] : [args[0], args.slice(1)];
    const r = spawnSync(cmd, argv, { encoding: "utf8", env: { ...process.env, LC_ALL: "C", LANG: "C" } });
    if (r.status !== 0) {
      let log = "";
      try {
        log = readFileSync(join(dir, "log"), "utf8").slice(-2000);
      } catch {
        // no server log yet
      }
      throw new Error(`${args[0]} ${args.at(-1)} failed: ${r.error?.message ?? ""}${r.stderr || r.stdout}${log}`);
    }
  };
  const stopNow = () => {
    try {
      if (existsSync(join(data, "postmaster.pid"))) run([pgCtl, "-D", data, "-m", "immediate", "stop"]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  };
  // A test process that dies without calling stop() still takes its cluster with it (SIGKILL excepted).
  process.once("exit", stopNow);
  try {
    run([initdb, "-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "--no-locale", "-E", "UTF8"]);
    // The free port can be taken between probing and binding; a couple of tries make that race harmless.
    let port = 0;
    for (let attempt = 1; ; attempt++) {
      port = await freePort();
      const opts = `-c listen_addresses=127.0.0.1 -c port=${port} -k ${dir} -c fsync=off -c synchronous_commit=off -c full_page_writes=off`;
      try {
        run([pgCtl, "-D", data, "-l", join(dir, "log"), "-w", "-t", "30", "-o", opts, "start"]);
        break;
      } catch (err) {
        if (attempt >= 3) throw err;
      }
    }
    return {
      url: `postgres://postgres@127.0.0.1:${port}/postgres`,
      async stop() {
        process.removeListener("exit", stopNow);
        stopNow();
      },
    };
  } catch (err) {
    process.removeListener("exit", stopNow);
    stopNow();
    throw err;
  }
}

/** One query on its own connection (tests reading what the servers of a cluster wrote). */
export async function query<T>(url: string, text: string, params: unknown[] = []): Promise<T[]> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return (await client.query(text, params)).rows as T[];
  } finally {
    await client.end();
  }
}
