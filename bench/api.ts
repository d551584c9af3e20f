// What the machine benchmarks share: calling a Kiln's API, and timing a bare OCI runtime run of /bin/true on the
// base template's rootfs (the floor any machine on that runtime pays).

import { execFileSync } from "node:child_process";
import { mkdtemp, rm, writeFile, mkdir } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { request } from "undici";

/** One authenticated JSON call; any error status throws with the envelope. */
export async function api(url: string, key: string, method: string, path: string, body?: unknown): Promise<any> {
  const res = await request(url + path, {
    method: method as "POST",
    headers: { authorization: `Bearer ${key}`, ...(body === undefined ? {} : { "content-type": "application/json" }) },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const parsed = (await res.body.json()) as any;
  if (res.statusCode >= 400) throw new Error(`${method} ${path}: ${res.statusCode} ${JSON.stringify(parsed)}`);
  return parsed;
}

/** `<runtime> run` of /bin/true, n times, on a read-only bind of `layer` with the runtime's default spec. */
export async function bareRun(runtime: "runc" | "runsc", layer: string, n: number): Promise<number[]> {
  const dir = await mkdtemp(join(tmpdir(), `kiln-bench-${runtime}-`));
  // runsc as Kiln runs it, minus the network (a bare run has no namespace wired for it).
  const flags = runtime === "runsc" ? ["--platform=ptrace", "--network=none"] : [];
  try {
    execFileSync(runtime, ["spec", "--bundle", dir]);
    const spec = JSON.parse(execFileSync("cat", [join(dir, "config.json")], { encoding: "utf8" }));
    spec.root = { path: layer, readonly: true };
    spec.process.args = ["/bin/true"];
    spec.process.terminal = false;
    await writeFile(join(dir, "config.json"), JSON.stringify(spec));
    await mkdir(join(dir, "state"), { recursive: true });
    const times: number[] = [];
    for (let i = 0; i < n; i++) {
      const t0 = performance.now();
      execFileSync(runtime, ["--root", join(dir, "state"), ...flags, "run", "--bundle", dir, `kiln-bench-${process.pid}-${i}`], { stdio: "ignore" });
      times.push(performance.now() - t0);
    }
    return times;
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}
