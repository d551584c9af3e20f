// Webhook receivers as an attacker picks them: IPv6 forms that carry an IPv4 address (IPv4-compatible, mapped,
// translated, NAT64, 6to4, Teredo) are judged by the address they carry, when a webhook is created and when a delivery
// connects (by literal or by a name resolving to one); a receiver whose body drips past the attempt timeout fails.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { Server } from "node:http";
import type { AddressInfo } from "node:net";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openStore } from "../../src/store/db.ts";
import type { Store } from "../../src/store/db.ts";
import { createLogger } from "../../src/log.ts";
import { newId } from "../../src/store/ids.ts";
import { createDispatcher } from "../../src/webhooks/dispatcher.ts";
import type { DispatcherOptions } from "../../src/webhooks/dispatcher.ts";
import { announceDeliveries, enqueueDeliveries } from "../../src/webhooks/outbox.ts";
import { createWebhookService } from "../../src/webhooks/service.ts";
import { BlockList } from "node:net";
import { addressProblem, classifyAddress, refusedCidrs } from "../../src/net/addresses.ts";
import { startTestKiln } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";

/** 127.0.0.1 carried in every IPv6 form that can carry it. */
const LOOPBACK_FORMS: Record<string, string> = {
  "IPv4-compatible ::/96": "::127.0.0.1",
  "IPv4-mapped ::ffff:0:0/96": "::ffff:127.0.0.1",
  "IPv4-mapped, hex": "::ffff:7f00:1",
  "IPv4-translated ::ffff:0:0:0/96": "::ffff:0:7f00:1",
  "NAT64 64:ff9b::/96": "64:ff9b::7f00:1",
  "local-use NAT64 64:ff9b:1::/48": "64:ff9b:1::7f00:1",
  "6to4 2002::/16": "2002:7f00:1::1",
  "Teredo server 2001::/32": "2001:0:7f00:1::f7f7:f7f7",
  // The client address is stored inverted: ~0x80fffffe = 0x7f000001.
  "Teredo client 2001::/32": "2001:0:808:808:0:0:80ff:fffe",
};

/** 169.254.169.254 (cloud metadata) the same ways: never allowed, even with private addresses allowed. */
const METADATA_FORMS: Record<string, string> = {
  "IPv4-compatible ::/96": "::169.254.169.254",
  "IPv4-mapped ::ffff:0:0/96": "::ffff:a9fe:a9fe",
  "IPv4-translated ::ffff:0:0:0/96": "::ffff:0:a9fe:a9fe",
  "NAT64 64:ff9b::/96": "64:ff9b::a9fe:a9fe",
  "local-use NAT64 64:ff9b:1::/48": "64:ff9b:1::a9fe:a9fe",
  "6to4 2002::/16": "2002:a9fe:a9fe::",
  "Teredo server 2001::/32": "2001:0:a9fe:a9fe::f7f7:f7f7",
  "Teredo client 2001::/32": "2001:0:808:808::5601:5601",
};

let dir: string;
let store: Store;
let rx: Receiver;
const log = createLogger({ level: "silent", pretty: false });

before(async () => {
  dir = await mkdtemp(join(tmpdir(), "kiln-sec-webhooks-"));
  store = await openStore({ dataDir: dir });
  rx = await startReceiver();
});
after(async () => {
  await rx?.close();
  await store?.close();
  await rm(dir, { recursive: true, force: true });
});

test("the outbound classifier judges an IPv6 address that carries an IPv4 one by the IPv4 address it carries", () => {
  for (const [form, ip] of Object.entries(LOOPBACK_FORMS)) {
    const v = classifyAddress(ip);
    assert.equal(v.class, "private", `${form} ${ip}`);
    assert.ok(addressProblem(ip, false), `${form} ${ip} is refused by default`);
    assert.equal(addressProblem(ip, true), null, `${form} ${ip} is allowed where private addresses are`);
  }
  for (const [form, ip] of Object.entries(METADATA_FORMS)) {
    assert.equal(classifyAddress(ip).class, "never", `${form} ${ip}`);
    assert.match(addressProblem(ip, true) ?? "", /carries 169\.254\.169\.254/, `${form} ${ip} is refused even where private addresses are allowed`);
  }
  // A public IPv4 address carried is public; a network-specific NAT64 prefix is private whatever it carries.
  for (const ip of ["64:ff9b::808:808", "::ffff:8.8.8.8", "2002:808:808::1", "2001:0:808:808::7f7f:f7f7", "2606:4700::1111"]) assert.equal(classifyAddress(ip).class, "always", ip);
  assert.equal(classifyAddress("64:ff9b:1::808:808").class, "private");
  // `::` and `::1` sit inside ::/96 but mean themselves.
  assert.equal(classifyAddress("::").class, "never");
  assert.equal(classifyAddress("::1").class, "private");
  assert.deepEqual(classifyAddress("64:ff9b::7f00:1").embedded, { ipv4: "127.0.0.1", form: "NAT64 64:ff9b::/96" });
  assert.equal(classifyAddress("not an address").class, "never");
});

