// Moving a volume between hosts, measured in one run: two servers in this process on one real PostgreSQL, a 256 MiB
// volume holding 64 MiB of random data moved from one to the other and back (hash, stream between the servers,
// digest check and sparse write on the target, record switch, old copy removed), beside a plain sparse copy of the
// same image on the same disk (`cp --sparse=always`): what any move must at least pay.

import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { request } from "undici";
import { api } from "./api.ts";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import type { TestKiln } from "../test/support/kiln.ts";
import { withCluster } from "./cluster.ts";

const exec = promisify(execFile);
const ROUNDS = 6;
const SIZE_MB = 256;
const DATA_MB = 64;

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  return withCluster(2, {}, async ([a, b]) => {
    const hostOf = (s: TestKiln) => s.kiln.services.hosts.hostId;
    const vol = await api(a.url, ctx.key, "POST", "/v1/volumes", { name: "bench-move", size_mb: SIZE_MB });
    const put = await request(`${a.url}/v1/volumes/${vol.id}/files?path=/data.bin`, { method: "PUT", headers: { authorization: `Bearer ${ctx.key}`, "content-type": "application/octet-stream" }, body: randomBytes(DATA_MB * 1024 * 1024) });
    if (put.statusCode !== 200) throw new Error(`volume-move bench: upload answered ${put.statusCode} ${await put.body.text()}`);
    await put.body.dump();
    const moves: number[] = [];
    const copies: number[] = [];
    let at = a;
    for (let i = 0; i < ROUNDS; i++) {
      // Baseline: a sparse copy of the image where it is now (its mount released first, as a move does).
      const image = join(at.dataDir, "volumes", vol.id, "image.ext4");
      const copy = join(at.dataDir, `bench-copy-${i}.img`);
      let t0 = performance.now();
      await exec("cp", ["--sparse=always", image, copy]);
      copies.push(performance.now() - t0);
      await rm(copy, { force: true });
      const to = at === a ? b : a;
      t0 = performance.now();
      const moved = await api(a.url, ctx.key, "POST", `/v1/volumes/${vol.id}/move`, { host_id: hostOf(to) });
      moves.push(performance.now() - t0);
      if (moved.host_id !== hostOf(to)) throw new Error(`volume-move bench: moved to ${moved.host_id}, not ${hostOf(to)}`);
      at = to;
    }
    await api(a.url, ctx.key, "DELETE", `/v1/volumes/${vol.id}`).catch(() => undefined);
    return [
      {
        name: `moving an unmounted ${SIZE_MB} MiB volume (${DATA_MB} MiB written) to another host`,
        unit: "ms",
        better: "lower",
        median: median(moves),
        baseline: { name: "a sparse copy of the same image on the same disk (cp --sparse=always)", median: median(copies) },
        note: `${ROUNDS} moves, alternating between two servers in one process on one PostgreSQL`,
      },
    ];
  });
}
