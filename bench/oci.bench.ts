// Image import and Dockerfile builds: a ~100 MB multi-layer image pulled from a loopback registry and unpacked
// (MB/s beside `skopeo copy` of the same image to a local dir, and beside skopeo + tar doing the same work), an
// image of 20,000 small files, a warm re-import with every layer cached, and a small Dockerfile build end to end
// beside `buildah bud` of the same Dockerfile run directly.

import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { chmod, mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { importImage } from "../src/builder/oci/import.ts";
import { buildDockerfile } from "../src/builder/backends/buildkit.ts";
import { pushImage, startRegistry } from "../test/support/oci-registry.ts";
import type { TarEntry } from "../test/support/oci-registry.ts";
import { shellRootfs } from "../test/support/mini-rootfs.ts";
import { median } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";

const RUNS = 3;

/** A layer of many files of base64 text (compressible about as much as binaries and libraries are). */
function bulkLayer(layer: number, bytes: number): TarEntry[] {
  const entries: TarEntry[] = [{ name: `data${layer}/`, type: "directory" }];
  let total = 0;
  for (let i = 0; total < bytes; i++) {
    const size = i % 10 === 0 ? 1 << 20 : 16 << 10;
    entries.push({ name: `data${layer}/f${i}`, content: randomBytes((size * 3) >> 2).toString("base64") });
    total += size;
  }
  return entries;
}

/** A layer of many small source-like files (what interpreters' and package managers' images are mostly made of). */
function smallFilesLayer(layer: number, files: number): TarEntry[] {
  const entries: TarEntry[] = [];
  for (let d = 0; d < files / 100; d++) {
    entries.push({ name: `lib${layer}/pkg${d}/`, type: "directory" });
    for (let i = 0; i < 100; i++) entries.push({ name: `lib${layer}/pkg${d}/m${i}.py`, content: randomBytes(768 + ((i * 37) % 1536)).toString("base64") });
  }
  return entries;
}

/** The same work as an import, by skopeo and tar: copy to a dir, then `tar -xzf` of each layer, in parallel. */
function skopeoAndTar(host: string, image: string, out: string): { copy: number; total: number } {
  const copy = time(() => spawnSync("skopeo", ["copy", "-q", "--src-tls-verify=false", `docker://${host}/${image}`, `dir:${out}`]));
  const unpack = `for f in ${out}/*; do case "$(head -c2 "$f" | od -An -tx1)" in *1f*8b*) mkdir -p "$f.d" && tar -xzf "$f" -C "$f.d" & ;; esac; done; wait`;
  return { copy, total: copy + time(() => spawnSync("sh", ["-c", unpack])) };
}

function time(fn: () => unknown): number {
  const t = performance.now();
  fn();
  return performance.now() - t;
}

export async function run(_ctx: BenchContext): Promise<BenchResult[]> {
  for (const cmd of ["docker-registry", "skopeo", "buildah"]) {
    if (spawnSync("sh", ["-c", `command -v ${cmd}`]).status !== 0) {
      process.stderr.write(`  oci bench skipped: ${cmd} is not installed\n`);
      return [];
    }
  }
  const reg = await startRegistry();
  const dir = await mkdtemp(join(tmpdir(), "kiln-oci-bench-"));
  await chmod(dir, 0o755);
  try {
    const layers = [0, 1, 2, 3].map((i) => ({ entries: bulkLayer(i, 33 << 20), compression: "gzip" as const }));
    await pushImage(reg, "bench/big", "v1", { layers });
    const sizeOut = spawnSync("skopeo", ["inspect", "--tls-verify=false", "--raw", `docker://${reg.host}/bench/big:v1`]).stdout.toString();
    const bytes = (JSON.parse(sizeOut).layers as { size: number }[]).reduce((n, l) => n + l.size, 0);
    const mb = bytes / 1e6;

    const kilnTimes: number[] = [];
    const skopeoTimes: number[] = [];
    const skopeoTarTimes: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      const cache = join(dir, `cache-${i}`);
      const t = performance.now();
      await importImage(`${reg.host}/bench/big:v1`, { cacheDir: cache, insecureRegistries: [reg.host] });
      kilnTimes.push(performance.now() - t);
      if (i < RUNS - 1) await rm(cache, { recursive: true, force: true });
      const out = join(dir, `skopeo-${i}`);
      const st = skopeoAndTar(reg.host, "bench/big:v1", out);
      skopeoTimes.push(st.copy);
      skopeoTarTimes.push(st.total);
      await rm(out, { recursive: true, force: true });
    }
    // An image of 20,000 small files in 2 layers: what per-file costs bound, where the big image is bound by bytes.
    await pushImage(reg, "bench/small", "v1", { layers: [0, 1].map((i) => ({ entries: smallFilesLayer(i, 10_000), compression: "gzip" as const })) });
    const smallTimes: number[] = [];
    const smallBaseline: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      const cache = join(dir, `small-${i}`);
      const t = performance.now();
      await importImage(`${reg.host}/bench/small:v1`, { cacheDir: cache, insecureRegistries: [reg.host] });
      smallTimes.push(performance.now() - t);
      await rm(cache, { recursive: true, force: true });
      const out = join(dir, `skopeo-small-${i}`);
      smallBaseline.push(skopeoAndTar(reg.host, "bench/small:v1", out).total);
      await rm(out, { recursive: true, force: true });
    }
    const warmTimes: number[] = [];
    for (let i = 0; i < 10; i++) {
      const t = performance.now();
      await importImage(`${reg.host}/bench/big:v1`, { cacheDir: join(dir, `cache-${RUNS - 1}`), insecureRegistries: [reg.host] });
      warmTimes.push(performance.now() - t);
    }
    await rm(join(dir, `cache-${RUNS - 1}`), { recursive: true, force: true });

    await pushImage(reg, "bench/shell", "v1", { layers: [{ entries: shellRootfs() }] });
    const ctx = join(dir, "ctx");
    await mkdir(ctx);
    await writeFile(join(ctx, "app.txt"), "app\n");
    await writeFile(join(ctx, "Dockerfile"), `FROM ${reg.host}/bench/shell:v1\nARG N=1\nRUN echo "$N" > /n\nCOPY app.txt /app.txt\n`);
    const conf = join(dir, "registries.conf");
    await writeFile(conf, `[[registry]]\nlocation = "${reg.host}"\ninsecure = true\n`);
    const buildTimes: number[] = [];
    const budTimes: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      const t = performance.now();
      await buildDockerfile({ contextDir: ctx, cacheDir: join(dir, `bcache-${i}`), scratchParent: join(dir, "scratch"), insecureRegistries: [reg.host] });
      buildTimes.push(performance.now() - t);
      const root = join(dir, `bud-${i}`);
      budTimes.push(
        time(() =>
          spawnSync("buildah", ["--root", join(root, "root"), "--runroot", join(root, "run"), "--storage-driver", "vfs", "--userns-uid-map", "0:100000:65536", "--userns-gid-map", "0:100000:65536", "bud", "--isolation", "chroot", "--layers=false", "-q", "-t", "bench", ctx], {
            env: { ...process.env, CONTAINERS_REGISTRIES_CONF: conf, TMPDIR: dir },
          }),
        ),
      );
      await rm(root, { recursive: true, force: true });
    }
    return [
      {
        name: `import of a ${mb.toFixed(0)} MB 4-layer gzip image from a loopback registry (download, verify, unpack)`,
        unit: "MB/s",
        better: "higher",
        median: mb / (median(kilnTimes) / 1000),
        baseline: { name: "skopeo copy of the same image to a local dir (download, verify)", median: mb / (median(skopeoTimes) / 1000) },
        goal: "≥ 0.8 × skopeo",
      },
      {
        name: `import of the same ${mb.toFixed(0)} MB image, beside the same work done by skopeo and tar`,
        unit: "MB/s",
        better: "higher",
        median: mb / (median(kilnTimes) / 1000),
        baseline: { name: "skopeo copy to a dir, then tar -xzf of each layer (in parallel)", median: mb / (median(skopeoTarTimes) / 1000) },
        note: "skopeo copy alone does not decompress or unpack: the import is bound by gunzip and file writes on this host's 2 cores",
      },
      {
        name: "import of a 20,000-file image (2 gzip layers of 1–3 KB files) from a loopback registry",
        unit: "ms",
        better: "lower",
        median: median(smallTimes),
        baseline: { name: "skopeo copy to a dir, then tar -xzf of each layer (in parallel)", median: median(smallBaseline) },
        goal: "≤ 1.25 × skopeo + tar",
      },
      { name: "warm re-import, every layer cached (manifest + config check)", unit: "ms", better: "lower", median: median(warmTimes), goal: "≤ 200 ms" },
      {
        name: "small Dockerfile build end to end (buildah bud + push + import)",
        unit: "ms",
        better: "lower",
        median: median(buildTimes),
        baseline: { name: "buildah bud of the same Dockerfile, run directly", median: median(budTimes) },
      },
    ];
  } finally {
    await reg.stop();
    await rm(dir, { recursive: true, force: true });
  }
}
