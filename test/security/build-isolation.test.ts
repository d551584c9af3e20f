// A Dockerfile author against the host: RUN steps (and Buildah's own fetches) are probed from inside a real build
// through POST /v1/templates/build — their PID namespace, the network and the egress policy, a live machine they
// try to kill, build args on command lines and on disk, and the memory and pids limits.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { lookup } from "node:dns/promises";
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import type { TestRegistry } from "../support/oci-registry.ts";
import { TEST_CACHE_DIR } from "../support/paths.ts";
import { build, machineFrom, putBlob, sh } from "../builds/support.ts";
import type { SseEvent } from "../builds/support.ts";
import { BUILD_UID_BASE, busyboxRegistry, cmdlinesHolding, buildSkip, filesHolding, hostAddress, listener, machinePids, processes } from "./build-support.ts";

const skip = buildSkip();
let k: TestKiln;
let reg: TestRegistry;
let image: string;

before(async () => {
  if (skip) return;
  ({ reg, image } = await busyboxRegistry());
  k = await startTestKiln({ env: { KILN_INSECURE_REGISTRIES: reg.host, KILN_WARM_POOL: "0" } });
});

after(async () => {
  if (skip) return;
  await k.close();
  await reg.stop();
});

const lines = (events: SseEvent[]) => events.filter((e) => e.event === "message").map((e) => String(e.data.message));
const terminal = (events: SseEvent[]) => events.at(-1)!;

/** Builds `RUN`s on the busybox image; returns the stream's events (the test reads the outcome). */
async function dockerfile(body: string, extra: Record<string, unknown> = {}) {
  const r = await build(k, { name: `probe-${randomBytes(4).toString("hex")}`, dockerfile: `FROM ${image}\n${body}\n`, skip_cache: true, ...extra });
  assert.equal(r.status, 200, r.raw);
  return r.events;
}

/** The value printed after `tag=` in the build's output. */
function printed(events: SseEvent[], tag: string): string | undefined {
  const line = lines(events).findLast((l) => l.startsWith(`${tag}=`));
  return line?.slice(tag.length + 1).trim();
}

test("a RUN step sees its own PID 1 and no host or machine process, as root only in the builds' own id range", { skip }, async () => {
  const m = await machineFrom(k, "local/base");
  try {
    const events = await dockerfile('RUN echo "pid1=$(tr "\\0" " " < /proc/1/cmdline)"; echo "count=$(ls -d /proc/[0-9]* | wc -l)"; echo "map=$(cat /proc/self/uid_map)"; ps -o pid,args | sed "s/^/ps: /"');
    assert.equal(terminal(events).event, "end", JSON.stringify(terminal(events).data));
    assert.match(printed(events, "pid1")!, /^\/bin\/sh -c /, "PID 1 is the step's own shell");
    assert.ok(Number(printed(events, "count")) <= 8, `the step sees ${printed(events, "count")} processes`);
    assert.deepEqual(printed(events, "map")!.split(/\s+/), ["0", String(BUILD_UID_BASE), "65536"], "root in a RUN is host uid 1,000,000,000, a range no machine uses");
    const ps = lines(events).filter((l) => l.startsWith("ps: "));
    assert.ok(ps.length >= 2 && ps.every((l) => !/agent\.cjs|tini|kiln|node|buildah|slirp/.test(l)), `no machine, builder or host process is visible:\n${ps.join("\n")}`);
  } finally {
    await k.call("DELETE", `/v1/machines/${m}`);
  }
});

test("a RUN step cannot reach host loopback, Kiln's API, the host's address or a private range; the internet works", { skip }, async () => {
  const loop = await listener("127.0.0.1");
  const addr = hostAddress();
  const onHost = await listener(addr);
  const kilnPort = new URL(k.url).port;
  // busybox's static nc cannot resolve names (no NSS): the mirror's address is looked up here.
  const mirror = (await lookup("deb.debian.org", { family: 4 })).address;
  try {
    const probe = (name: string, host: string, port: string | number, path = "/v1/health", vhost = host) =>
      `(printf 'GET ${path} HTTP/1.0\\r\\nHost: ${vhost}\\r\\n\\r\\n'; sleep 2) | nc -w 5 ${host} ${port} > /tmp/o 2>&1; echo "${name}=$(head -c 40 /tmp/o | tr -d '\\r\\n')"`;
    const events = await dockerfile(
      [
        `RUN ${probe("gateway", "10.0.2.2", loop.port)}`,
        `RUN ${probe("kiln", "10.0.2.2", kilnPort)}`,
        `RUN ${probe("hostaddr", addr, onHost.port)}`,
        `RUN ${probe("kilnaddr", addr, kilnPort)}`,
        `RUN ${probe("private", "10.1.2.3", 80)}`,
        `RUN ${probe("metadata", "169.254.169.254", 80)}`,
        `RUN ${probe("mirror", mirror, 80, "/debian/dists/bookworm/Release", "deb.debian.org")}`,
      ].join("\n"),
    );
    assert.equal(terminal(events).event, "end", JSON.stringify(terminal(events).data));
    for (const name of ["gateway", "kiln", "hostaddr", "kilnaddr", "private", "metadata"]) assert.doesNotMatch(printed(events, name) ?? "", /HTTP|MARKER/, `${name}: nothing answered`);
    assert.equal(loop.accepted() + onHost.accepted(), 0, "no connection reached a listener on the host");
    assert.match(printed(events, "mirror") ?? "", /HTTP\/1\.\d/, "the Debian mirror answers: RUN steps do have the internet");
  } finally {
    await loop.close();
    await onHost.close();
  }
});

