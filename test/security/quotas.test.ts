// Fair kernel quotas (issue 18, item 22): the unprivileged user of one machine holding every inotify instance and
// message queue it can get leaves host root, volume watches and another machine working. On runc each machine's user
// namespace belongs to its own host uid, so the kernel charges the machine, not host root; gVisor keeps inotify and
// message queues inside its own kernel.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { WebSocket } from "ws";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { collectFrames } from "../support/frames.ts";
import { TEST_RUNTIME } from "../support/paths.ts";

let k: TestKiln;
before(async () => {
  k = await startTestKiln({ env: { KILN_WARM_POOL: "0" } });
});
after(async () => k?.close());

async function machine(body: Record<string, unknown> = {}): Promise<string> {
  const res = await k.call("POST", "/v1/machines", { body });
  assert.equal(res.status, 201, res.text);
  return res.body.id;
}

async function sh(id: string, cmd: string, user = "user") {
  const res = await k.call("POST", `/v1/machines/${id}/exec`, { body: { cmd, user } });
  assert.equal(res.status, 200, res.text);
  return res.body as { exit_code: number; stdout: string; stderr: string };
}

/**
 * Opens up to `inotify` inotify instances and `queues` POSIX message queues (default size), prints how many it got,
 * then holds them. The same program probes (holds nothing) when told to exit at once.
 */
const HOLDER = `
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
want_inotify, want_queues, name, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "hold"
fds = []
for i in range(want_inotify):
    fd = libc.inotify_init()
    if fd < 0:
        break
    fds.append(fd)
queues = []
for i in range(want_queues):
    q = libc.mq_open(("/%s-%d" % (name, i)).encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    if q < 0:
        break
    queues.append(q)
    if not hold:
        libc.mq_unlink(("/%s-%d" % (name, i)).encode())
print(len(fds), len(queues), flush=True)
if hold:
    open("/tmp/held.part", "w").write("%d %d\\n" % (len(fds), len(queues)))
    os.rename("/tmp/held.part", "/tmp/held")
    time.sleep(3600)
`;

/** Host root's own inotify and message queues, as the server and its volume watchers use them. */
function hostRootProbe(): string {
  return execFileSync("/usr/bin/python3", ["-c", HOLDER, "2", "1", `kiln-quota-host-${process.pid}`, "probe"], { encoding: "utf8" }).trim();
}

test("a machine's user holding every inotify instance and message queue it can leaves the host, volume watches and other machines working", async (t) => {
  const vol = await k.call("POST", "/v1/volumes", { body: { name: "quota", size_mb: 16 } });
  assert.equal(vol.status, 201, vol.text);
  const [attacker, other] = await Promise.all([machine({ volumes: [{ volume_id: vol.body.id, path: "/data" }] }), machine()]);
  await sh(attacker, `cat > /tmp/holder.py <<'EOF'\n${HOLDER}\nEOF`);
  const start = await sh(attacker, "setsid python3 /tmp/holder.py 127 10 held hold </dev/null >/dev/null 2>&1 & for i in $(seq 200); do test -e /tmp/held && break; sleep 0.05; done; cat /tmp/held");
  assert.equal(start.exit_code, 0, start.stderr);
  const [inotifyHeld, queuesHeld] = start.stdout.trim().split(" ").map(Number);
  t.diagnostic(`the machine's user holds ${inotifyHeld} inotify instances and ${queuesHeld} message queues`);
  // The attack is real: the user got what one user may hold (runc: its share of the machine's allowance; every
  // machine once shared host root's 128 instances and 800 KiB of queues).
  assert.ok(inotifyHeld >= 64, `the machine's user holds ${inotifyHeld} inotify instances`);
  assert.ok(queuesHeld >= 9, `the machine's user holds ${queuesHeld} message queues`);

  // Host root still gets inotify instances and message queues.
  assert.equal(hostRootProbe(), "2 1");
  // A volume watch (host-side inotifywait) still opens.
  const ws = new WebSocket(`${k.url.replace("http", "ws")}/v1/volumes/${vol.body.id}/ws`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
  const frames = collectFrames(ws);
  await new Promise((resolve, reject) => ws.once("open", resolve).once("error", reject));
  frames.send({ type: "file_watch", request_id: "w", path: "/", recursive: true });
  const started = await frames.next((f) => f.request_id === "w");
  assert.equal(started.type, "file_watch.started", JSON.stringify(started));
  await sh(attacker, "echo seen > /data/after-the-flood");
  const event = await frames.next((f) => f.type === "file_event" && f.path === "/after-the-flood");
  assert.ok(event);
  ws.close();
  // Another machine's users and root get theirs.
  assert.equal((await sh(other, `python3 - 8 4 other probe <<'EOF'\n${HOLDER}\nEOF`)).stdout.trim(), "8 4");
  assert.equal((await sh(other, `python3 - 8 4 other-root probe <<'EOF'\n${HOLDER}\nEOF`, "root")).stdout.trim(), "8 4");
  if (TEST_RUNTIME === "runc") {
    // Within the attacking machine, one uid holds at most its share: root (the agent's own watches) keeps some.
    assert.equal((await sh(attacker, `python3 - 4 0 root probe <<'EOF'\n${HOLDER}\nEOF`, "root")).stdout.trim(), "4 0");
  }
  await Promise.all([attacker, other].map((id) => k.call("DELETE", `/v1/machines/${id}`)));
});
