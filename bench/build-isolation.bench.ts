// What confining Dockerfile builds costs: a small Dockerfile (FROM a loopback-registry image, two RUN steps, a COPY)
// built by Kiln in its sandbox (own user/network namespaces, slirp4netns, egress cgroups, a reaper, the runtime shim
// on each RUN) beside the same Dockerfile built by `buildah bud --isolation chroot` — Kiln's former, unconfined way —
// run directly; and the sandbox's own setup and teardown alone.

import { spawnSync } from "node:child_process";
import { chmod, mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { buildDockerfile } from "../src/builder/backends/buildkit.ts";
import { openSandbox } from "../src/builder/backends/isolation/sandbox.ts";
import { createEgress } from "../src/runtime/oci/egress.ts";
import { pushImage, startRegistry } from "../test/support/oci-registry.ts";
import { busyboxAvailable, busyboxRootfs } from "../test/support/mini-rootfs.ts";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const RUNS = 5;

function time(fn: () => unknown): number {
  const t = performance.now();
  fn();
  return performance.now() - t;
}

export async function run(_ctx: BenchContext): Promise<BenchResult[]> {
  for (const cmd of ["docker-registry", "buildah", "slirp4netns", "nft"]) {
    if (spawnSync("sh", ["-c", `command -v ${cmd}`]).status !== 0) {
      process.stderr.write(`  build-isolation bench skipped: ${cmd} is not installed\n`);
      return [];
    }
  }
  if (!busyboxAvailable()) return [];
  const reg = await startRegistry();
  const dir = await mkdtemp(join(tmpdir(), "kiln-build-isolation-bench-"));
  await chmod(dir, 0o755);
  try {
    await pushImage(reg, "bench/busybox", "1", { layers: [{ entries: busyboxRootfs() }] });
    const ctx = join(dir, "ctx");
    await mkdir(ctx);
    await writeFile(join(ctx, "app.txt"), "app\n");
    await writeFile(join(ctx, "Dockerfile"), `FROM ${reg.host}/bench/busybox:1\nARG N=1\nRUN echo "$N" > /n\nCOPY app.txt /app.txt\nRUN wc -c /app.txt > /size\n`);
    const conf = join(dir, "registries.conf");
    await writeFile(conf, `[[registry]]\nlocation = "${reg.host}"\ninsecure = true\n`);
    const egress = createEgress();
    const kilnTimes: number[] = [];
    const chrootTimes: number[] = [];
    const sandboxTimes: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      const t = performance.now();
      await buildDockerfile({ contextDir: ctx, cacheDir: join(dir, `bcache-${i}`), scratchParent: join(dir, "scratch"), insecureRegistries: [reg.host], buildArgs: { N: String(i) }, egress });
      kilnTimes.push(performance.now() - t);
      await rm(join(dir, `bcache-${i}`), { recursive: true, force: true });

      const root = join(dir, `bud-${i}`);
      chrootTimes.push(
        time(() =>
          spawnSync("buildah", ["--root", join(root, "root"), "--runroot", join(root, "run"), "--storage-driver", "vfs", "--userns-uid-map", "0:100000:65536", "--userns-gid-map", "0:100000:65536", "bud", "--isolation", "chroot", "--layers=false", "-q", "-t", "bench", ctx], {
            env: { ...process.env, CONTAINERS_REGISTRIES_CONF: conf, TMPDIR: dir },
          }),
        ),
      );
      await rm(root, { recursive: true, force: true });

      const state = join(dir, `state-${i}`);
      await mkdir(state, { mode: 0o700 });
      const s = performance.now();
      const sandbox = await openSandbox({ key: `bld-bench-${i}`, stateDir: state, internet: true, hostAccess: false, vcpus: 1, memoryMb: 512, fetchAllow: [], egress });
      await sandbox.close();
      sandboxTimes.push(performance.now() - s);
      await rm(state, { recursive: true, force: true });
    }
    return [
      {
        name: "small Dockerfile build (2 RUN, 1 COPY) in Kiln's build sandbox, end to end (bud + push + import)",
        unit: "ms",
        better: "lower",
        median: median(kilnTimes),
        baseline: { name: "buildah bud --isolation chroot of the same Dockerfile (unconfined, Kiln's former way)", median: median(chrootTimes) },
      },
      {
        name: "a build sandbox made and removed (namespaces, slirp4netns, 2 egress cgroups + rules, cgroups, reaper)",
        unit: "ms",
        better: "lower",
        median: median(sandboxTimes),
        note: "paid once per Dockerfile build; each RUN step also pays the runtime shim (a Node start, ≈ 0.1 s) before runc",
      },
    ];
  } finally {
    await reg.stop();
    await rm(dir, { recursive: true, force: true });
  }
}