test("ADD http:// to host loopback, Kiln's API, the host's address or a private range is refused; a public URL is fetched", { skip }, async () => {
  const loop = await listener("127.0.0.1");
  const addr = hostAddress();
  const onHost = await listener(addr);
  try {
    for (const url of [`http://127.0.0.1:${loop.port}/marker`, `${k.url}/v1/health`, `http://${addr}:${onHost.port}/marker`, "http://10.1.2.3/x", "http://169.254.169.254/latest/meta-data/"]) {
      const events = await dockerfile(`ADD ${url} /fetched`);
      assert.equal(terminal(events).event, "error", `ADD ${url} must fail`);
    }
    assert.equal(loop.accepted() + onHost.accepted(), 0, "no fetch reached a listener on the host");
    const ok = await dockerfile("ADD http://deb.debian.org/debian/dists/bookworm/Release /Release\nRUN head -c 6 /Release; echo");
    assert.equal(terminal(ok).event, "end", `a public URL is fetched: ${JSON.stringify(terminal(ok).data)}`);
  } finally {
    await loop.close();
    await onHost.close();
  }
});

test("a RUN step cannot signal a machine: the machine survives kill -9 -1 and kills of its host pids", { skip }, async () => {
  const m = await machineFrom(k, "local/base");
  try {
    assert.equal((await sh(k, m, "echo alive")).stdout, "alive\n");
    const pids = machinePids(m);
    assert.ok(pids.length > 0, "the machine's processes are found on the host");
    const events = await dockerfile(
      [
        "ARG PIDS",
        'RUN for p in $PIDS; do kill -9 $p 2>&1; done; for p in $(seq 2 40000); do kill -9 $p 2>/dev/null; done; kill -9 -1; echo "signalled=done"',
      ].join("\n"),
      { build_args: { PIDS: pids.join(" ") } },
    );
    assert.equal(printed(events, "signalled"), "done");
    for (const pid of pids) assert.ok(processes().some((p) => p.pid === pid), `machine process ${pid} is still there`);
    assert.equal((await sh(k, m, "echo still alive")).stdout, "still alive\n");
    assert.equal((await k.call("GET", `/v1/machines/${m}`)).body.status, "running");
  } finally {
    await k.call("DELETE", `/v1/machines/${m}`);
  }
});

