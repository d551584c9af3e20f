// Code interpreter and git latencies a user feels: an execute round trip of `1+1` in a warm context (beside
// `python3 -c 1+1` through exec in the same machine), context create time (beside starting the same kernel with a
// plain script through exec), and a push of one small commit over smart HTTP (beside `git push` through exec).

import { request } from "undici";
import { api } from "./api.ts";
import { median, percentile, timed } from "./report.ts";
import type { BenchResult } from "./report.ts";
import type { BenchContext } from "./run.ts";
import { startTestKiln } from "../test/support/kiln.ts";
import { GUEST_LOADER } from "../src/runtime/guest-runtime.ts";
import { HTTP_USER, makeBareRepo, startHttpGitServer } from "../test/gitcode/git-servers.ts";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";

const EXECUTES = 300;

/** argv[1] executes of `1+1` through jupyter_client's BlockingKernelClient; prints their times (ms) as JSON. */
const BARE_JUPYTER_LOOP = `
import json, sys, time
from jupyter_client.manager import KernelManager
km = KernelManager(kernel_name="python3"); km.start_kernel(); kc = km.blocking_client(); kc.start_channels(); kc.wait_for_ready(timeout=60)
def run(code):
    mid = kc.execute(code)
    while True:
        m = kc.get_iopub_msg(timeout=10)
        if m["parent_header"].get("msg_id") == mid and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle": break
    while kc.get_shell_msg(timeout=10)["parent_header"].get("msg_id") != mid: pass
for _ in range(30): run("1+1")
times = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter(); run("1+1"); times.append((time.perf_counter() - t0) * 1000)
kc.stop_channels(); km.shutdown_kernel(now=True)
print(json.dumps(times))
`;
const CREATES = 8;
const PUSHES = 30;