test("machines' egress filter refuses what the classifier refuses, IPv6 forms carrying IPv4 included, and lets public addresses through", () => {
  const { v4, v6 } = refusedCidrs();
  // One list per family, as nftables keeps them (a BlockList would match IPv4 against IPv6 ranges that carry it).
  const lists = { ipv4: new BlockList(), ipv6: new BlockList() };
  for (const c of v4) lists.ipv4.addSubnet(c.split("/")[0], Number(c.split("/")[1]), "ipv4");
  for (const c of v6) lists.ipv6.addSubnet(c.split("/")[0], Number(c.split("/")[1]), "ipv6");
  const inList = (ip: string) => (ip.includes(":") ? lists.ipv6.check(ip, "ipv6") : lists.ipv4.check(ip, "ipv4"));
  for (const ip of [...Object.values(LOOPBACK_FORMS), ...Object.values(METADATA_FORMS), "127.0.0.1", "10.9.8.7", "169.254.169.254", "::1", "fd00::1", "fe80::1", "64:ff9b::a00:1", "2002:c0a8:101::1"]) {
    assert.ok(inList(ip), `${ip} (${classifyAddress(ip).class}) is refused by the egress sets`);
  }
  for (const ip of ["8.8.8.8", "2606:4700::1111", "64:ff9b::808:808", "2002:808:808::1"]) assert.ok(!inList(ip), `${ip} passes the egress sets`);
  // Interval sets refuse overlapping elements: no range lies inside another.
  for (const [family, cidrs] of [["ipv4", v4], ["ipv6", v6]] as const) {
    for (const c of cidrs) {
      const others = new BlockList();
      for (const o of cidrs) if (o !== c) others.addSubnet(o.split("/")[0], Number(o.split("/")[1]), family);
      assert.ok(!others.check(c.split("/")[0], family), `${c} lies inside another refused range`);
    }
  }
});