test("RUN --mount binds and caches reach only the build context and the build's own cache, never a host path", { skip }, async () => {
  const dir = await mkdtemp(join(tmpdir(), "kiln-mount-probe-"));
  const marker = `hostfile-${randomBytes(8).toString("hex")}`;
  await writeFile(join(dir, "secret.txt"), marker, { mode: 0o644 });
  await chmod(dir, 0o755);
  try {
    const up = "../".repeat(12) + dir.slice(1);
    for (const mount of [`type=bind,source=${dir}`, `type=bind,source=${up}`, "type=bind,source=/", `type=cache,source=${up}`, `type=cache,source=${dir}`]) {
      const events = await dockerfile(`RUN --mount=${mount},target=/h cat /h/secret.txt /h${dir}/secret.txt 2>&1; ls /h | sed "s/^/ls: /"; true`);
      assert.ok(!JSON.stringify(events).includes(marker), `--mount=${mount} showed a host file`);
      assert.equal(terminal(events).event, "end", `--mount=${mount}: ${JSON.stringify(terminal(events).data)}`);
    }
    // The context itself is what a bind mount shows, also when Kiln runs with a private umask.
    const sha = await putBlob(k, "from the context\n");
    const previous = process.umask(0o077);
    try {
      const events = await dockerfile("RUN --mount=type=bind,source=sub,target=/c cat /c/file.txt | sed 's/^/ctx=/'", { context: { files: [{ path: "sub/file.txt", sha256: sha }] } });
      assert.equal(printed(events, "ctx"), "from the context");
    } finally {
      process.umask(previous);
    }
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("a build arg is on no command line during the build and nowhere in the data dir, the log or the image", { skip }, async () => {
  const marker = `argmark-${randomBytes(12).toString("hex")}`;
  let seen: string[] = [];
  let running = true;
  const watch = (async () => {
    while (running) {
      seen.push(...cmdlinesHolding(marker));
      await new Promise((r) => setTimeout(r, 50));
    }
  })();
  const events = await dockerfile(["ARG SECRET_ARG", 'RUN [ "$SECRET_ARG" = "' + marker.slice(0, 8) + '$(echo ' + marker.slice(8) + ')" ] && echo arg=arrived; sleep 2'].join("\n"), {
    build_args: { SECRET_ARG: marker },
  });
  running = false;
  await watch;
  seen = [...new Set(seen)];
  assert.equal(terminal(events).event, "end", JSON.stringify(terminal(events).data));
  assert.equal(printed(events, "arg"), "arrived", "the RUN step had the build arg");
  assert.deepEqual(seen, [], "no /proc/*/cmdline held the build arg");
  assert.deepEqual(filesHolding(k.dataDir, marker), [], "nothing in the data dir holds it");
  assert.deepEqual(filesHolding(`${TEST_CACHE_DIR}/oci/blobs`, marker), [], "nor the imported image's config (no history)");
  assert.ok(!k.logs.join("").includes(marker), "nor the server's log");
  assert.ok(!JSON.stringify(events).includes(marker), "nor the build log");
});

test("a memory hog fails its step at vm.memory_mb and a fork bomb at the pids limit; the host and server are fine", { skip }, async () => {
  const hog = await dockerfile('RUN cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null | sed "s/^/limit=/"; x=$(head -c 700000000 /dev/zero | tr "\\0" a); echo "survived=${#x}"', { vm: { memory_mb: 128 } });
  assert.equal(terminal(hog).event, "error", "the step was killed");
  assert.equal(printed(hog, "limit"), String(128 * 1024 * 1024), "the step's cgroup has the build's memory limit");
  assert.equal(printed(hog, "survived"), undefined);

  const tag = 3000 + Math.floor(Math.random() * 999);
  const bomb = await dockerfile(
    `RUN cat /sys/fs/cgroup/pids/pids.max 2>/dev/null | sed "s/^/pidsmax=/"; i=0; while [ $i -lt 5000 ]; do sleep ${tag} & i=$((i+1)); done 2>/dev/null; echo "running=$(ls -d /proc/[0-9]* | wc -l)"`,
  );
  assert.equal(printed(bomb, "pidsmax"), "2048", "the step's cgroup has the pids limit");
  const running = printed(bomb, "running");
  assert.ok(terminal(bomb).event === "error" || Number(running) <= 2048, `the bomb stopped at the limit (${running} processes)`);
  assert.equal((await k.call("GET", "/health")).status, 200, "the server answers");
  assert.deepEqual(
    processes().filter((p) => p.cmdline === `sleep ${tag}`),
    [],
    "no process of the bomb is left",
  );
});

test("a Dockerfile on a Kiln template runs its RUNs in build machines: no host, Kiln API or private range; memory and pids capped", { skip }, async () => {
  const loop = await listener("127.0.0.1");
  const addr = hostAddress();
  const onHost = await listener(addr);
  const kilnPort = new URL(k.url).port;
  try {
    const probe = (name: string, host: string, port: string | number) => `curl -s -m 4 -o /tmp/o http://${host}:${port}/v1/health; echo "${name}=$(head -c 40 /tmp/o 2>/dev/null | tr -d '\\r\\n')"`;
    const r = await build(k, {
      name: `probe-native-${randomBytes(4).toString("hex")}`,
      dockerfile: [
        "FROM local/base",
        `RUN ${probe("gateway", "10.0.2.2", loop.port)}`,
        `RUN ${probe("kiln", "10.0.2.2", kilnPort)}`,
        `RUN ${probe("hostaddr", addr, onHost.port)}; ${probe("kilnaddr", addr, kilnPort)}; ${probe("private", "10.1.2.3", 80)}; ${probe("metadata", "169.254.169.254", 80)}`,
        `RUN echo "memmax=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max)"; echo "pidsmax=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max)"`,
      ].join("\n"),
      vm: { memory_mb: 256 },
      skip_cache: true,
    });
    const events = r.events;
    assert.equal(terminal(events).event, "end", JSON.stringify(terminal(events).data));
    assert.ok(lines(events).some((l) => /run as steps on template local\/base/.test(l)), "Kiln's executor ran it");
    for (const name of ["gateway", "kiln", "hostaddr", "kilnaddr", "private", "metadata"]) assert.doesNotMatch(printed(events, name) ?? "", /\{|HTTP|ok/, `${name}: nothing answered`);
    assert.equal(loop.accepted() + onHost.accepted(), 0, "no connection reached a listener on the host");
    // Under runc the RUN reads its own cgroup's limits; gVisor's sandbox shows no host cgroup inside (its limits are
    // the sandbox's host cgroup, checked for machines by the quotas tests).
    if (process.env.KILN_OCI_RUNTIME !== "runsc") {
      assert.equal(printed(events, "memmax"), String(256 * 1024 * 1024), `the RUN's cgroup has the build's memory limit: ${lines(events).filter((l) => /max=/.test(l)).join(" | ")}`);
      assert.match(printed(events, "pidsmax") ?? "", /^\d+$/, "and a pids limit");
    }
  } finally {
    await loop.close();
    await onHost.close();
  }
});
