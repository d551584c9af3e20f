// A kernel against its machine's agent (second round of issue 18's inside parties): code that floods output while
// its caller reads slowly is paced by the caller, never buffered without bound by the guest agent — the agent is
// kept out of the OOM killer's way, so an agent that grew would take its whole machine down. Runs on runc and gVisor.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startUnread, readOn } from "../support/unread.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

async function sh(id: string, cmd: string) {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user: "root", timeout_s: 60 } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number | null; stdout: string; stderr: string };
}

/** The guest agent's resident memory in KiB, read inside the machine. */
async function agentRssKiB(id: string): Promise<number> {
  const out = await sh(id, `for p in /proc/[0-9]*; do grep -q agent.cjs $p/cmdline 2>/dev/null && awk '/^VmRSS/ {print $2}' $p/status; done | sort -n | tail -1`);
  const kib = Number(out.stdout.trim());
  assert.ok(kib > 0, `the agent's RSS was read: ${JSON.stringify(out)}`);
  return kib;
}

for (const language of ["python", "javascript"] as const) {
  test(`a ${language} kernel flooding output to a caller that does not read is paced: the agent stays small and the machine keeps running`, async () => {
    const res = await k.call("POST", "/v1/machines", { body: { template: "local/base", memory_mb: 1024, timeout_s: 600 } });
    assert.equal(res.status, 201, res.text);
    const m = res.body as { id: string };
    const before = await agentRssKiB(m.id);
    const code = language === "python" ? `line = "y" * 200\nwhile True:\n    print(line)` : `const line = "y".repeat(4000); for (;;) console.log(line)`;
    const unread = await startUnread(
      new URL(`${k.url}/v1/machines/${m.id}/code/execute`),
      { authorization: `Bearer ${TEST_KEY}`, "content-type": "application/json" },
      JSON.stringify({ code, language, timeout_s: 120 }),
    );
    assert.equal(unread.statusCode, 200);
    // The kernel writes tens of MB a second; without pacing the agent holds all of it (a 512 MB machine is killed by
    // the OOM killer within about 20 s).
    await sleep(20_000);
    const during = await agentRssKiB(m.id);
    const view = await k.call("GET", `/v1/machines/${m.id}`);
    assert.equal(view.body.status, "running", `the machine: ${view.text}`);
    assert.ok(during - before < 100 * 1024, `the agent grew from ${before} to ${during} KiB while its caller did not read`);
    // The caller reads on: what waited is handed over. (ipykernel itself keeps what its reader does not take, so a
    // Python kernel that floods on may end by the OOM killer: its own death, reported as KernelDied, not the machine's.)
    const got = (await readOn(unread, 4 * 1024 * 1024)).length;
    assert.ok(got > 4 * 1024 * 1024, `the caller read ${got} bytes once it read`);
    // Hanging up interrupted the execute. A new context works; so does the JavaScript one that flooded (its console
    // survives an interrupt that lands mid-write). The Python one may have been ended as hung: ipykernel still had the
    // flood to hand over when the interrupt's grace ran out (docs/git-and-kernels.md).
    const say = language === "python" ? "print(6 * 7)" : "console.log(6 * 7)";
    const ctx = await k.call("POST", `/v1/machines/${m.id}/code/contexts`, { body: { language } });
    assert.equal(ctx.status, 201, ctx.text);
    const fresh = await k.call("POST", `/v1/machines/${m.id}/code/execute`, { body: { code: say, context_id: ctx.body.id } });
    assert.match(fresh.text, /"text":"42\\n"/);
    if (language === "javascript") {
      const same = await k.call("POST", `/v1/machines/${m.id}/code/execute`, { body: { code: say, language } });
      assert.match(same.text, /"text":"42\\n"/);
    }
    await k.call("DELETE", `/v1/machines/${m.id}`);
  });
}