test("a webhook whose URL names an IPv6 form carrying a loopback or metadata address is refused at create (400), through the API", async () => {
  let k: TestKiln | undefined;
  try {
    k = await startTestKiln({ waitForBase: false, env: { KILN_WARM_POOL: "0" } });
    const port = new URL(rx.url).port;
    for (const [form, ip] of [...Object.entries(LOOPBACK_FORMS), ...Object.entries(METADATA_FORMS)]) {
      const res = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `http://[${ip}]:${port}/create`, operations: ["create"] } });
      assert.equal(res.status, 400, `${form} ${ip}: ${res.text}`);
      assert.equal(res.body.code, "invalid_request");
      assert.match(res.body.error, /carries (127\.0\.0\.1|169\.254\.169\.254)/, `${form}: the answer names the address carried`);
    }
    // The same check refuses a PATCH to such a URL, and a public form passes.
    const ok = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: "http://[64:ff9b::808:808]/public", operations: ["create"] } });
    assert.equal(ok.status, 201, ok.text);
    const patched = await k.call("PATCH", `/v1/lifecycle/webhooks/${ok.body.id}`, { body: { url: `http://[64:ff9b::7f00:1]:${port}/patched` } });
    assert.equal(patched.status, 400, patched.text);
    assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${ok.body.id}`)).body.url, "http://[64:ff9b::808:808]/public", "a refused patch changed nothing");
  } finally {
    await k?.close();
  }
  assert.equal(rx.received.length, 0);
});

function dispatcher(opts: Partial<DispatcherOptions>) {
  return createDispatcher({ db: store.db, dialect: store.dialect, hostId: "host-sec", log, scheduleMs: [0], allowPrivate: false, ...opts });
}

async function emit(operation: string): Promise<string> {
  const id = newId("evt");
  await store.db.transaction().execute((tx) => enqueueDeliveries(tx, { id, operation, occurredAt: new Date().toISOString(), payload: { id, operation } }));
  announceDeliveries(store.db);
  return id;
}

async function outcome(eventId: string, webhookId: string): Promise<{ status: string; attempts: { error: string | null; status_code: number | null }[] }> {
  for (let i = 0; i < 1500; i++) {
    const row = await store.db.selectFrom("webhook_deliveries").selectAll().where("event_id", "=", eventId).where("webhook_id", "=", webhookId).executeTakeFirst();
    if (row && (row.status === "succeeded" || row.status === "dead_letter")) {
      const attempts = await store.db.selectFrom("webhook_delivery_attempts").select(["error", "status_code"]).where("delivery_id", "=", row.id).orderBy("attempt").execute();
      return { status: row.status, attempts };
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.fail("the delivery never finished");
}

/** A webhook row written straight to the store: a URL the API would refuse (an older store, a hand edit). */
async function rowWithUrl(url: string): Promise<string> {
  const hooks = createWebhookService({ db: store.db, allowPrivate: true, rotationGraceMs: 1000, wake: () => undefined });
  const w = await hooks.create({ url: `${rx.url}/placeholder`, operations: ["update"] });
  await store.db.updateTable("webhooks").set({ url }).where("id", "=", w.id).execute();
  return w.id;
}

test("at delivery, an IPv6 literal or a name resolving to a form carrying loopback or metadata is refused before a byte is sent", async () => {
  const port = new URL(rx.url).port;
  const byLiteral = new Map<string, string>();
  const byName = new Map<string, string>();
  const names: Record<string, string> = {};
  for (const [i, [form, ip]] of Object.entries(LOOPBACK_FORMS).entries()) {
    byLiteral.set(await rowWithUrl(`http://[${ip}]:${port}/literal-${i}`), `${form} ${ip}`);
    names[`form-${i}.kiln.test`] = ip;
    byName.set(await rowWithUrl(`http://form-${i}.kiln.test:${port}/name-${i}`), `${form} ${ip}`);
  }
  const metadata = new Map<string, string>();
  for (const [form, ip] of Object.entries(METADATA_FORMS)) metadata.set(await rowWithUrl(`http://[${ip}]:${port}/metadata`), `${form} ${ip}`);
  // Names resolve to what the test says, as a hostile DNS answer would.
  const resolve = ((host: string, _o: unknown, cb: (err: NodeJS.ErrnoException | null, a: { address: string; family: number }[]) => void) => {
    const ip = names[host];
    if (ip) cb(null, [{ address: ip, family: 6 }]);
    else cb(Object.assign(new Error(`${host} unknown`), { code: "ENOTFOUND" }), []);
  }) as DispatcherOptions["resolve"];
  const strict = dispatcher({ allowPrivate: false, resolve });
  await strict.start();
  try {
    const evt = await emit("update");
    for (const [id, what] of [...byLiteral, ...byName, ...metadata]) {
      const done = await outcome(evt, id);
      assert.equal(done.status, "dead_letter", what);
      assert.match(done.attempts[0].error ?? "", /^refused: .*carries (127\.0\.0\.1|169\.254\.169\.254)/, what);
    }
  } finally {
    await strict.close();
  }
  assert.equal(rx.received.filter((r) => /^\/(literal|name|metadata)/.test(r.path)).length, 0, "no request reached the receiver");
  // With private addresses allowed, metadata stays refused in every form (the loopback forms are allowed then).
  await store.db.deleteFrom("webhooks").where("id", "not in", [...metadata.keys()]).execute();
  const loose = dispatcher({ allowPrivate: true, resolve });
  await loose.start();
  try {
    const evt = await emit("update");
    for (const [id, what] of metadata) assert.match((await outcome(evt, id)).attempts[0].error ?? "", /^refused: .*never allowed/, what);
  } finally {
    await loose.close();
  }
  assert.equal(rx.received.filter((r) => r.path === "/metadata").length, 0, "no request reached the receiver");
  await store.db.deleteFrom("webhooks").execute();
});

test("a receiver that answers 200 but drips its body past the attempt timeout is a failed attempt, not a success", async () => {
  let dripping = true;
  const drips: Server = createServer((req, res) => {
    req.resume();
    res.writeHead(200, { "content-type": "text/plain" });
    if (!dripping) return res.end("done");
    const timer = setInterval(() => res.write("."), 100);
    res.on("close", () => clearInterval(timer));
  });
  await new Promise<void>((r) => drips.listen(0, "127.0.0.1", r));
  const url = `http://127.0.0.1:${(drips.address() as AddressInfo).port}/drip`;
  const id = await rowWithUrl(url);
  const d = dispatcher({ allowPrivate: true, timeoutMs: 1000 });
  await d.start();
  try {
    const evt = await emit("update");
    const done = await outcome(evt, id);
    assert.equal(done.status, "dead_letter");
    assert.equal(done.attempts.length, 1);
    assert.equal(done.attempts[0].status_code, 200, "the status line that came is recorded");
    assert.match(done.attempts[0].error ?? "", /timed out after 1000 ms \(the 200 answer's body did not finish\)/);
    // The same receiver finishing its body in time succeeds: the check can tell the two apart.
    dripping = false;
    const again = await outcome(await emit("update"), id);
    assert.equal(again.status, "succeeded");
    assert.equal(again.attempts[0].error, null);
  } finally {
    await d.close();
    drips.closeAllConnections();
    await new Promise((r) => drips.close(r));
    await store.db.deleteFrom("webhooks").execute();
  }
});