/** POST an execute and read its NDJSON to the end frame. */
async function execute(url: string, key: string, id: string, body: Record<string, unknown>): Promise<string> {
  const res = await request(`${url}/v1/machines/${id}/code/execute`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const text = await res.body.text();
  if (res.statusCode !== 200 || !text.includes('"type":"end"')) throw new Error(`execute: ${res.statusCode} ${text}`);
  return text;
}

const row = (name: string, times: number[], baselineName: string, baseline: number[], extra: Partial<BenchResult> = {}): BenchResult => ({
  name,
  unit: "ms",
  better: "lower",
  median: median(times),
  p99: percentile(times, 99),
  baseline: { name: baselineName, median: median(baseline), p99: percentile(baseline, 99) },
  ...extra,
});

export async function run(ctx: BenchContext): Promise<BenchResult[]> {
  const results: BenchResult[] = [];
  const call = (method: string, path: string, body?: unknown) => api(ctx.kiln.url, ctx.key, method, path, body);
  // Long enough for every step below on a loaded host (the default 300 s is not).
  const m = await call("POST", "/v1/machines", { timeout_s: 3600 });
  const exec = (body: Record<string, unknown>) => call("POST", `/v1/machines/${m.id}/exec`, body);

  // Execute round trip in a warm Python context.
  const py = await call("POST", `/v1/machines/${m.id}/code/contexts`, { language: "python" });
  for (let i = 0; i < 30; i++) await execute(ctx.kiln.url, ctx.key, m.id, { code: "1+1", context_id: py.id });
  const executes = await timed(EXECUTES, () => execute(ctx.kiln.url, ctx.key, m.id, { code: "1+1", context_id: py.id }));
  const pythonC = await timed(Math.min(EXECUTES, 100), () => exec({ cmd: "/usr/bin/python3", args: ["-c", "1+1"] }));
  results.push(
    row(`code execute of \`1+1\`, warm Python context (${EXECUTES} executes)`, executes, "`python3 -c 1+1` through exec, same machine", pythonC, {
      goal: "p50 ≤ 5 ms",
      note: "HTTP + agent hop + bridge pipe + Jupyter messages to ipykernel and back, read to the end frame",
    }),
  );

  // The floor: a plain jupyter_client loop in the same machine (its blocking client, execute → idle → reply), no Kiln.
  const bare = await exec({ cmd: "/usr/bin/python3", args: ["-c", BARE_JUPYTER_LOOP, String(EXECUTES)], timeout_s: 300 });
  const bareTimes = JSON.parse(String(bare.stdout).trim().split("\n").at(-1)!) as number[];
  results.push(
    row(`code execute of \`1+1\`, warm Python context, beside a bare jupyter_client loop (${EXECUTES} executes)`, executes, "bare jupyter_client loop of `1+1` inside the same machine", bareTimes, {
      goal: "p50 ≤ 5 ms",
      note: "the same Kiln executes as the row above; the baseline is the kernel's own round trip, no Kiln",
    }),
  );

  const js = await call("POST", `/v1/machines/${m.id}/code/contexts`, { language: "javascript" });
  for (let i = 0; i < 30; i++) await execute(ctx.kiln.url, ctx.key, m.id, { code: "1+1", context_id: js.id });
  const jsExecutes = await timed(EXECUTES, () => execute(ctx.kiln.url, ctx.key, m.id, { code: "1+1", context_id: js.id }));
  const trueExec = await timed(Math.min(EXECUTES, 100), () => exec({ cmd: "true", args: [] }));
  results.push(row(`code execute of \`1+1\`, warm JavaScript context (${EXECUTES} executes)`, jsExecutes, "exec of `true`, same machine", trueExec));

  // Context create: the kernel is up when the answer comes.
  const creates = await timed(CREATES, async () => {
    const c = await call("POST", `/v1/machines/${m.id}/code/contexts`, { language: "python" });
    await call("DELETE", `/v1/machines/${m.id}/code/contexts/${c.id}`).catch(() => undefined);
  });
  const startScript = "from jupyter_client.manager import start_new_kernel\nkm, kc = start_new_kernel(kernel_name='python3')\nkc.stop_channels()\nkm.shutdown_kernel(now=True)";
  const plainStarts = await timed(CREATES, () => exec({ cmd: "/usr/bin/python3", args: ["-c", startScript], envs: { PYDEVD_DISABLE_FILE_VALIDATION: "1" }, timeout_s: 120 }));
  results.push(
    row(`code context create, Python (${CREATES} contexts, each deleted after)`, creates, "jupyter_client start_new_kernel + shutdown through exec", plainStarts, {
      note: "create answers when the kernel is ready; the timing includes the DELETE that stops it",
    }),
  );
  const jsCreates = await timed(CREATES, async () => {
    const c = await call("POST", `/v1/machines/${m.id}/code/contexts`, { language: "javascript" });
    await call("DELETE", `/v1/machines/${m.id}/code/contexts/${c.id}`).catch(() => undefined);
  });
  // The same Node the kernel runs on, started bare through exec (its loader, as the agent starts it).
  const nodeStarts = await timed(CREATES, () => exec({ cmd: `/opt/kiln/lib/${GUEST_LOADER}`, args: ["--library-path", "/opt/kiln/lib", "/opt/kiln/bin/node", "-e", "0"] }));
  results.push(row(`code context create, JavaScript (${CREATES} contexts, each deleted after)`, jsCreates, "`node -e 0` with /opt/kiln's Node through exec", nodeStarts));
  await call("DELETE", `/v1/machines/${m.id}`);

  // Push of one small commit over smart HTTP with Basic auth: a second Kiln whose machines reach the host's loopback.
  const root = await mkdtemp(join(tmpdir(), "kiln-bench-git-"));
  const password = "bench-password";
  const server = await startHttpGitServer(root, (p) => p === password);
  const hostKiln = await startTestKiln({ env: { KILN_LOG_LEVEL: "warn", KILN_MACHINE_HOST_ACCESS: "1" }, captureLogs: false });
  try {
    await makeBareRepo(root, "bench.git");
    const hcall = (method: string, path: string, body?: unknown) => api(hostKiln.url, ctx.key, method, path, body);
    const hm = await hcall("POST", "/v1/machines", {});
    const hexec = (cmd: string) => hcall("POST", `/v1/machines/${hm.id}/exec`, { cmd, user: "user" });
    const url = `http://host.kiln.internal:${server.port}/bench.git`;
    const auth = { kind: "https", username: HTTP_USER, password };
    await hcall("POST", `/v1/machines/${hm.id}/git/clone`, { url, path: "/workspace/bench", auth });
    const commit = (i: number, who: string) => hexec(`cd /workspace/bench && echo ${who}${i} > f.txt && git add f.txt && git -c user.name=b -c user.email=b@b commit -qm c${i}`);
    const apiPushes: number[] = [];
    const execPushes: number[] = [];
    for (let i = 0; i < PUSHES; i++) {
      await commit(i, "api");
      let t0 = performance.now();
      await hcall("POST", `/v1/machines/${hm.id}/git/push`, { path: "/workspace/bench", auth });
      apiPushes.push(performance.now() - t0);
      await commit(i, "exec");
      t0 = performance.now();
      // The baseline puts the password in the URL: what Kiln's push exists to avoid, but the same network work.
      const r = await hexec(`cd /workspace/bench && git push -q http://${HTTP_USER}:${password}@host.kiln.internal:${server.port}/bench.git HEAD:main`);
      execPushes.push(performance.now() - t0);
      if (r.exit_code !== 0) throw new Error(`baseline push failed: ${r.stderr}`);
    }
    results.push(
      row(`git push of one small commit over smart HTTP with credentials (${PUSHES} pushes)`, apiPushes, "`git push` with the password in the URL through exec", execPushes, {
        note: "Kiln's push adds a current-branch lookup and the credential scratch dir (askpass, files, removal)",
      }),
    );
  } finally {
    await hostKiln.close();
    await server.close();
    await rm(root, { recursive: true, force: true });
  }
  return results;
}
